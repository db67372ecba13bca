"""The registry through a live `pdproxy serve`, fed by real ZMQ DEALER sockets."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from pdproxy.demo.fleet import LocalFleet
from pdproxy.demo.processes import http_get, http_json, wait_until
from tests.conftest import FleetFactory
from tests.integration.support import metric_value

# Exactly what stock vLLM's P2pNcclEngine sends (TP rank 0, every 3 s).
V0 = {"type": "P", "http_address": "127.0.0.1:8100", "zmq_address": "127.0.0.1:21001"}


@pytest.fixture
def zmq_context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def pack(message: Any) -> bytes:
    frame: bytes = msgpack.packb(message)
    return frame


def dealer(context: zmq.Context[Any], fleet: LocalFleet, identity: str) -> zmq.Socket[bytes]:
    """A DEALER like vLLM's; keep a reference until its frames are out (LINGER is 0)."""
    sock: zmq.Socket[bytes] = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{fleet.registry_address}")
    return sock


def instances(fleet: LocalFleet) -> dict[str, dict[str, Any]]:
    data = http_json(fleet.proxy_url + "/v1/instances")
    return {item["http_address"]: item for item in data["instances"]}


def wait_for(fleet: LocalFleet, predicate: Any, what: str, timeout: float = 5.0) -> None:
    wait_until(lambda: predicate(instances(fleet)), timeout, what, fleet.processes())


def rejected_total(fleet: LocalFleet) -> float:
    return metric_value(fleet.proxy_url, "pdproxy_registry_messages_total", {"outcome": "rejected"})


def test_stock_v0_bytes_register(fleet_factory: FleetFactory, zmq_context: Any) -> None:
    fleet = fleet_factory([])
    sock = dealer(zmq_context, fleet, V0["zmq_address"])
    sock.send(pack(V0))
    wait_for(fleet, lambda i: "127.0.0.1:8100" in i, "v0 registration")
    item = instances(fleet)["127.0.0.1:8100"]
    assert item["type"] == "P" and item["role"] == "prefill"
    assert item["zmq_address"] == "127.0.0.1:21001"
    assert item["source"] == "v0"
    assert item["model"] is None and item["geometry"] is None
    assert metric_value(fleet.proxy_url, "pdproxy_registry_instances", {"role": "prefill"}) == 1


def test_v1_fields_land(fleet_factory: FleetFactory, zmq_context: Any) -> None:
    fleet = fleet_factory([])
    geometry = {
        "tp_size": 2,
        "block_size": 16,
        "num_layers": 32,
        "num_kv_heads": 8,
        "head_dim": 128,
        "kv_dtype": "bfloat16",
        "is_mla": False,
        "kv_layout": "HND",
    }
    message = {
        "v": 1,
        "op": "announce",
        "type": "D",
        "http_address": "127.0.0.1:8200",
        "zmq_address": "127.0.0.1:22001",
        "model": "llama",
        "connector": "nixl",
        "geometry": geometry,
        "load": {"running": 3, "waiting": 1, "kv_usage": 0.25},
        "some_future_field": {"ignored": True},
    }
    sock = dealer(zmq_context, fleet, "127.0.0.1:22001")
    sock.send(pack(message))
    wait_for(fleet, lambda i: "127.0.0.1:8200" in i, "v1 registration")
    item = instances(fleet)["127.0.0.1:8200"]
    assert item["source"] == "v1" and item["role"] == "decode"
    assert item["model"] == "llama" and item["connector"] == "nixl"
    assert item["geometry"] == geometry
    assert item["load"] == {"running": 3, "waiting": 1, "kv_usage": 0.25}
    models = http_json(fleet.proxy_url + "/v1/models")
    assert [m["id"] for m in models["data"]] == ["llama"]


def test_expiry_without_further_messages(fleet_factory: FleetFactory, zmq_context: Any) -> None:
    fleet = fleet_factory([], proxy_args=["--ttl", "1"])
    sock = dealer(zmq_context, fleet, V0["zmq_address"])
    sock.send(pack(V0))
    wait_for(fleet, lambda i: "127.0.0.1:8100" in i, "registration")
    registered = time.monotonic()
    wait_for(fleet, lambda i: "127.0.0.1:8100" not in i, "expiry", timeout=5)
    assert time.monotonic() - registered >= 0.9  # expired by the TTL, not at once
    assert metric_value(fleet.proxy_url, "pdproxy_registry_instances", {"role": "prefill"}) == 0


def test_heartbeats_keep_an_instance(fleet_factory: FleetFactory, zmq_context: Any) -> None:
    fleet = fleet_factory([], proxy_args=["--ttl", "1"])
    sock = dealer(zmq_context, fleet, V0["zmq_address"])
    sock.send(pack(V0))
    wait_for(fleet, lambda i: "127.0.0.1:8100" in i, "registration")
    end = time.monotonic() + 2.5  # 2.5 TTLs
    while time.monotonic() < end:
        sock.send(pack(V0))
        time.sleep(0.2)
        assert "127.0.0.1:8100" in instances(fleet)


def test_leave_removes_at_once(fleet_factory: FleetFactory, zmq_context: Any) -> None:
    fleet = fleet_factory([])
    sock = dealer(zmq_context, fleet, V0["zmq_address"])
    sock.send(pack({**V0, "v": 1, "model": "m"}))
    wait_for(fleet, lambda i: "127.0.0.1:8100" in i, "registration")
    sock.send(
        pack(
            {
                "v": 1,
                "op": "leave",
                "type": "P",
                "http_address": "127.0.0.1:8100",
                "zmq_address": "127.0.0.1:21001",
            }
        )
    )
    wait_for(fleet, lambda i: "127.0.0.1:8100" not in i, "leave", timeout=1.0)


def test_static_instances_never_expire(fleet_factory: FleetFactory, zmq_context: Any) -> None:
    fleet = fleet_factory(
        [],
        proxy_args=[
            "--ttl",
            "0.5",
            "--prefill",
            "http=127.0.0.1:9100,zmq=127.0.0.1:9101",
            "--decode",
            "http=127.0.0.1:9200,zmq=127.0.0.1:9201,model=m",
        ],
    )
    leave = {"v": 1, "op": "leave", "http_address": "127.0.0.1:9100"}
    sock = dealer(zmq_context, fleet, "x")
    sock.send(pack(leave))
    time.sleep(1.5)  # three TTLs
    items = instances(fleet)
    assert items["127.0.0.1:9100"]["source"] == "static"
    assert items["127.0.0.1:9200"]["model"] == "m"
    assert http_get(fleet.proxy_url + "/ready")[0] == 200


def _garbage(rng: random.Random, index: int) -> bytes:
    kind = index % 10
    if kind == 0:
        return rng.randbytes(rng.randint(0, 200))
    if kind == 1:
        return pack([rng.random(), "x"])
    if kind == 2:
        return pack({"type": "P", "http_address": "127.0.0.1:1"})  # no zmq_address
    if kind == 3:
        return pack({**V0, "type": rng.choice(["X", "p", "prefill", ""])})
    if kind == 4:
        return pack({**V0, "http_address": rng.choice(["[::1]:8000", "fe80::1:80"])})
    if kind == 5:
        return pack({**V0, "zmq_address": rng.choice(["a___b:1", ":80", "h:0", "h:70000"])})
    if kind == 6:
        return pack({**V0, "http_address": "bad host:80"})
    if kind == 7:
        return pack({**V0, "http_address": 8100})
    if kind == 8:
        return pack({**V0, "v": 1, "geometry": {"tp_size": -rng.randint(1, 9)}})
    return pack({**V0, "v": rng.choice([2, "1", None])})


def test_garbage_neither_crashes_nor_registers(
    fleet_factory: FleetFactory, zmq_context: Any
) -> None:
    fleet = fleet_factory([])
    rng = random.Random(1234)
    senders = [dealer(zmq_context, fleet, f"garbage-{i}") for i in range(5)]
    for index in range(1000):
        senders[index % 5].send(_garbage(rng, index))
    multi = dealer(zmq_context, fleet, "multi")
    multi.send_multipart([pack(V0), b"extra frame"])
    wait_until(lambda: rejected_total(fleet) >= 1001, 10, "1001 rejections", fleet.processes())
    assert rejected_total(fleet) == 1001
    assert instances(fleet) == {}
    assert http_get(fleet.proxy_url + "/health")[0] == 200
    for reason in (
        "not_msgpack",
        "not_a_map",
        "missing_field",
        "unknown_type",
        "bad_address",
        "wrong_type",
        "bad_geometry",
        "unsupported_version",
        "framing",
    ):
        assert (
            metric_value(
                fleet.proxy_url,
                "pdproxy_registry_messages_total",
                {"outcome": "rejected", "reason": reason},
            )
            > 0
        ), reason
    # Logged once per sender and reason, not once per frame (by the log writer thread: wait).
    log_file = fleet.log_dir / "pdproxy.log"
    wanted = "rejected a message from b'garbage-0'"
    wait_until(lambda: wanted in log_file.read_text(), 10, "the rejection log line")
    log = log_file.read_text()
    lines = [line for line in log.splitlines() if "rejected a message from b'garbage-0'" in line]
    assert 0 < len(lines) <= 10


def test_oversized_frame_is_dropped(fleet_factory: FleetFactory, zmq_context: Any) -> None:
    fleet = fleet_factory([], proxy_args=["--registry-max-message-bytes", "1024"])
    big = dealer(zmq_context, fleet, "big")
    big.send(pack({**V0, "padding": "x" * 4096}))
    small = dealer(zmq_context, fleet, "small")
    small.send(pack({**V0, "http_address": "127.0.0.1:8101"}))
    wait_for(fleet, lambda i: "127.0.0.1:8101" in i, "the small frame")
    assert "127.0.0.1:8100" not in instances(fleet)


def test_instance_cap(fleet_factory: FleetFactory, zmq_context: Any) -> None:
    fleet = fleet_factory([], proxy_args=["--max-instances", "3"])
    sock = dealer(zmq_context, fleet, "many")
    for port in range(8100, 8105):
        sock.send(pack({**V0, "http_address": f"127.0.0.1:{port}"}))
    wait_until(
        lambda: (
            metric_value(
                fleet.proxy_url,
                "pdproxy_registry_messages_total",
                {"outcome": "rejected", "reason": "capacity"},
            )
            == 2
        ),
        5,
        "capacity rejections",
        fleet.processes(),
    )
    assert sorted(instances(fleet)) == [f"127.0.0.1:{p}" for p in range(8100, 8103)]
    # A registered instance still refreshes when the table is full.
    sock.send(pack({**V0, "http_address": "127.0.0.1:8100"}))
    wait_until(
        lambda: (
            metric_value(
                fleet.proxy_url, "pdproxy_registry_messages_total", {"outcome": "accepted"}
            )
            == 4
        ),
        5,
        "refresh accepted",
        fleet.processes(),
    )


def test_ready_reflects_the_fleet(fleet_factory: FleetFactory, zmq_context: Any) -> None:
    fleet = fleet_factory([])
    status, body = http_get(fleet.proxy_url + "/ready")
    assert status == 503 and b"no prefill" in body
    sock = dealer(zmq_context, fleet, "ready")
    sock.send(pack({**V0, "v": 1, "model": "a"}))
    sock.send(
        pack(
            {
                "v": 1,
                "type": "D",
                "http_address": "127.0.0.1:8200",
                "zmq_address": "127.0.0.1:22001",
                "model": "b",
            }
        )
    )
    wait_for(fleet, lambda i: len(i) == 2, "two instances")
    status, body = http_get(fleet.proxy_url + "/ready")
    assert status == 503 and b"compatible" in body
    sock.send(
        pack(
            {
                "v": 1,
                "type": "D",
                "http_address": "127.0.0.1:8201",
                "zmq_address": "127.0.0.1:22002",
                "model": "a",
            }
        )
    )
    wait_for(fleet, lambda i: len(i) == 3, "three instances")
    assert http_get(fleet.proxy_url + "/ready")[0] == 200


def test_many_frame_message_is_one_rejection(fleet_factory: FleetFactory, zmq_context: Any) -> None:
    fleet = fleet_factory([])
    sock = dealer(zmq_context, fleet, "many-frames")
    sock.send_multipart([pack(V0)] + [b"x" * 1024] * 3000)
    wait_until(lambda: rejected_total(fleet) >= 1, 10, "the rejection", fleet.processes())
    assert (
        metric_value(
            fleet.proxy_url,
            "pdproxy_registry_messages_total",
            {"outcome": "rejected", "reason": "framing"},
        )
        == 1
    )
    assert instances(fleet) == {}
    # The registry still serves honest workers afterwards.
    honest = dealer(zmq_context, fleet, V0["zmq_address"])
    honest.send(pack(V0))
    wait_for(fleet, lambda i: "127.0.0.1:8100" in i, "registration after the flood")


def test_load_reports_update_instances(fleet_factory: FleetFactory, zmq_context: Any) -> None:
    fleet = fleet_factory([])
    sock = dealer(zmq_context, fleet, "127.0.0.1:21001")
    for running in range(50):
        sock.send(pack({**V0, "v": 1, "load": {"running": running}}))
    wait_for(
        fleet,
        lambda i: i.get("127.0.0.1:8100", {}).get("load", {}).get("running") == 49,
        "the last load report",
    )
    assert metric_value(fleet.proxy_url, "pdproxy_registry_instances", {"role": "prefill"}) == 1
    assert (
        metric_value(fleet.proxy_url, "pdproxy_registry_messages_total", {"outcome": "accepted"})
        == 50
    )
