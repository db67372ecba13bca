"""Registry floods through a live `pdproxy serve` with a registry secret, over real ZMQ DEALER
sockets on loopback.

1. Forged 64 KiB frames that look signed (a fresh timestamp, a well-formed nonce and MAC, a body
   of tens of thousands of empty maps) cost the registry a walk and one HMAC each, and the
   registry yields to HTTP by time and bytes: /health stays prompt throughout (it stalled for
   seconds when each such frame was decoded and canonicalised, 64 frames per loop turn).
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

from pdproxy.registry.auth import new_nonce, signed
from pdproxy.testing.fleet import LocalFleet
from pdproxy.testing.processes import (
    http_get,
)
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
