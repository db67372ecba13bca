"""run_install_step: output logged, failures and overruns turned into the caller's error."""

from __future__ import annotations

import io
import sys
import time

import pytest

from pdproxy.testing.install_step import run_install_step


class StepError(RuntimeError):
    pass


def test_a_step_runs_and_its_output_goes_to_the_log() -> None:
    log = io.BytesIO()
    argv = [sys.executable, "-c", "print('installed')"]
    run_install_step(argv, log, time.monotonic() + 60, StepError, "test install")
    assert b"$ " + sys.executable.encode() in log.getvalue()
    assert b"installed" in log.getvalue()


def test_a_failing_step_raises_the_callers_error_with_its_exit_code() -> None:
    argv = [sys.executable, "-c", "raise SystemExit(3)"]
    with pytest.raises(StepError, match="failed with exit code 3"):
        run_install_step(argv, io.BytesIO(), time.monotonic() + 60, StepError, "test install")


def test_a_step_past_the_deadline_is_stopped_or_not_started() -> None:
    argv = [sys.executable, "-c", "import time; time.sleep(30)"]
    with pytest.raises(StepError, match="did not finish in time"):
        run_install_step(argv, io.BytesIO(), time.monotonic() + 0.5, StepError, "test install")
    with pytest.raises(StepError, match="test install ran out of time"):
        run_install_step(argv, io.BytesIO(), time.monotonic() - 1, StepError, "test install")
