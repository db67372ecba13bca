"""`pdproxy serve --workers N`: HTTP workers on one port (SO_REUSEPORT) sharing one registry
process, with metrics summed over them; dead children are replaced; SIGTERM drains all."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from pdproxy.demo.fleet import LocalFleet, WorkerSpec
from pdproxy.demo.processes import (
    LOOPBACK,
    ManagedProcess,
    free_ports,
    pdproxy_command,
    wait_until,
)
from tests.conftest import FleetFactory
from tests.integration.support import metric_value, post_json, read_until, request

MODEL = "fake-model"
GOOD = {"model": MODEL, "prompt": "hello workers", "max_tokens": 3}
TWO_WORKERS = ["--workers", "2", "--log-format", "json"]


ADMIN = {"Authorization": "Bearer an-admin-token-for-the-workers"}


def admin_token(directory: Path) -> list[str]:
    token = directory / "admin"
    token.write_text("an-admin-token-for-the-workers\n")
    return ["--admin-token-file", str(token)]


def log_lines(fleet: LocalFleet) -> list[dict[str, Any]]:
    text = (fleet.log_dir / "pdproxy.log").read_text()
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def access_pids(fleet: LocalFleet) -> list[int]:
    """The pid of the process that wrote each access line so far."""
    return [line["pid"] for line in log_lines(fleet) if line["logger"] == "pdproxy.access"]


def served_by(fleet: LocalFleet, count: int) -> list[int]:
    """The pids of the processes that wrote the first `count` access lines."""
    wait_until(lambda: len(access_pids(fleet)) >= count, 10, f"{count} access lines")
    return access_pids(fleet)[:count]


def child_pids(fleet: LocalFleet, message_start: str) -> list[int]:
    """Pids of the children whose log lines begin so (in order of their lines)."""
    pids = [line["pid"] for line in log_lines(fleet) if line["message"].startswith(message_start)]
    return list(dict.fromkeys(pids))


def completions(fleet: LocalFleet, count: int) -> list[int]:
    """`count` requests, each on a connection of its own: any worker may take each one."""
    return [post_json(fleet.proxy_url + "/v1/completions", GOOD).status for _ in range(count)]


def completed(fleet: LocalFleet) -> float:
    labels = {"endpoint": "/v1/completions", "status": "200"}
    return metric_value(fleet.proxy_url, "pdproxy_requests_total", labels)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_workers_share_the_port_the_registry_and_the_metrics(
    fleet_factory: FleetFactory,
) -> None:
    fleet = fleet_factory([WorkerSpec("P"), WorkerSpec("D")], proxy_args=TWO_WORKERS)
    assert completions(fleet, 60) == [200] * 60
    # Sixty connections from sixty source ports: the kernel gave both workers some.
    pids = served_by(fleet, 60)
    assert len(set(pids)) == 2, pids
    assert set(pids) == set(child_pids(fleet, "HTTP worker"))
    assert fleet.proxy is not None and fleet.proxy.pid not in pids
    # Whichever worker answers the scrape, it shows every worker's counts, and the registry
    # process's own gauges.
    for _ in range(6):
        assert completed(fleet) == 60
        assert metric_value(fleet.proxy_url, "pdproxy_registry_instances", {"role": "prefill"}) == 1
        assert metric_value(fleet.proxy_url, "pdproxy_registry_instances", {"role": "decode"}) == 1
    # Both workers route with the registry process's table.
    for _ in range(6):
        assert fleet.registered() == {w.http_address for w in fleet.workers}
    assert len(fleet.completion_requests("P")) == len(fleet.completion_requests("D")) == 60


def test_a_dead_worker_is_replaced_and_its_counts_are_kept(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory([WorkerSpec("P"), WorkerSpec("D")], proxy_args=TWO_WORKERS)
    assert completions(fleet, 20) == [200] * 20
    # A request is counted just after its last byte went out: all 20 are counted before the
    # kill, or the kill could take a count that was never made (CI at 98e3d81: 39 of 40).
    wait_until(lambda: completed(fleet) == 20, 10, "the first 20 requests counted")
    first, _second = child_pids(fleet, "HTTP worker")
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: len(child_pids(fleet, "HTTP worker")) == 3, 20, "a third HTTP worker")
    replacement = child_pids(fleet, "HTTP worker")[2]
    assert replacement != first and alive(replacement)
    # The new worker has the table (it answers, with both instances) and serves.
    wait_until(
        lambda: all(fleet.registered() == {w.http_address for w in fleet.workers} for _ in "abcd"),
        10,
        "every worker listing both instances",
    )
    assert completions(fleet, 20) == [200] * 20
    # The dead worker's counts are still in the sum (the last ones counted just after their
    # answers: waited for, boundedly).
    wait_until(lambda: completed(fleet) == 40, 10, "40 requests counted, the dead worker's too")
    # And the replacement takes connections itself.
    wait_until(
        lambda: completions(fleet, 5) == [200] * 5 and replacement in access_pids(fleet),
        20,
        "a request served by the replacement",
    )


def test_the_registry_process_is_replaced_without_losing_the_fleet(
    fleet_factory: FleetFactory, tmp_path: Path
) -> None:
    fleet = fleet_factory(
        [WorkerSpec("P"), WorkerSpec("D")],
        proxy_args=[*TWO_WORKERS, "--ttl", "4", *admin_token(tmp_path)],
    )
    instances = fleet.proxy_url + "/v1/instances"
    spare = {"role": "decode", "http_address": "127.0.0.1:1000", "zmq_address": "127.0.0.1:1001"}
    assert request(instances, "POST", json.dumps(spare).encode(), ADMIN).status == 201
    assert request(f"{instances}/127.0.0.1:1000/drain", "POST", b"", ADMIN).status == 200
    (registry,) = child_pids(fleet, "registry listening")
    os.kill(registry, signal.SIGKILL)
    wait_until(lambda: len(child_pids(fleet, "registry listening")) == 2, 20, "a new registry")
    # For one TTL the new registry process hears the fleet again: it refuses admin changes
    # and publishes nothing, and the workers keep routing on their copy.
    decode = fleet.role("D")[0].http_address
    refused = request(f"{instances}/{decode}/drain", "POST", b"", ADMIN)
    assert refused.status == 503 and "started again" in refused.json()["error"]["message"]
    assert refused.headers.get("retry-after")
    assert completions(fleet, 20) == [200] * 20

    # Then every worker gets the whole fleet back, with what the operator had said.
    def listed() -> dict[str, bool]:
        answer = request(instances, "GET")
        return {i["http_address"]: i["drained"] for i in answer.json()["instances"]}

    expected = {w.http_address: False for w in fleet.workers} | {"127.0.0.1:1000": True}
    wait_until(lambda: all(listed() == expected for _ in range(6)), 15, "the fleet back")
    assert completions(fleet, 10) == [200] * 10


@pytest.mark.parametrize("to", ["supervisor", "group"])
def test_sigterm_drains_every_worker_then_everything_exits(
    fleet_factory: FleetFactory, to: str
) -> None:
    """SIGTERM to the supervisor alone (as Kubernetes sends it), or to the whole process group
    (a terminal, systemd): either way the streams in flight finish and all exit 0."""
    fleet = fleet_factory(
        [WorkerSpec("P"), WorkerSpec("D", token_latency_ms=40)], proxy_args=TWO_WORKERS
    )
    assert fleet.proxy is not None
    children = child_pids(fleet, "HTTP worker") + child_pids(fleet, "registry listening")
    assert len(children) == 3
    streams = [_open_stream(fleet) for _ in range(4)]
    try:
        # The headers and the first event: every decode is under way.
        begun = [read_until(stream, b"data: {", 20) for stream in streams]
        if to == "supervisor":
            os.kill(fleet.proxy.pid, signal.SIGTERM)
        else:
            os.killpg(fleet.proxy.pid, signal.SIGTERM)
        for start, stream in zip(begun, streams, strict=True):
            body = start + _read_all(stream)
            assert body.count(b"data: {") == 40 and b"data: [DONE]" in body
            assert body.endswith(b"\r\n0\r\n\r\n")  # the last chunk: nothing was cut
    finally:
        for stream in streams:
            stream.close()
    assert fleet.proxy.process is not None
    assert fleet.proxy.process.wait(timeout=30) == 0
    wait_until(lambda: not any(alive(pid) for pid in children), 10, "every child exited")


def _open_stream(fleet: LocalFleet) -> socket.socket:
    body = json.dumps({**GOOD, "max_tokens": 40, "stream": True}).encode()
    sock = socket.create_connection((LOOPBACK, fleet.proxy_port), timeout=20)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    return sock


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize(
    ("taken_port", "complaint"),
    [("http", "cannot bind"), ("registry", "registry exited while starting")],
)
def test_a_taken_port_fails_the_start(tmp_path: Path, taken_port: str, complaint: str) -> None:
    port, registry = free_ports(2)
    with socket.socket() as taken:
        taken.bind((LOOPBACK, port if taken_port == "http" else registry))
        taken.listen()
        proxy = ManagedProcess(
            "pdproxy",
            pdproxy_command(
                "serve",
                "--host",
                LOOPBACK,
                "--port",
                str(port),
                "--registry-bind",
                f"tcp://{LOOPBACK}:{registry}",
                "--workers",
                "2",
            ),
            tmp_path / "pdproxy.log",
        ).start()
        try:
            assert proxy.process is not None
            assert proxy.process.wait(timeout=60) == 1
        except subprocess.TimeoutExpired:
            pytest.fail("the proxy kept running on a taken port:\n" + proxy.log_tail())
        finally:
            proxy.stop()
    assert complaint in proxy.log_tail()
    if taken_port == "registry":
        with socket.socket() as probe:  # the workers never started listening
            assert probe.connect_ex((LOOPBACK, port)) != 0


def test_admin_changes_wait_a_bounded_time_for_a_stuck_registry_process(
    fleet_factory: FleetFactory, tmp_path: Path
) -> None:
    fleet = fleet_factory(
        [WorkerSpec("P"), WorkerSpec("D")], proxy_args=[*TWO_WORKERS, *admin_token(tmp_path)]
    )
    decode = fleet.role("D")[0].http_address
    drain_url = f"{fleet.proxy_url}/v1/instances/{decode}/drain"
    (registry,) = child_pids(fleet, "registry listening")
    os.kill(registry, signal.SIGSTOP)  # alive but deaf: the supervisor sees nothing wrong
    try:
        began = time.monotonic()
        answer = request(drain_url, "POST", b"", ADMIN)
        waited = time.monotonic() - began
        assert answer.status == 503, answer.body
        assert "registry process did not answer" in answer.json()["error"]["message"]
        assert waited < 15
        # Routing goes on with the copy the workers hold.
        assert completions(fleet, 10) == [200] * 10
    finally:
        os.kill(registry, signal.SIGCONT)
    # The refused drain is not applied later: the instance stays in rotation.
    time.sleep(1.0)  # a late drain would be published within 50 ms of reaching the registry
    assert completions(fleet, 10) == [200] * 10
    assert request(drain_url, "POST", b"", ADMIN).status == 200
    # Every worker shows the drain: nothing can decode now.
    wait_until(
        lambda: all(
            post_json(fleet.proxy_url + "/v1/completions", GOOD).status == 503 for _ in range(6)
        ),
        5,
        "the drain on every worker",
    )
