"""Graceful shutdown: SIGTERM drains before the server stops.

uvicorn's own SIGTERM handling closes the listening socket at once, so /ready can no longer
say "not ready" while a load balancer still routes here. Instead, the first SIGTERM (or
SIGINT) only starts draining: /ready answers 503, new requests get 503 with
`Connection: close`, and the requests in flight get `drain_seconds` to finish. Then uvicorn's
normal shutdown runs and the process exits 0. A second signal starts that shutdown at once
(what is still running gets FINAL_GRACE_SECONDS, then ends with an error event).
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType
from typing import Protocol

import uvicorn

log = logging.getLogger("pdproxy")

# After the drain, what is still running gets this long before uvicorn cancels it.
FINAL_GRACE_SECONDS = 1


class Drainable(Protocol):
    def begin_drain(self) -> None:
        """Idempotent: called on every tick while draining."""

    @property
    def idle(self) -> bool: ...


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: Drainable, drain_seconds: float) -> None:
        super().__init__(config)
        self._app = app
        self._drain_seconds = drain_seconds
        self._drain_until: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in uvicorn's captured signals: re-raising SIGTERM after the shutdown
        # would turn a clean drain into death by signal (exit status 143, not 0).
        if self._drain_until is not None or not self.started:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            return
        # Only flags here: a signal handler may interrupt a lock holder (the log queue), so
        # the drain itself starts on the next tick, within 0.1 s.
        self._drain_until = time.monotonic() + self._drain_seconds

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if self._drain_until is None:
            return False
        self._app.begin_drain()
        if self._app.idle:
            log.info("drained: every request finished; shutting down")
            self.should_exit = True
        elif time.monotonic() >= self._drain_until:
            log.warning("drain period of %gs over; shutting down anyway", self._drain_seconds)
            self.should_exit = True
        return self.should_exit
