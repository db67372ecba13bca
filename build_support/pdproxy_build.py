"""pdproxy's build backend: setuptools', plus what the compiled build needs to build.

`PDPROXY_COMPILE=1 pip install .` compiles the hot path with mypyc (setup.py), which type-checks
those modules: the isolated build environment then needs mypy, the type stubs, and pdproxy's own
dependencies. A static [build-system] list cannot depend on that variable, so this backend adds
them only when it is set; the pure build needs nothing beyond setuptools.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from setuptools import build_meta
from setuptools.build_meta import *  # noqa: F403  (the rest of the backend, unchanged)

COMPILER_REQUIRES = ("mypy>=1.10", "types-PyYAML")


def compiled_requires() -> list[str]:
    """What building the compiled modules imports: mypyc, stubs, pdproxy's dependencies."""
    if os.environ.get("PDPROXY_COMPILE", "0") != "1":
        return []
    project = tomllib.loads(Path("pyproject.toml").read_text(encoding="utf-8"))["project"]
    return [*COMPILER_REQUIRES, *project["dependencies"]]


@contextmanager
def _pure_setup() -> Iterator[None]:
    """setuptools runs setup.py to find its own build requirements: with the compile switch on,
    that would import mypyc before it is installed. Those requirements are the same for both
    builds, so setup.py runs pure for this question."""
    switch = os.environ.pop("PDPROXY_COMPILE", None)
    try:
        yield
    finally:
        if switch is not None:
            os.environ["PDPROXY_COMPILE"] = switch


def _requires(
    base: Callable[[dict[str, Any] | None], list[str]], config_settings: dict[str, Any] | None
) -> list[str]:
    extra = compiled_requires()
    with _pure_setup():
        return [*base(config_settings), *extra]


def get_requires_for_build_wheel(config_settings: dict[str, Any] | None = None) -> list[str]:
    return _requires(build_meta.get_requires_for_build_wheel, config_settings)


def get_requires_for_build_editable(config_settings: dict[str, Any] | None = None) -> list[str]:
    return _requires(build_meta.get_requires_for_build_editable, config_settings)
