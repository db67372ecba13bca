"""Signals that unwind a benchmark, so the `finally` that stops its processes always runs."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType


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
