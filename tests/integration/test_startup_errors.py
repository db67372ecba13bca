"""A proxy that cannot start says why in one line naming the address and the setting, exits
non-zero, and says "ready to serve" only once every port is bound."""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path

import pytest

from pdproxy.demo.processes import LOOPBACK, ManagedProcess, free_ports, pdproxy_command, wait_until

START_BOUND_S = 60.0


def serve(tmp_path: Path, port: int, registry: str, *extra: str) -> ManagedProcess:
    return ManagedProcess(
        "pdproxy",
        pdproxy_command(
            "serve", "--host", LOOPBACK, "--port", str(port), "--registry-bind", registry, *extra
        ),
        tmp_path / "pdproxy.log",
    )


def exit_status(proxy: ManagedProcess) -> int:
    assert proxy.process is not None
    try:
        return proxy.process.wait(timeout=START_BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail("the proxy kept running:\n" + proxy.log_tail())
    finally:
        proxy.stop()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_taken_registry_port_is_one_line_naming_the_setting(tmp_path: Path, workers: str) -> None:
    port, registry = free_ports(2)
    with socket.socket() as taken:
        taken.bind((LOOPBACK, registry))
        taken.listen()
        # No tcp:// here: the same syntax as every other address.
        proxy = serve(tmp_path, port, f"{LOOPBACK}:{registry}", "--workers", workers).start()
        assert exit_status(proxy) != 0
    log = proxy.log_tail(200)
    assert (
        f"pdproxy cannot start: cannot bind the registry on tcp://{LOOPBACK}:{registry} "
        "(registry_bind, --registry-bind): Address already in use"
    ) in log
    assert "Traceback" not in log
    assert "ready to serve" not in log


def test_a_taken_http_port_names_the_address_and_is_never_ready(tmp_path: Path) -> None:
    port, registry = free_ports(2)
    with socket.socket() as taken:
        taken.bind((LOOPBACK, port))
        taken.listen()
        proxy = serve(tmp_path, port, f"tcp://{LOOPBACK}:{registry}").start()
        assert exit_status(proxy) != 0
    log = proxy.log_tail(200)
    assert f"error while attempting to bind on address ('{LOOPBACK}', {port})" in log
    assert "Traceback" not in log
    # The registry was bound before the HTTP port failed: still not ready to serve.
    assert "ready to serve" not in log


def test_ready_to_serve_comes_after_the_http_port_is_bound(tmp_path: Path) -> None:
    port, registry = free_ports(2)
    proxy = serve(tmp_path, port, f"{LOOPBACK}:{registry}").start()
    try:
        wait_until(lambda: "ready to serve" in proxy.log_tail(), START_BOUND_S, "ready", [proxy])
        lines = proxy.log_tail(200).splitlines()
        running = next(i for i, line in enumerate(lines) if "Uvicorn running on" in line)
        ready = next(i for i, line in enumerate(lines) if "ready to serve" in line)
        assert ready > running
        assert re.search(rf"registry tcp://{re.escape(LOOPBACK)}:{registry}\b", lines[ready])
        with socket.create_connection((LOOPBACK, port), timeout=5):
            pass  # and it is true
    finally:
        assert proxy.stop() == 0


def test_a_malformed_registry_bind_is_refused_before_anything_starts(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    proxy = serve(tmp_path, port, "udp://127.0.0.1:30001").start()
    assert exit_status(proxy) == 2
    log = proxy.log_tail()
    assert "registry_bind (flag --registry-bind)" in log
    assert "only tcp:// is supported; expected [tcp://]HOST:PORT" in log
    assert "Traceback" not in log and "Value error" not in log
