"""Registry floods through a live `pdproxy serve` with a registry secret, over real ZMQ DEALER
sockets on loopback.

1. Forged 64 KiB frames that look signed (a fresh timestamp, a well-formed nonce and MAC, a body
   of tens of thousands of empty maps) cost the registry a walk and one HMAC each, and the
   registry yields to HTTP by time and bytes: /health stays prompt throughout (it stalled for
   seconds when each such frame was decoded and canonicalised, 64 frames per loop turn).
2. Unsigned v0 pings from many identities fill only their own cap: a signed worker still
   registers, and a v0 ping for its address changes nothing.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import yaml
import zmq

from pdproxy.demo.fleet import LocalFleet
from pdproxy.demo.processes import (
    LOOPBACK,
    ManagedProcess,
    free_ports,
    http_get,
    pdproxy_command,
    wait_until,
)
from pdproxy.registry.auth import new_nonce, signed
from tests.conftest import FleetFactory
from tests.integration.support import metric_value

SECRET = "flood-registry-secret-0123456789"
ZmqContext = zmq.Context[zmq.Socket[bytes]]

FLOOD_SECONDS = 5.0
FLOOD_SOCKETS = 4
FRAME_LIMIT = 65536  # the proxy's default registry_max_message_bytes
HEALTH_P99_BOUND_S = 0.5  # "not stalled" (seconds before the fix), far above a prompt answer
HEALTH_TIMEOUT_S = 10.0
MIN_FORGED_COUNTED = 200  # the flood did reach the registry

V0_SENDERS = 40
MAX_INSTANCES = 8  # the unsigned instances' cap is then a quarter: 2


@pytest.fixture
def zmq_context() -> Iterator[ZmqContext]:
    context: ZmqContext = zmq.Context()
    yield context
    context.destroy(linger=0)


def config_args(path: Path, **settings: Any) -> list[str]:
    path.write_text(yaml.safe_dump({"registry_secret": SECRET, "ttl": 60, **settings}))
    return ["--config", str(path)]


def dealer(context: ZmqContext, fleet: LocalFleet, identity: bytes) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{fleet.registry_address}")
    return sock


def rejected(fleet: LocalFleet, reason: str) -> float:
    labels = {"outcome": "rejected", "reason": reason}
    return metric_value(fleet.proxy_url, "pdproxy_registry_messages_total", labels)


def accepted(fleet: LocalFleet) -> float:
    labels = {"outcome": "accepted", "reason": "ok"}
    return metric_value(fleet.proxy_url, "pdproxy_registry_messages_total", labels)


# -- 1. forged 64 KiB frames ------------------------------------------------------------------


def forged_frame(port: int) -> bytes:
    """A v1 announce signed with the wrong secret, padded with empty maps to just under the
    frame limit: well-formed in every way a sender without the secret can make it."""
    message: dict[str, Any] = {
        "v": 1,
        "op": "announce",
        "type": "D",
        "http_address": f"127.0.0.1:{port}",
        "zmq_address": f"127.0.0.1:{port + 1}",
        "model": "flood-model",
    }
    base = len(msgpack.packb(signed(message, b"not-the-registry-secret", 0.0, new_nonce())))
    message["pad"] = [{}] * (FRAME_LIMIT - base - 64)
    frame: bytes = msgpack.packb(
        signed(message, b"not-the-registry-secret", time.time(), new_nonce())
    )
    assert FRAME_LIMIT - 128 < len(frame) <= FRAME_LIMIT
    return frame


class Flood:
    """Sends forged frames round-robin from a few DEALER sockets until stopped (or
    FLOOD_SECONDS pass); a full send queue means the registry is behind: wait a little."""

    def __init__(self, sockets: list[zmq.Socket[bytes]], frames: list[bytes]) -> None:
        self.sockets = sockets
        self.frames = frames
        self.stop = threading.Event()
        self.sent = 0

    def run(self) -> None:
        deadline = time.monotonic() + FLOOD_SECONDS
        index = 0
        while not self.stop.is_set() and time.monotonic() < deadline:
            sock = self.sockets[index % len(self.sockets)]
            try:
                sock.send(self.frames[index % len(self.frames)], zmq.NOBLOCK)
                self.sent += 1
            except zmq.Again:
                self.stop.wait(0.001)
            index += 1


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def measure_health(url: str, flood: threading.Thread) -> list[tuple[int, float]]:
    """(status, seconds) of /health, asked back to back while the flood runs."""
    samples: list[tuple[int, float]] = []
    while flood.is_alive():
        started = time.monotonic()
        status, _ = http_get(url + "/health", timeout=HEALTH_TIMEOUT_S)
        samples.append((status, time.monotonic() - started))
        time.sleep(0.01)
    return samples


def test_health_stays_prompt_while_forged_64k_frames_flood_the_registry(
    fleet_factory: FleetFactory,
    zmq_context: ZmqContext,
    tmp_path: Path,
    record_property: Callable[[str, object], None],
) -> None:
    fleet = fleet_factory([], proxy_args=config_args(tmp_path / "proxy.yaml"))
    frames = [forged_frame(29_000 + 2 * i) for i in range(4)]
    sockets = [dealer(zmq_context, fleet, f"flood-{i}".encode()) for i in range(FLOOD_SOCKETS)]
    flood = Flood(sockets, frames)
    thread = threading.Thread(target=flood.run, name="registry-flood", daemon=True)
    thread.start()
    try:
        samples = measure_health(fleet.proxy_url, thread)
    finally:
        flood.stop.set()
        thread.join(FLOOD_SECONDS + 5)
    counted = rejected(fleet, "bad_signature")
    latencies = [seconds for _, seconds in samples]
    summary = {
        "flood_seconds": FLOOD_SECONDS,
        "frame_bytes": len(frames[0]),
        "frames_sent": flood.sent,
        "frames_counted_bad_signature": int(counted),
        "health_polls": len(samples),
        "health_p50_ms": round(percentile(latencies, 0.5) * 1000, 1),
        "health_p99_ms": round(percentile(latencies, 0.99) * 1000, 1),
        "health_max_ms": round(max(latencies) * 1000, 1),
    }
    for key, value in summary.items():
        record_property(key, value)
    print("registry forged-frame flood:", json.dumps(summary))

    assert fleet.proxy is not None and fleet.proxy.alive(), "pdproxy died"
    assert all(status == 200 for status, _ in samples), samples
    assert percentile(latencies, 0.99) < HEALTH_P99_BOUND_S, summary
    assert len(samples) >= 5, f"/health barely answered during the flood: {summary}"
    assert counted >= MIN_FORGED_COUNTED, f"the flood hardly reached the registry: {summary}"
    assert fleet.registered() == set()


# -- 2. unsigned v0 pings against signed workers ----------------------------------------------


def v0_frame(http_port: int, role: str = "P", zmq_port: int | None = None) -> bytes:
    frame: bytes = msgpack.packb(
        {
            "type": role,
            "http_address": f"127.0.0.1:{http_port}",
            "zmq_address": f"127.0.0.1:{zmq_port if zmq_port is not None else http_port + 1}",
        }
    )
    return frame


def signed_worker(fleet: LocalFleet, tmp_path: Path) -> tuple[ManagedProcess, str, str]:
    """A fake prefill worker announcing signed v1 every 0.5 s: (process, http, zmq address)."""
    secret_file = tmp_path / "registry.secret"
    secret_file.write_text(SECRET + "\n")
    http_port, kv_port = free_ports(2)
    argv = pdproxy_command(
        "fake-worker",
        "--role",
        "P",
        "--port",
        str(http_port),
        "--kv-port",
        str(kv_port),
        "--model",
        "fake-model",
        "--proxy",
        fleet.registry_address,
        "--announce",
        "v1",
        "--announce-interval",
        "0.5",
        "--registry-secret-file",
        str(secret_file),
    )
    process = ManagedProcess("fake-signed-P", argv, tmp_path / "fake-signed-P.log")
    return process, f"{LOOPBACK}:{http_port}", f"{LOOPBACK}:{kv_port}"


def listing(fleet: LocalFleet, http_address: str) -> dict[str, Any] | None:
    return next((i for i in fleet.instances() if i["http_address"] == http_address), None)


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "registry-process"])
def test_unsigned_v0_pings_can_neither_lock_out_nor_rewrite_signed_workers(
    fleet_factory: FleetFactory, zmq_context: ZmqContext, tmp_path: Path, workers: int
) -> None:
    fleet = fleet_factory(
        [],
        proxy_args=config_args(
            tmp_path / "proxy.yaml",
            registry_allow_unsigned_v0=True,
            max_instances=MAX_INSTANCES,
            workers=workers,
        ),
    )
    # Many identities, one v0 ping each, each for an address of its own (the sockets are
    # kept: one closed at once, with no linger, would drop its ping).
    senders = [dealer(zmq_context, fleet, f"v0-{i}".encode()) for i in range(V0_SENDERS)]
    for i, sock in enumerate(senders):
        sock.send(v0_frame(20_000 + 2 * i))
    cap = MAX_INSTANCES // 4
    wait_until(
        lambda: accepted(fleet) + rejected(fleet, "unsigned_capacity") >= V0_SENDERS,
        10,
        "the v0 pings counted",
        fleet.processes(),
    )
    assert accepted(fleet) == cap and rejected(fleet, "unsigned_capacity") == V0_SENDERS - cap
    # The counters are the registry's own; with a registry process, the HTTP worker that lists
    # the fleet has the table once the next publication reached it (a loaded machine delays it).
    # With exactly `cap` accepted, the listing can reach `cap` and no more.
    wait_until(
        lambda: len(fleet.registered()) == cap, 10, "the accepted pings listed", fleet.processes()
    )

    process, http_address, zmq_address = signed_worker(fleet, tmp_path)
    try:
        process.start()
        wait_until(
            lambda: listing(fleet, http_address) is not None,
            15,
            "the signed worker's registration",
            [*fleet.processes(), process],
        )
        before = listing(fleet, http_address)
        assert before is not None and before["source"] == "v1"
        assert (before["type"], before["zmq_address"]) == ("P", zmq_address)

        sock = dealer(zmq_context, fleet, b"v0-hijacker")
        http_port = int(http_address.rpartition(":")[2])
        kv_port = int(zmq_address.rpartition(":")[2])
        sock.send(v0_frame(http_port, role="D", zmq_port=29_999))  # moves it: refused
        sock.send(v0_frame(http_port, zmq_port=kv_port))  # echoes it: accepted, changes nothing
        # One DEALER's frames are handled in order: once this unsigned v1 is counted, so are
        # the two pings before it.
        sock.send(msgpack.packb({"v": 1, "op": "leave", "http_address": http_address}))
        wait_until(
            lambda: rejected(fleet, "unsigned") >= 1,
            10,
            "the pings for the signed worker handled",
            fleet.processes(),
        )
        time.sleep(0.5)  # an HTTP worker's copy of the table would show a change by now
        after = listing(fleet, http_address)
        assert after is not None
        fields = ("type", "zmq_address", "source", "model")
        assert {k: after[k] for k in fields} == {k: before[k] for k in fields}
        assert rejected(fleet, "signed_instance") == 1
    finally:
        process.stop()
    # The rejections are logged (rate-limited: the flood's own lines may use up the budget).
    log_file = fleet.log_dir / "pdproxy.log"
    wait_until(
        lambda: (
            "unsigned_capacity: unsigned instances are at their cap (2)"
            in log_file.read_text(encoding="utf-8", errors="replace")
        ),
        10,
        "a rejection's log line",
        fleet.processes(),
    )
