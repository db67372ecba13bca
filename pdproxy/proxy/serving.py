"""The HTTP server and its graceful shutdown: on SIGTERM the proxy finishes what it holds
before it stops (the setting keeps its public name, `drain_seconds`; an operator's drain of an
instance is another thing, in registry/operator.py).

uvicorn's own SIGTERM handling closes the listening socket at once, so /ready can no longer
say "not ready" while a load balancer still routes here. Instead, the first SIGTERM (or
SIGINT) only starts the shutdown: /ready answers 503, new requests get 503 with
`Connection: close`, and the requests in flight get `drain_seconds` to finish. Then uvicorn's
normal shutdown runs and the process exits 0. A second signal starts that shutdown at once
(what is still running gets FINAL_GRACE_SECONDS, then ends with an error event).

An HTTP worker of a multi-worker proxy (`worker=True`) shuts down on SIGTERM from its supervisor
and takes no other signal: a terminal's Ctrl-C reaches every process of the group, and only
the supervisor decides the order of the shutdown (see multiworker/supervisor.py).
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from collections.abc import Callable
from types import FrameType
from typing import Protocol

import uvicorn

from pdproxy.config import Settings
from pdproxy.http.server_protocol import HttpProtocol
from pdproxy.proxy.front import Asgi

log = logging.getLogger("pdproxy")

# After the drain, what is still running gets this long before uvicorn cancels it.
FINAL_GRACE_SECONDS = 1


class Drainable(Protocol):
    def begin_shutdown(self) -> None:
        """Idempotent: called on every tick while draining."""

    @property
    def idle(self) -> bool: ...

    @property
    def front_door(self) -> Asgi:
        """What the server calls for each connection's requests."""
        ...


class GracefulServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        app: Drainable,
        drain_seconds: float,
        worker: bool = False,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self._app = app
        self._drain_seconds = drain_seconds
        self._drain_until: float | None = None
        self._worker = worker
        self._on_started = on_started

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._worker and (sig != signal.SIGTERM or self._drain_until is not None):
            return
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
        if self._on_started is not None and self.started:
            self._on_started()
            self._on_started = None
        if await super().on_tick(counter):
            return True
        if self._drain_until is None:
            return False
        self._app.begin_shutdown()
        if self._app.idle:
            log.info("drained: every request finished; shutting down")
            self.should_exit = True
        elif time.monotonic() >= self._drain_until:
            log.warning("drain period of %gs over; shutting down anyway", self._drain_seconds)
            self.should_exit = True
        return self.should_exit


def run_server(
    app: Drainable,
    settings: Settings,
    sockets: list[socket.socket] | None = None,
    worker: bool = False,
    on_started: Callable[[], None] | None = None,
) -> bool:
    """Serve `app` until a signal ends the drain; False if it never started serving."""
    config = uvicorn.Config(
        app.front_door,
        # Said, not detected: uvicorn asks inspect whether __call__ is a coroutine function,
        # and a compiled one (mypyc) does not look like one.
        interface="asgi3",
        host=settings.host,
        port=settings.port,
        loop=_event_loop(),
        http=HttpProtocol,
        lifespan="on",
        access_log=False,
        log_level=settings.log_level,
        log_config=None,  # configure_logging did it
        server_header=False,
        proxy_headers=False,
        timeout_graceful_shutdown=FINAL_GRACE_SECONDS,
        backlog=settings.backlog,
    )
    server = GracefulServer(config, app, settings.drain_seconds, worker, on_started)
    server.run(sockets=sockets)
    return server.started


def _event_loop() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"
