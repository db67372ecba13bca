"""What the supervisor's children run: the registry process and the HTTP workers. Each is a
fresh interpreter (multiprocessing's spawn), so prometheus_client sees the shared metrics
directory from its first import."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable

from pdproxy.config import Settings
from pdproxy.logs import configure_logging
from pdproxy.multiprocess.paths import SharedPaths

log = logging.getLogger("pdproxy")

PARENT_CHECK_SECONDS = 1.0


def run_registry(
    settings: Settings, shared: SharedPaths, generation: int, started: Callable[[], None]
) -> None:
    configure_logging(settings.log_level, settings.log_format)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor orders the shutdown
    _stop_when_orphaned()
    asyncio.run(_registry_main(settings, shared, generation > 0, started))


async def _registry_main(
    settings: Settings, shared: SharedPaths, restarted: bool, started: Callable[[], None]
) -> None:
    from pdproxy.metrics import Metrics
    from pdproxy.registry.hub import RegistryHub

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    hub = RegistryHub(
        settings,
        shared.state_endpoint,
        shared.control_endpoint,
        Metrics(shared=True),
        restarted=restarted,
    )
    await hub.run(started, stop)


def run_http_worker(
    settings: Settings,
    shared: SharedPaths,
    port: int,
    index: int,
    generation: int,
    started: Callable[[], None],
) -> None:
    from pdproxy.cli import raise_descriptor_limit
    from pdproxy.proxy.app import create_app
    from pdproxy.proxy.draining import run_server

    configure_logging(settings.log_level, settings.log_format)
    raise_descriptor_limit()
    _stop_when_orphaned()
    listener = reuse_port_socket(settings.host, port)
    app = create_app(settings, shared)
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


def _stop_when_orphaned() -> None:
    """A child whose supervisor died (SIGKILL, OOM) stops as if told to: SIGTERM to itself."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(PARENT_CHECK_SECONDS)
        log.warning("the supervisor (pid %d) is gone: stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
