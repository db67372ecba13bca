"""The fake worker is the tests' safety net: it must fail loudly when a proxy tags or pairs
wrongly, and announce exactly what stock vLLM sends. Checked here without the proxy."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from pdproxy.demo.fleet import LocalFleet, Worker, WorkerSpec
from pdproxy.demo.processes import (
    ManagedProcess,
    free_ports,
    http_json,
    pdproxy_command,
    wait_http_ok,
    wait_until,
)
from tests.conftest import FleetFactory
from tests.integration.support import open_raw_request, post_json

UID = "0123456789abcdef0123456789abcdef"


def tagged(prefill_kv: int, decode_kv: int) -> str:
    return f"___prefill_addr_127.0.0.1:{prefill_kv}___decode_addr_127.0.0.1:{decode_kv}_{UID}"


class Pair:
    def __init__(self, tmp_path: Path, registry: int | None = None, announce: str = "v0") -> None:
        ports = free_ports(4)
        self.p_http, self.p_kv, self.d_http, self.d_kv = ports
        extra = [] if registry is None else ["--proxy", f"127.0.0.1:{registry}"]
        extra += ["--announce", announce, "--announce-interval", "0.2", "--kv-timeout", "0.5"]
        self.procs = [
            ManagedProcess(
                f"fake-{role}",
                pdproxy_command(
                    "fake-worker",
                    "--role",
                    role,
                    "--port",
                    str(http),
                    "--kv-port",
                    str(kv),
                    *extra,
                ),
                tmp_path / f"{role}.log",
            )
            for role, http, kv in (("P", self.p_http, self.p_kv), ("D", self.d_http, self.d_kv))
        ]

    def start(self) -> Pair:
        for proc in self.procs:
            proc.start()
        for port in (self.p_http, self.d_http):
            wait_http_ok(f"http://127.0.0.1:{port}/health", 20, self.procs)
        return self

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    started = Pair(tmp_path).start()
    yield started
    started.stop()


BODY = {"model": "fake-model", "prompt": "check the handoff", "max_tokens": 2}


def test_correct_tagging_hands_kv_over(pair: Pair) -> None:
    rid = tagged(pair.p_kv, pair.d_kv)
    prefill = post_json(
        f"http://127.0.0.1:{pair.p_http}/v1/completions",
        dict(BODY, max_tokens=1),
        headers={"X-Request-Id": rid},
    )
    assert prefill.status == 200
    decode = post_json(
        f"http://127.0.0.1:{pair.d_http}/v1/completions", BODY, headers={"X-Request-Id": rid}
    )
    assert decode.status == 200, decode.body
    assert decode.json()["id"] == f"cmpl-{rid}"


def test_decode_refuses_kv_from_another_prefill(pair: Pair) -> None:
    # The id names some other prefill, but the KV comes from this P: a mis-paired proxy.
    elsewhere = pair.p_kv + 1000 if pair.p_kv < 60000 else pair.p_kv - 1000
    rid = tagged(elsewhere, pair.d_kv)
    prefill = post_json(
        f"http://127.0.0.1:{pair.p_http}/v1/completions", BODY, headers={"X-Request-Id": rid}
    )
    assert prefill.status == 200
    answer = post_json(
        f"http://127.0.0.1:{pair.d_http}/v1/completions", BODY, headers={"X-Request-Id": rid}
    )
    assert answer.status == 500
    message = answer.json()["error"]["message"]
    assert f"came from 127.0.0.1:{pair.p_kv}" in message and str(elsewhere) in message


def test_decode_without_prefill_fails_within_its_bound(pair: Pair) -> None:
    started = time.monotonic()
    answer = post_json(
        f"http://127.0.0.1:{pair.d_http}/v1/completions",
        BODY,
        headers={"X-Request-Id": tagged(pair.p_kv, pair.d_kv)},
    )
    assert answer.status == 500
    assert time.monotonic() - started < 5  # the 0.5 s bound, not forever


def test_decode_refuses_kv_for_another_prompt(pair: Pair) -> None:
    rid = tagged(pair.p_kv, pair.d_kv)
    post_json(
        f"http://127.0.0.1:{pair.p_http}/v1/completions",
        dict(BODY, prompt="other"),
        headers={"X-Request-Id": rid},
    )
    answer = post_json(
        f"http://127.0.0.1:{pair.d_http}/v1/completions", BODY, headers={"X-Request-Id": rid}
    )
    assert answer.status == 500


def test_untagged_requests_are_computed_locally(pair: Pair) -> None:
    answer = post_json(f"http://127.0.0.1:{pair.d_http}/v1/completions", BODY)
    assert answer.status == 200
    assert len(answer.json()["choices"][0]["text"].split()) == 2


@pytest.mark.parametrize("announce", ["v0", "v1"])
def test_announcements_on_the_wire(tmp_path: Path, announce: str) -> None:
    context: zmq.Context[Any] = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    registry = router.bind_to_random_port("tcp://127.0.0.1")
    fleet = Pair(tmp_path, registry=registry, announce=announce).start()
    try:
        frames: dict[bytes, dict[str, Any]] = {}
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        deadline = time.monotonic() + 10
        while len(frames) < 2 and time.monotonic() < deadline:
            if poller.poll(200):
                identity, frame = router.recv_multipart()
                frames[identity] = msgpack.unpackb(frame)
    finally:
        fleet.stop()
        context.destroy(linger=0)
    p_identity = f"127.0.0.1:{fleet.p_kv}".encode()
    assert set(frames) == {p_identity, f"127.0.0.1:{fleet.d_kv}".encode()}
    p_frame = frames[p_identity]
    if announce == "v0":
        # Byte for byte the keys stock vLLM's P2pNcclEngine sends, nothing else.
        assert p_frame == {
            "type": "P",
            "http_address": f"127.0.0.1:{fleet.p_http}",
            "zmq_address": f"127.0.0.1:{fleet.p_kv}",
        }
    else:
        assert p_frame["v"] == 1 and p_frame["op"] == "announce"
        assert p_frame["model"] == "fake-model" and p_frame["connector"] == "p2p_nccl"
        assert set(p_frame["geometry"]) == {
            "tp_size",
            "block_size",
            "num_layers",
            "num_kv_heads",
            "head_dim",
            "kv_dtype",
            "is_mla",
            "kv_layout",
        }
    json.dumps(p_frame)  # plain data only


def announced_load(fleet: LocalFleet, http_address: str) -> dict[str, Any] | None:
    for item in fleet.instances():
        if item["http_address"] == http_address:
            load: dict[str, Any] | None = item["load"]
            return load
    return None


def wait_load(
    fleet: LocalFleet, worker: Worker, check: Callable[[dict[str, Any]], bool], what: str
) -> dict[str, Any]:
    seen: list[dict[str, Any] | None] = [None]

    def arrived() -> bool:
        seen[0] = announced_load(fleet, worker.http_address)
        return seen[0] is not None and check(seen[0])

    wait_until(arrived, 10, f"{what} (last announced: {seen[0]})", fleet.processes())
    assert seen[0] is not None
    return seen[0]


IDLE = {"running": 0, "waiting": 0, "kv_usage": 0.0}


def test_announced_load_is_measured_and_can_be_forced(fleet_factory: FleetFactory) -> None:
    capacity = 64
    fleet = fleet_factory(
        [WorkerSpec("D", token_latency_ms=50, extra_args=("--kv-capacity-tokens", str(capacity)))]
    )
    decode = fleet.role("D")[0]
    wait_load(fleet, decode, lambda load: load == IDLE, "an idle load")

    # A streamed request that would run for 20 s holds its prompt's and tokens' KV meanwhile.
    prompt = "one two three four"
    stream = {"model": "fake-model", "prompt": prompt, "max_tokens": 400, "stream": True}
    sock = open_raw_request(decode.url + "/v1/completions", stream)
    try:
        busy = wait_load(
            fleet,
            decode,
            lambda load: load["running"] == 1 and load["kv_usage"] > 0,
            "one running request",
        )
        assert busy["waiting"] == 0
        assert 4 / capacity <= busy["kv_usage"] <= 1.0
        measured = http_json(decode.url + "/_fake/load")["measured"]
        assert measured["running"] == 1 and measured["kv_usage"] >= 4 / capacity
    finally:
        sock.close()  # the worker aborts the request and lets its KV go
    wait_load(fleet, decode, lambda load: load == IDLE, "the load after the abort")

    forced = {"running": 7, "waiting": 3, "kv_usage": 0.5}
    answer = post_json(decode.url + "/_fake/load", forced)
    assert answer.status == 200 and answer.json()["announced"] == forced
    wait_load(fleet, decode, lambda load: load == forced, "the forced load")
    # Forcing one field keeps the others measured; {} is measured again.
    assert post_json(decode.url + "/_fake/load", {"kv_usage": 0.25}).status == 200
    wait_load(fleet, decode, lambda load: load == {**IDLE, "kv_usage": 0.25}, "kv_usage only")
    assert post_json(decode.url + "/_fake/load", {}).status == 200
    wait_load(fleet, decode, lambda load: load == IDLE, "the measured load again")
    for bad in ({"kv_usage": 1.5}, {"running": -1}, {"running": True}, {"load": 1}):
        assert post_json(decode.url + "/_fake/load", bad).status == 400
