"""run_install_step: output logged, failures and overruns turned into the caller's error."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from tests.harness.install_step import run_install_step


class StepError(RuntimeError):
    pass


@pytest.fixture
def log(tmp_path: Path) -> Iterator[IO[bytes]]:
    """A real file: the step's output goes to it from the child process."""
    with (tmp_path / "install.log").open("w+b") as handle:
        yield handle


def logged(log: IO[bytes]) -> bytes:
    log.seek(0)
    return log.read()


def test_a_step_runs_and_its_output_goes_to_the_log(log: IO[bytes]) -> None:
    argv = [sys.executable, "-c", "print('installed')"]
    run_install_step(argv, log, time.monotonic() + 60, StepError, "test install")
    assert b"$ " + sys.executable.encode() in logged(log)
    assert b"installed" in logged(log)


def test_a_failing_step_raises_the_callers_error_with_its_exit_code(log: IO[bytes]) -> None:
    argv = [sys.executable, "-c", "raise SystemExit(3)"]
    with pytest.raises(StepError, match="failed with exit code 3"):
        run_install_step(argv, log, time.monotonic() + 60, StepError, "test install")


def test_a_step_past_the_deadline_is_stopped_or_not_started(log: IO[bytes]) -> None:
    argv = [sys.executable, "-c", "import time; time.sleep(30)"]
    with pytest.raises(StepError, match="did not finish in time"):
        run_install_step(argv, log, time.monotonic() + 0.5, StepError, "test install")
    with pytest.raises(StepError, match="test install ran out of time"):
        run_install_step(argv, log, time.monotonic() - 1, StepError, "test install")


def test_a_step_runs_in_the_directory_it_is_given(log: IO[bytes], tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import os; print(os.getcwd())"]
    run_install_step(argv, log, time.monotonic() + 60, StepError, "test install", cwd=tmp_path)
    assert str(tmp_path).encode() in logged(log)
