"""The nixl_push flow through a live `pdproxy serve` and fake workers speaking vLLM's
NixlPushConnector protocol (pdproxy.fake_vllm.kv_nixl_push): both legs at once, the decode leg
naming the prefill by the engine id and side channel the prefill announced, the decode
registering there and the prefill writing the KV into it; mixed fleets where every pair is of
one kind; a failed prefill retried on another, the failed attempt's decode leg ended."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from pdproxy.demo.fleet import WorkerSpec
from tests.conftest import FleetFactory
from tests.integration.support import metric_value, post_json, set_behaviour
from tests.integration.test_mooncake_flow import ROUND_ROBIN, completion, legs, spec

# The failed attempt's decode leg must have ended by then (the proxy closes it at once; the
# fake decode's own bound, --kv-timeout, is far below this too).
DECODE_LEG_END_S = 20.0


ENGINE_ID = "push-engine-1"


@pytest.mark.parametrize(("stream", "chat"), [(False, False), (True, True)])
def test_the_decode_leg_names_the_prefill_which_writes_the_kv_into_it(
    fleet_factory: FleetFactory, stream: bool, chat: bool
) -> None:
    # The prefill's engine id is fixed only so the test knows it; the proxy learns it, with
    # the side channel (its KV port), from the prefill's announcement.
    push_prefill = WorkerSpec(
        "P",
        prefill_latency_ms=300.0,
        extra_args=("--connector", "nixl_push", "--engine-id", ENGINE_ID),
    )
    fleet = fleet_factory([push_prefill, spec("D", "nixl_push")])
    [prefill], [decode] = fleet.role("P"), fleet.role("D")
    path, body = completion(stream, chat)
    answer = post_json(fleet.proxy_url + path, body)
    assert answer.status == 200, answer.body
    [p_leg], [d_leg] = legs(prefill), legs(decode)
    assert p_leg["params"]["do_remote_decode"] is True
    assert d_leg["id"] == p_leg["id"]  # vLLM matches the two legs by it
    # The coordinates the prefill announced, and what vLLM's push decode reads.
    host, port = prefill.zmq_address.rsplit(":", 1)
    assert d_leg["params"] == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": ENGINE_ID,
        "remote_request_id": d_leg["id"],
        "remote_host": host,
        "remote_port": int(port),
        "tp_size": 1,
    }
    # The decode registered with the prefill, which wrote (pushed) the KV to it.
    p_events, d_events = prefill.events(), decode.events()
    assert [e["decode"] for e in p_events["kv_registered"]] == [decode.zmq_address]
    assert [e["to"] for e in p_events["kv_sent"]] == [decode.zmq_address]
    assert len(d_events["kv_ok"]) == 1 and not d_events.get("computed_locally")
    assert not p_events.get("kv_failed") and not d_events.get("kv_failed")
    # Both legs at once: the decode registered while the prefill still computed (300 ms).
    assert float(p_events["kv_registered"][0]["time"]) < float(p_events["kv_sent"][0]["time"])
    d_time = float(decode.requests()[0]["time"])
    assert d_time < float(p_events["kv_sent"][0]["time"])


def test_a_mixed_fleet_pairs_only_instances_of_one_kind(fleet_factory: FleetFactory) -> None:
    kinds = ("nixl", "nixl_push", "pdproxy", "mooncake")
    workers = [spec(role, kind) for kind in kinds for role in ("P", "D")]
    fleet = fleet_factory(workers, ROUND_ROBIN)
    path, body = completion()
    for _ in range(12):
        answer = post_json(fleet.proxy_url + path, body)
        assert answer.status == 200, answer.body
    kind_of = {w.http_address: w.spec.extra_args[1] for w in fleet.workers}
    prefill_of_id = {
        leg["id"]: worker.http_address for worker in fleet.role("P") for leg in legs(worker)
    }
    served: Counter[str] = Counter()
    for worker in fleet.role("D"):
        for leg in legs(worker):
            # Never a cross-kind pair: the prefill that got this request is of the decode's kind.
            assert kind_of[prefill_of_id[leg["id"]]] == kind_of[worker.http_address]
            served[kind_of[worker.http_address]] += 1
        events = worker.events()
        assert not events.get("kv_failed") and not events.get("computed_locally")
    assert set(served) == set(kinds), served
    assert metric_value(fleet.proxy_url, "pdproxy_upstream_errors_total") == 0


def test_a_failed_prefill_is_retried_and_its_decode_leg_ends(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory(
        [spec("P", "nixl_push"), spec("P", "nixl_push"), spec("D", "nixl_push")], ROUND_ROBIN
    )
    broken, healthy = fleet.role("P")
    [decode] = fleet.role("D")
    set_behaviour(f"http://{broken.http_address}", status=500)
    path, body = completion()
    for _ in range(2):  # round robin: one of the two starts on the broken prefill
        answer = post_json(fleet.proxy_url + path, body)
        assert answer.status == 200, answer.body
    assert metric_value(fleet.proxy_url, "pdproxy_retries_total", {"role": "prefill"}) >= 1
    failed_ids = {leg["id"] for leg in legs(broken)}  # one or both requests started there
    assert failed_ids and len(legs(healthy)) == 2
    # The decode got each failed attempt's leg too (both legs at once); the proxy closed it
    # when the prefill failed, so it ended (aborted) instead of waiting for KV that never comes.
    assert len([leg for leg in legs(decode) if leg["id"] in failed_ids]) == len(failed_ids)
    deadline = time.monotonic() + DECODE_LEG_END_S
    while len(decode.events().get("aborted", [])) < len(failed_ids):
        assert time.monotonic() < deadline, decode.events()
        time.sleep(0.05)
    events = decode.events()
    assert len(events["aborted"]) == len(failed_ids), events
    # The answers came from KV the healthy prefill wrote, one per request.
    assert len(events["kv_ok"]) == 2
    assert [e["to"] for e in healthy.events()["kv_sent"]] == [decode.zmq_address] * 2
    assert not broken.events().get("kv_sent")


# The decode's own first-byte bound here; the prefill's (20 s) would be added to it if it still
# counted once the prefill answered.
DECODE_FIRST_BYTE_S = 1.0
BOUNDS = [
    "--connect-timeout",
    "0.5",
    "--decode-first-byte-timeout",
    str(DECODE_FIRST_BYTE_S),
    "--prefill-timeout",
    "20",
    "--max-attempts",
    "1",
]


def test_once_the_prefill_answered_the_decode_has_only_its_own_bound(
    fleet_factory: FleetFactory,
) -> None:
    # A decode that shows no first byte for 3 s after a prefill that answered at once: what a
    # push vLLM dropped looks like from the proxy (the decode waits for KV that never comes).
    fleet = fleet_factory([spec("P", "nixl_push"), spec("D", "nixl_push")], BOUNDS)
    [decode] = fleet.role("D")
    set_behaviour(f"http://{decode.http_address}", delay_ms=3000)
    path, body = completion(stream=True)
    answer = post_json(fleet.proxy_url + path, body)
    assert answer.status == 504, answer.body
    message = answer.json()["error"]["message"]
    expected = f"no first byte after the prefill answered within {DECODE_FIRST_BYTE_S:g}s"
    assert expected in message, message
    assert decode.http_address in message
    # The proxy closed the decode leg, which vLLM (here the fake) takes as an abort.
    deadline = time.monotonic() + DECODE_LEG_END_S
    while not decode.events().get("aborted"):
        assert time.monotonic() < deadline, decode.events()
        time.sleep(0.05)


def test_the_decode_may_wait_beyond_its_own_bound_while_the_prefill_computes(
    fleet_factory: FleetFactory,
) -> None:
    slow_prefill = spec("P", "nixl_push", prefill_latency_ms=2500.0)
    fleet = fleet_factory([slow_prefill, spec("D", "nixl_push")], BOUNDS)
    [prefill], [decode] = fleet.role("P"), fleet.role("D")
    path, body = completion(stream=True)
    answer = post_json(fleet.proxy_url + path, body)
    assert answer.status == 200, answer.body
    assert [e["to"] for e in prefill.events()["kv_sent"]] == [decode.zmq_address]
    assert len(decode.events()["kv_ok"]) == 1
