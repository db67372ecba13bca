"""The decode leg sent together with the prefill leg (`concurrent_decode_connectors`), through a
live `pdproxy serve` and fake workers whose decode waits for the KV the prefill pushes.

Timing is read from the workers' own records (CLOCK_MONOTONIC, one clock for the machine): when
the decode instance got its request, and when the prefill sent the KV after its simulated
prefill time."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from pdproxy.demo.fleet import LocalFleet, Worker, WorkerSpec
from pdproxy.demo.processes import wait_until
from tests.conftest import FleetFactory
from tests.integration.support import metric_value, post_json, set_behaviour

MODEL = "fake-model"
PREFILL_MS = 400.0
ROUND_ROBIN = ["--prefill-policy", "round_robin", "--decode-policy", "round_robin"]


def spec(role: str, connector: str, **kwargs: Any) -> WorkerSpec:
    return WorkerSpec(role, extra_args=("--connector", connector), **kwargs)  # type: ignore[arg-type]


def body(stream: bool = False, chat: bool = False) -> dict[str, Any]:
    words = " ".join(f"word{i}" for i in range(40))
    payload: dict[str, Any] = {"model": MODEL, "max_tokens": 5, "stream": stream}
    if chat:
        payload["messages"] = [{"role": "user", "content": words}]
    else:
        payload["prompt"] = words
    return payload


def path(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


def arrival(worker: Worker) -> dict[str, float]:
    """When each request (by X-Request-Id) reached `worker`."""
    return {
        r["headers"]["x-request-id"]: float(r["time"])
        for r in worker.requests()
        if "x-request-id" in r["headers"]
    }


def kv_sent(worker: Worker) -> list[float]:
    return [float(e["time"]) for e in worker.events()["kv_sent"]]


def tokens_of(answer_body: bytes, stream: bool, chat: bool) -> str:
    """The generated text, from a whole answer or an SSE stream."""
    if not stream:
        choice = json.loads(answer_body)["choices"][0]
        return str(choice["message"]["content"] if chat else choice["text"])
    text = ""
    for line in answer_body.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            choice = json.loads(line[6:])["choices"][0]
            text += choice.get("text") or choice.get("delta", {}).get("content") or ""
    return text


@pytest.mark.parametrize(("stream", "chat"), [(False, False), (True, False), (True, True)])
def test_pdproxy_pairs_send_the_decode_leg_before_the_prefill_finished(
    fleet_factory: FleetFactory, stream: bool, chat: bool
) -> None:
    fleet = fleet_factory(
        [spec("P", "pdproxy", prefill_latency_ms=PREFILL_MS), spec("D", "pdproxy")]
    )
    [prefill], [decode] = fleet.role("P"), fleet.role("D")
    answer = post_json(fleet.proxy_url + path(chat), body(stream, chat))
    assert answer.status == 200, answer.body
    assert len(tokens_of(answer.body, stream, chat).split()) == 5
    [(request_id, decode_got)] = arrival(decode).items()
    [prefill_got] = arrival(prefill).values()
    [pushed] = kv_sent(prefill)
    # The decode had its request while the prefill was still computing ...
    assert decode_got < pushed
    assert decode_got - prefill_got < PREFILL_MS / 1000.0 / 2
    # ... and it loaded the KV the prefill pushed (the fake checks sender, size and prompt).
    assert decode.events()["kv_ok"] == [request_id]


@pytest.mark.parametrize(
    ("connector", "listed", "concurrent"),
    [
        ("pdproxy", "", False),  # an empty list keeps every pair's legs in sequence
        ("p2p_nccl", None, False),  # p2p_nccl is not in the default list
        ("p2p_nccl", "p2p_nccl", True),  # ... and overlaps when it is listed
    ],
)
def test_the_list_decides_which_connector_kinds_overlap_their_legs(
    fleet_factory: FleetFactory, connector: str, listed: str | None, concurrent: bool
) -> None:
    fleet = fleet_factory(
        [spec("P", connector, prefill_latency_ms=PREFILL_MS), spec("D", connector)],
        proxy_args=[] if listed is None else ["--concurrent-decode-connectors", listed],
    )
    answer = post_json(fleet.proxy_url + path(False), body())
    assert answer.status == 200, answer.body
    [decode_got] = arrival(fleet.role("D")[0]).values()
    [pushed] = kv_sent(fleet.role("P")[0])
    assert (decode_got < pushed) is concurrent


def aborted_ids(worker: Worker) -> set[str]:
    return {e["request_id"] for e in worker.events()["aborted"]}


def wait_aborted(fleet: LocalFleet, worker: Worker, request_id: str) -> None:
    wait_until(
        lambda: request_id in aborted_ids(worker),
        10.0,
        f"{worker.http_address} saw request {request_id} aborted",
        fleet.processes(),
    )


def test_a_failed_prefill_cancels_the_waiting_decode_and_the_request_is_retried(
    fleet_factory: FleetFactory,
) -> None:
    fleet = fleet_factory(
        [spec("P", "pdproxy"), spec("P", "pdproxy"), spec("D", "pdproxy")],
        proxy_args=ROUND_ROBIN,
    )
    [decode] = fleet.role("D")
    failing, healthy = fleet.role("P")
    set_behaviour(failing.url, status=500, delay_ms=300)
    # Round robin sends one of the first two requests to the failing prefill first.
    sent = 0
    while not arrival(failing) and sent < 2:
        answer = post_json(fleet.proxy_url + path(False), body())
        assert answer.status == 200, answer.body
        sent += 1
    [first_id] = [i for i in arrival(decode) if i in arrival(failing)]
    # The decode leg of the failed attempt had reached the decode instance and was cancelled
    # (not left waiting for KV that never comes); the retry went through the healthy prefill.
    wait_aborted(fleet, decode, first_id)
    assert aborted_ids(decode) == {first_id}
    assert len(arrival(healthy)) == sent and len(arrival(decode)) == sent + 1
    assert len(decode.events()["completed"]) == sent
    assert metric_value(fleet.proxy_url, "pdproxy_retries_total") == 1


def test_a_prefill_refusal_reaches_the_client_and_cancels_the_decode(
    fleet_factory: FleetFactory,
) -> None:
    fleet = fleet_factory([spec("P", "pdproxy"), spec("D", "pdproxy")])
    [prefill], [decode] = fleet.role("P"), fleet.role("D")
    refusal = {"error": {"message": "prompt too long (from P)", "type": "BadRequestError"}}
    set_behaviour(prefill.url, status=400, error_body=refusal, delay_ms=300)
    answer = post_json(fleet.proxy_url + path(False), body())
    assert answer.status == 400, answer.body
    assert answer.json()["error"]["message"] == "prompt too long (from P)"
    [request_id] = arrival(decode)
    wait_aborted(fleet, decode, request_id)
    assert decode.events()["completed"] == []


def test_a_failed_decode_cancels_the_prefill_and_the_client_hears_why(
    fleet_factory: FleetFactory,
) -> None:
    fleet = fleet_factory(
        [spec("P", "pdproxy", prefill_latency_ms=2000.0), spec("D", "pdproxy")],
        proxy_args=["--max-attempts", "1"],
    )
    [prefill], [decode] = fleet.role("P"), fleet.role("D")
    set_behaviour(decode.url, status=500)
    answer = post_json(fleet.proxy_url + path(False), body())
    answered = time.monotonic()
    assert answer.status == 502, answer.body
    error = answer.json()["error"]
    assert error["code"] == "decode_status_5xx" and decode.http_address in error["message"]
    # The client heard it before the prefill could have finished its 2 s, and the prefill's
    # request was cancelled rather than left computing KV nobody will load.
    [(request_id, prefill_got)] = arrival(prefill).items()
    assert answered < prefill_got + 2.0
    wait_aborted(fleet, prefill, request_id)
    assert prefill.events()["kv_sent"] == []
