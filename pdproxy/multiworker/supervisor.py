"""`pdproxy serve --workers N`: one registry process and N HTTP workers on one port.

The supervisor holds no socket that serves anything. It makes the private directory the
children meet in, reserves the port (bound with SO_REUSEPORT but not listening, so a taken
port fails the start and port 0 gets one number for every worker), starts the registry process
and then the workers, each of which must say it is serving within START_TIMEOUT_SECONDS, or
the start fails. A child that dies later is started again (after a pause that doubles while
children die young); its counters stay in the metrics files. SIGTERM or SIGINT drains: the
workers get SIGTERM and up to drain_seconds (plus STOP_TIMEOUT_SECONDS) to finish, then the registry
process is told to stop (STOP_REGISTRY); a second signal kills what is left at once. Should the
supervisor itself fail, it kills its children before the shared directory goes.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.context import SpawnProcess
from types import FrameType
from typing import Any

from pdproxy.config import Settings
from pdproxy.multiworker.children import (
    STOP_REGISTRY,
    reuse_port_socket,
    run_http_worker,
    run_registry,
)
from pdproxy.multiworker.paths import METRICS_DIR_VARIABLE, SharedPaths

log = logging.getLogger("pdproxy")

START_TIMEOUT_SECONDS = 60.0
# Beyond the drain, for a process to exit once told to (a worker's own final grace included).
STOP_TIMEOUT_SECONDS = 10.0
YOUNG_DEATH_SECONDS = 10.0
MAX_RESTART_PAUSE_SECONDS = 30.0
POLL_SECONDS = 0.2


@dataclass
class Child:
    name: str
    target: Any
    args: tuple[Any, ...]
    process: SpawnProcess | None = None
    started_at: float = 0.0
    young_deaths: int = 0
    generation: int = 0  # how many times it was started before
    restart_at: float | None = None  # dead, to be started again at this time
    ready: Any = field(default=None)  # a multiprocessing Event


def serve_workers(settings: Settings) -> int:
    directory = tempfile.mkdtemp(prefix="pdproxy-")  # 0700: only this user reaches the sockets
    shared = SharedPaths(directory)
    os.mkdir(shared.metrics_dir, 0o700)
    # Inherited by every child: prometheus_client chooses its multiprocess mode at import.
    os.environ[METRICS_DIR_VARIABLE] = shared.metrics_dir
    try:
        reserved = _reserve_port(settings.host, settings.port)
    except OSError as exc:
        log.error("cannot bind %s:%d: %s", settings.host, settings.port, exc)
        shutil.rmtree(directory, ignore_errors=True)
        return 1
    try:
        port = reserved.getsockname()[1]
        return Supervisor(settings, shared, port).run()
    finally:
        reserved.close()
        shutil.rmtree(directory, ignore_errors=True)


def _reserve_port(host: str, port: int) -> socket.socket:
    """Fail now if anything holds the port, even a socket of this user's that allows sharing it
    (SO_REUSEPORT would let the workers join it silently); then hold it for the workers."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as probe:
        probe.bind((host, port))
        port = probe.getsockname()[1]  # port 0: the one the kernel chose
    return reuse_port_socket(host, port)


def _family(host: str) -> socket.AddressFamily:
    return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]


class Supervisor:
    def __init__(self, settings: Settings, shared: SharedPaths, port: int) -> None:
        self._settings = settings
        self._port = port
        self._context = multiprocessing.get_context("spawn")
        me = os.getpid()
        self._registry = Child("registry", run_registry, (settings, shared, me))
        self._workers = [
            Child(f"worker {i}", run_http_worker, (settings, shared, port, i, me))
            for i in range(settings.workers)
        ]
        self._signals = 0

    def run(self) -> int:
        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            return self._serve()
        except BaseException:
            self._kill(self._all())  # never leave children behind the shared directory
            for child in self._all():
                if child.process is not None:
                    child.process.join(STOP_TIMEOUT_SECONDS)
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _serve(self) -> int:
        if not self._start_all():
            if self._signals:  # told to stop while starting: not a failure
                self._shut_down()
                return 0
            self._kill(self._all())
            return 1
        log.info(
            "pdproxy serving on %s:%d with %d HTTP workers and a registry process (%s)",
            self._settings.host,
            self._port,
            len(self._workers),
            self._settings.registry_bind,
        )
        while not self._signals:
            self._watch()
        self._shut_down()
        return 0

    def _on_signal(self, sig: int, _frame: FrameType | None) -> None:
        self._signals += 1
        if self._signals > 1:
            self._kill(self._all())  # a second signal: now, not after the drain

    def _all(self) -> list[Child]:
        return [*self._workers, self._registry]

    def _start_all(self) -> bool:
        """The registry first (the workers copy its table), then every worker, each serving."""
        for group in ([self._registry], self._workers):
            for child in group:
                self._spawn(child)
            deadline = time.monotonic() + START_TIMEOUT_SECONDS
            for child in group:
                if not self._wait_started(child, deadline):
                    return False
        return True

    def _spawn(self, child: Child) -> None:
        child.ready = self._context.Event()
        process = self._context.Process(
            target=child.target,
            args=(*child.args, child.generation, child.ready.set),
            name=child.name,
        )
        process.start()
        child.generation += 1
        child.process, child.started_at, child.restart_at = process, time.monotonic(), None

    def _wait_started(self, child: Child, deadline: float) -> bool:
        assert child.process is not None
        while time.monotonic() < deadline and not self._signals:
            if child.ready.wait(POLL_SECONDS):
                return True
            if not child.process.is_alive():
                log.error(
                    "%s exited while starting (status %s)", child.name, child.process.exitcode
                )
                return False
        if not self._signals:
            log.error("%s did not start within %gs", child.name, START_TIMEOUT_SECONDS)
        return False

    def _watch(self) -> None:
        sentinels = [c.process.sentinel for c in self._all() if c.process is not None]
        multiprocessing.connection.wait(sentinels, POLL_SECONDS)
        now = time.monotonic()
        for child in self._all():
            if child.process is not None and not child.process.is_alive():
                self._buried(child, now)
            if child.restart_at is not None and now >= child.restart_at and not self._signals:
                log.info("starting %s again", child.name)
                self._spawn(child)

    def _buried(self, child: Child, now: float) -> None:
        assert child.process is not None
        process, child.process = child.process, None
        _forget_gauges(process.pid)
        young = now - child.started_at < YOUNG_DEATH_SECONDS
        child.young_deaths = child.young_deaths + 1 if young else 0
        pause = min(MAX_RESTART_PAUSE_SECONDS, 0.5 * 2**child.young_deaths)
        child.restart_at = now + pause
        log.error(
            "%s (pid %s) exited with status %s; starting it again in %.1fs",
            child.name,
            process.pid,
            process.exitcode,
            pause,
        )

    def _shut_down(self) -> None:
        log.info("draining the HTTP workers")
        grace = self._settings.drain_seconds + STOP_TIMEOUT_SECONDS
        self._stop(self._workers, signal.SIGTERM, grace)
        self._stop([self._registry], STOP_REGISTRY, STOP_TIMEOUT_SECONDS)
        log.info("every process stopped")

    def _stop(self, children: list[Child], stop: signal.Signals, grace: float) -> None:
        running = [c.process for c in children if c.process is not None and c.process.is_alive()]
        for process in running:
            _signal(process, stop)
        deadline = time.monotonic() + grace
        for process in running:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.warning("%s did not stop within %gs: killed", process.name, grace)
                _signal(process, signal.SIGKILL)
                process.join(STOP_TIMEOUT_SECONDS)

    def _kill(self, children: list[Child]) -> None:
        for child in children:
            if child.process is not None and child.process.is_alive():
                _signal(child.process, signal.SIGKILL)


def _signal(process: SpawnProcess, sig: int) -> None:
    if process.pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, sig)


def _forget_gauges(pid: int | None) -> None:
    """A dead process's live gauges (legs in flight, admitted requests) must not count."""
    from prometheus_client import multiprocess

    if pid is not None:
        multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]
