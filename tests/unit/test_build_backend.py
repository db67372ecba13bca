"""The build backend asks for what the compiled build needs only when it is asked for, so that
`PDPROXY_COMPILE=1 pip install .` works with build isolation and the pure build stays light."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "build_support"))

import pdproxy_build  # noqa: E402


def names(requirements: list[str]) -> set[str]:
    return {r.split(">")[0].split("=")[0].split("<")[0].split(";")[0].strip() for r in requirements}


def test_the_pure_build_asks_for_setuptools_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("PDPROXY_COMPILE", raising=False)
    assert pdproxy_build.compiled_requires() == []
    assert "mypy" not in names(pdproxy_build.get_requires_for_build_wheel())


def test_the_compiled_build_asks_for_mypy_and_pdproxys_dependencies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PDPROXY_COMPILE", "1")
    for hook in (
        pdproxy_build.get_requires_for_build_wheel,
        pdproxy_build.get_requires_for_build_editable,
    ):
        asked = names(hook())
        # mypyc type-checks the compiled modules, which import these.
        assert {"mypy", "pydantic", "orjson", "pyzmq", "httptools", "types-PyYAML"} <= asked
