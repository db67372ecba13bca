"""What the supervisor's children run: the registry process and the HTTP workers. Each is a
fresh interpreter (multiprocessing's spawn), so prometheus_client sees the shared metrics
directory from its first import.

Signals: a terminal's Ctrl-C and a kill of the whole process group reach every child, but the
supervisor alone decides the order of a shutdown. So the registry process takes neither SIGINT
nor SIGTERM and stops on STOP_REGISTRY, which only the supervisor sends, after the workers
drained; a worker ignores SIGINT (from its first line on) and drains on SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable

from pdproxy.config import Settings
from pdproxy.logs import configure_logging
from pdproxy.multiworker.paths import SharedPaths

log = logging.getLogger("pdproxy")

PARENT_CHECK_SECONDS = 1.0
STOP_REGISTRY = signal.SIGUSR1


def run_registry(
    settings: Settings,
    shared: SharedPaths,
    supervisor: int,
    generation: int,
    started: Callable[[], None],
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(settings.log_level, settings.log_format)
    _stop_when_orphaned(supervisor, STOP_REGISTRY)
    try:
        asyncio.run(_registry_main(settings, shared, generation > 0, started))
    except OSError as exc:  # a bind or a file: the message names which, no traceback needed
        log.error("pdproxy cannot start: %s", exc)
        sys.exit(1)


async def _registry_main(
    settings: Settings, shared: SharedPaths, restarted: bool, started: Callable[[], None]
) -> None:
    from pdproxy.metrics import Metrics
    from pdproxy.multiworker.hub import RegistryHub

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(STOP_REGISTRY, stop.set)
    hub = RegistryHub(
        settings,
        shared.state_endpoint,
        shared.control_endpoint,
        shared.work_endpoint,
        shared.admin_state,
        Metrics(shared_dir=shared.metrics_dir),
        restarted=restarted,
    )
    await hub.run(started, stop)


def run_http_worker(
    settings: Settings,
    shared: SharedPaths,
    port: int,
    index: int,
    supervisor: int,
    generation: int,
    started: Callable[[], None],
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from pdproxy.multiworker.registry_link import RegistryProcessCopy
    from pdproxy.proxy.app import create_app
    from pdproxy.proxy.serving import run_server
    from pdproxy.single_process import raise_descriptor_limit

    configure_logging(settings.log_level, settings.log_format)
    raise_descriptor_limit()
    _stop_when_orphaned(supervisor, signal.SIGTERM)
    listener = reuse_port_socket(settings.host, port)
    app = create_app(settings, RegistryProcessCopy(shared))
    log.info(
        "HTTP worker %d (pid %d, start %d) listening on %s:%d",
        index,
        os.getpid(),
        generation + 1,
        settings.host,
        port,
    )
    run_server(app, settings, sockets=[listener], worker=True, on_started=started)


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) beside the other workers' (SO_REUSEPORT): the kernel
    spreads new connections over the workers' listening sockets."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def _stop_when_orphaned(supervisor: int, stop: signal.Signals) -> None:
    """A child whose supervisor died (SIGKILL, OOM) stops as if told to. The supervisor's pid
    comes from the supervisor itself: one that died before this child ran is noticed too."""

    def watch() -> None:
        while os.getppid() == supervisor:
            threading.Event().wait(PARENT_CHECK_SECONDS)
        log.warning("the supervisor (pid %d) is gone: stopping", supervisor)
        os.kill(os.getpid(), stop)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
