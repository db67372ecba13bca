"""A client connection of a proxy process that its host stops (SIGSTOP: as a descheduled VM or
a CPU-throttled cgroup does it) past the connection's idle bound.

The client was stopped with the proxy and sends its request as both run again. On waking, the
proxy's late idle timer runs before that request is in the socket: closing the connection then
would answer a prompt client with a dropped connection. The late wake earns the connection one
more idle period instead (pdproxy/http/server_protocol.py, `_idle_check`); a connection that
stays silent through it is still closed. The real proxy, its own process; its idle bound is
uvicorn's keep-alive timeout, 5 s.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

from pdproxy.demo.fleet import LocalFleet
from tests.integration.http_harness import read_response
from tests.integration.support import closed_by_peer, stopped_for

IDLE_S = 5.0  # uvicorn's timeout_keep_alive, the proxy's idle bound for client connections
STOP_S = IDLE_S + 2.0


def test_a_request_sent_as_the_proxy_process_wakes_is_answered(tmp_path: Path) -> None:
    fleet = LocalFleet(tmp_path, [], [])
    fleet.start()
    assert fleet.proxy is not None
    address = urlsplit(fleet.proxy_url)
    try:
        with socket.create_connection((address.hostname, address.port), timeout=5) as sock:
            # One request answered first: the connection is the proxy's, its idle bound runs.
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(sock).startswith(b"HTTP/1.1 200 ")
            stopped_for(fleet.proxy, STOP_S)
            time.sleep(0.1)  # the client runs again a moment after the proxy
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(sock).startswith(b"HTTP/1.1 200 ")
        with socket.create_connection((address.hostname, address.port), timeout=5) as silent:
            silent.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(silent).startswith(b"HTTP/1.1 200 ")
            stopped_for(fleet.proxy, STOP_S)
            # One more idle period from the wake, then closed like any idle connection.
            assert not closed_by_peer(silent, IDLE_S / 2)
            assert closed_by_peer(silent, IDLE_S * 2)
    finally:
        fleet.stop()
