"""A proxy in one process (`--workers 1`): the HTTP server and the registry on one event loop.
Also what every serving process does first, single or one of several."""

from __future__ import annotations

import logging

from pdproxy.config import Settings
from pdproxy.proxy.app import PdproxyApp
from pdproxy.proxy.credentials import Credentials
from pdproxy.proxy.serving import run_server

log = logging.getLogger("pdproxy")


def serve_single(settings: Settings, credentials: Credentials) -> int:
    app = PdproxyApp(settings, credentials=credentials)
    return 0 if run_server(app, settings, on_started=app.log_ready) else 1


def raise_descriptor_limit() -> None:
    """Each held stream needs two descriptors (client and decode leg): take all the process
    may have, and say what that allows."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    log.info(
        "file descriptor limit %s: about %s concurrent streams",
        soft,
        "unlimited" if soft == resource.RLIM_INFINITY else max(0, (soft - 256) // 2),
    )
