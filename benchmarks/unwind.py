"""Signals that unwind a benchmark, so the `finally` that stops its processes always runs; a
benchmark's run under them, and its JSON report."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import TypeVar

T = TypeVar("T")


class Terminated(Exception):
    """SIGTERM/SIGHUP arrived: unwind so the ``finally`` that stops children runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def signals_unwind() -> Iterator[None]:
    """Make Ctrl-C, SIGTERM and SIGHUP raise (KeyboardInterrupt, Terminated).

    SIGINT is set explicitly: a shell starts background jobs with SIGINT ignored.
    """

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise Terminated(signum)

    previous = {
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
        signal.SIGTERM: signal.signal(signal.SIGTERM, on_term),
        signal.SIGHUP: signal.signal(signal.SIGHUP, on_term),
    }
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def run_unwound(run: Callable[[], T], failures: tuple[type[Exception], ...]) -> T:
    """`run()` with signals unwinding it; a failure of one of `failures`, Ctrl-C or a
    termination signal is reported on stderr and ends the script with the matching status
    (1, 130, 128 + signal) once the `finally` blocks stopped every process."""
    try:
        with signals_unwind():
            return run()
    except failures as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        print("interrupted; all started processes were stopped", file=sys.stderr)
        raise SystemExit(130) from None
    except Terminated as exc:
        print(f"got {exc}; all started processes were stopped", file=sys.stderr)
        raise SystemExit(128 + exc.signum) from None


def write_json_report(path: str, report: object) -> None:
    """The whole report as JSON at `path` (directories made as needed)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")
