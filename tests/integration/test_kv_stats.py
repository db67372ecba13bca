"""KV transfer statistics end to end: fake workers report every handoff with the registry's
"stats" op (each of their TP ranks), and a live `pdproxy serve` counts each transfer once in
/metrics, with the bytes the workers moved, for registered pairs only."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import yaml
import zmq
from prometheus_client.parser import text_string_to_metric_families

from pdproxy.base.roles import Role
from pdproxy.demo.fleet import LocalFleet, Worker, WorkerSpec
from pdproxy.demo.processes import http_get, wait_until
from pdproxy.registry.auth import new_nonce, signed
from pdproxy.registry.messages import Stats, decode_frame
from pdproxy.vllm_side.announcement import TransferStat, stats_message
from pdproxy.vllm_side.stats_reporter import StatsReporter
from tests.conftest import FleetFactory
from tests.integration.support import post_json

SECRET = "kv-stats-registry-secret-0123"
WAIT_S = 15.0
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
def zmq_context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def scrape(fleet: LocalFleet) -> Samples:
    status, body = http_get(fleet.proxy_url + "/metrics", timeout=5)
    assert status == 200
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
        if sample.name.startswith("pdproxy_kv_") or sample.name.startswith("pdproxy_registry")
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def transfers(fleet: LocalFleet, outcome: str) -> float | None:
    return value(scrape(fleet), "pdproxy_kv_transfers_total", outcome=outcome)


def wait_transfers(fleet: LocalFleet, outcome: str, count: int) -> Samples:
    wait_until(
        lambda: transfers(fleet, outcome) == count,
        WAIT_S,
        f"{count} {outcome} transfer(s) in /metrics (now {transfers(fleet, outcome)})",
        fleet.processes(),
    )
    return scrape(fleet)


def pair_of(fleet: LocalFleet) -> dict[str, str]:
    [p], [d] = fleet.role("P"), fleet.role("D")
    return {"prefill": p.http_address, "decode": d.http_address}


def complete(fleet: LocalFleet, n: int) -> None:
    chat = n % 2 == 1
    path = "/v1/chat/completions" if chat else "/v1/completions"
    words = " ".join(f"word{i}" for i in range(5 + 7 * n))  # prompts of several blocks
    body: dict[str, Any] = {"model": "fake-model", "max_tokens": 2}
    if chat:
        body["messages"] = [{"role": "user", "content": words}]
    else:
        body["prompt"] = words
    answer = post_json(fleet.proxy_url + path, body)
    assert answer.status == 200, answer.body


def moved_bytes(worker: Worker) -> int:
    """What a fake prefill says it handed over: pushed (p2p_nccl, pdproxy) or served (nixl)."""
    events = worker.events()
    return sum(int(e["bytes"]) for e in events["kv_sent"] + events["kv_served"])


@pytest.mark.parametrize("connector", ["p2p_nccl", "nixl"])
def test_each_transfer_is_counted_once_with_the_bytes_the_workers_moved(
    fleet_factory: FleetFactory, connector: str
) -> None:
    flags = ("--connector", connector, "--tp-size", "2")  # two ranks report on each side
    fleet = fleet_factory([WorkerSpec("P", extra_args=flags), WorkerSpec("D", extra_args=flags)])
    pair = pair_of(fleet)
    complete(fleet, 0)
    samples = wait_transfers(fleet, "ok", 1)
    moved = value(samples, "pdproxy_kv_transfer_bytes_total", **pair)
    seconds = value(samples, "pdproxy_kv_transfer_duration_seconds_sum")
    bandwidth = value(samples, "pdproxy_kv_transfer_bandwidth_bytes_per_second", **pair)
    assert moved is not None and moved > 0 and seconds is not None and seconds > 0
    # One transfer so far: the bandwidth is its bytes over its duration.
    assert bandwidth == pytest.approx(moved / seconds, rel=1e-6)

    requests = 6
    for n in range(1, requests):
        complete(fleet, n)
    samples = wait_transfers(fleet, "ok", requests)
    [prefill] = fleet.role("P")
    assert value(samples, "pdproxy_kv_transfer_bytes_total", **pair) == moved_bytes(prefill)
    assert value(samples, "pdproxy_kv_transfer_duration_seconds_count") == requests
    for outcome in ("timeout", "error", "missing", "dropped", "incomplete"):
        assert value(samples, "pdproxy_kv_transfers_total", outcome=outcome) == 0
    refused = {
        labels: v
        for (name, labels), v in samples.items()
        if name == "pdproxy_registry_messages_total" and ("outcome", "rejected") in labels
    }
    assert sum(refused.values()) == 0, refused
    time.sleep(1.0)  # the prefill's reports of the same transfers never add a count
    assert transfers(fleet, "ok") == requests


def tagged_for(prefill: Worker, decode: Worker) -> str:
    return (
        f"___prefill_addr_{prefill.zmq_address}___decode_addr_{decode.zmq_address}_"
        f"{uuid.uuid4().hex}"
    )


def test_a_failed_handoff_is_counted_with_its_outcome(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory([WorkerSpec("P"), WorkerSpec("D", extra_args=("--kv-timeout", "0.5"))])
    [prefill], [decode] = fleet.role("P"), fleet.role("D")
    # A decode leg whose prefill never ran: the decode waits for KV that never comes.
    answer = post_json(
        decode.url + "/v1/completions",
        {"model": "fake-model", "prompt": "never prefilled", "max_tokens": 2},
        headers={"X-Request-Id": tagged_for(prefill, decode)},
    )
    assert answer.status == 500 and b"kv_failed: timeout" in answer.body
    samples = wait_transfers(fleet, "timeout", 1)
    assert value(samples, "pdproxy_kv_transfers_total", outcome="ok") == 0
    assert value(samples, "pdproxy_kv_transfer_bytes_total", **pair_of(fleet)) == 0
    assert value(samples, "pdproxy_kv_transfer_duration_seconds_count") == 0


def test_label_sets_vanish_when_an_instance_leaves(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory([WorkerSpec("P"), WorkerSpec("D")])
    pair = pair_of(fleet)
    complete(fleet, 0)
    samples = wait_transfers(fleet, "ok", 1)
    assert value(samples, "pdproxy_kv_transfer_bytes_total", **pair)
    [decode] = fleet.role("D")
    decode.process.stop()  # SIGTERM: the fake worker says `leave`

    def gone() -> bool:
        names = {
            name
            for (name, labels), _ in scrape(fleet).items()
            if ("decode", pair["decode"]) in labels
        }
        return not names

    wait_until(
        gone,
        WAIT_S,
        "the decode's KV label sets to go",
        [p for p in fleet.processes() if p is not decode.process],
    )
    assert transfers(fleet, "ok") == 1  # what was counted stays counted


def test_with_a_registry_secret_only_signed_stats_count(
    fleet_factory: FleetFactory, zmq_context: Any, tmp_path: Path
) -> None:
    secret_file = tmp_path / "registry.secret"
    secret_file.write_text(SECRET + "\n")
    config = tmp_path / "proxy.yaml"
    config.write_text(yaml.safe_dump({"registry_secret": SECRET}))
    signing = ("--registry-secret-file", str(secret_file))
    fleet = fleet_factory(
        [WorkerSpec("P", extra_args=signing), WorkerSpec("D", extra_args=signing)],
        proxy_args=["--config", str(config)],
    )
    complete(fleet, 0)
    wait_transfers(fleet, "ok", 1)  # the fake workers sign their reports

    [prefill], [decode] = fleet.role("P"), fleet.role("D")
    entry = TransferStat(f"{uuid.uuid4().hex}-0", prefill.zmq_address, 10**6, 1, 0.1)
    forged = stats_message(Role.DECODE, decode.http_address, 0, 1, [entry])
    sock = zmq_context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{fleet.registry_address}")
    sock.send(msgpack.packb(forged))
    sock.send(msgpack.packb(signed(forged, b"not-the-registry-secret", time.time(), new_nonce())))

    def refused(reason: str) -> float | None:
        return value(
            scrape(fleet), "pdproxy_registry_messages_total", outcome="rejected", reason=reason
        )

    wait_until(
        lambda: refused("unsigned") == 1 and refused("bad_signature") == 1,
        WAIT_S,
        "the unsigned and the badly signed report to be refused",
        fleet.processes(),
    )
    assert transfers(fleet, "ok") == 1
    moved = value(scrape(fleet), "pdproxy_kv_transfer_bytes_total", **pair_of(fleet))
    assert moved is not None and moved < 10**6


def test_a_reporter_reaches_a_router_under_its_own_identity(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    router = zmq_context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    http = "127.0.0.1:8200"
    stats = StatsReporter.connect(f"127.0.0.1:{port}", Role.PREFILL, http, 0, 1)
    try:
        stats.report(TransferStat(f"{uuid.uuid4().hex}-0", "127.0.0.1:22001", 5, 1, 0.01))
        assert router.poll(5000), "no stats frame within 5 s"
        identity, frame = router.recv_multipart()
    finally:
        stats.stop()
    # Not the announcer's identity (the zmq address): a ROUTER ignores a duplicate one.
    assert identity.startswith(f"{http}/stats/0/".encode())
    message = decode_frame(frame)
    assert isinstance(message, Stats) and [t.bytes for t in message.transfers] == [5]
    json.dumps(msgpack.unpackb(frame))  # plain data only
