"""A stream that answers 200 and then fails before its first token (vLLM's error event, after a
chat answer's role-only event) through a live `pdproxy serve` and fake workers: a failed decode
leg, retried on another pair as a whole answer's 5xx is, counted as `stream_error`; the
instance's own 4xx error event is its answer, relayed once."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdproxy.demo.fleet import LocalFleet, Worker, WorkerSpec
from tests.conftest import FleetFactory
from tests.integration.support import metric_value, post_json, set_behaviour

ROUND_ROBIN = ["--prefill-policy", "round_robin", "--decode-policy", "round_robin"]
SERVER_ERROR = {"code": 500, "message": "Internal server error"}
PATHS = ("/v1/completions", "/v1/chat/completions")


def body(path: str, n: int) -> dict[str, Any]:
    words = f"prompt number {n} about the weather in town {n * 7}"
    common = {"model": "fake-model", "max_tokens": 5, "stream": True}
    if path == "/v1/chat/completions":
        return {**common, "messages": [{"role": "user", "content": words}]}
    return {**common, "prompt": words}


def events(raw: bytes) -> list[Any]:
    """The SSE events of a stream, [DONE] checked and left out."""
    data = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    assert data[-1] == b"[DONE]", raw
    return [json.loads(e) for e in data[:-1]]


def text(raw: bytes) -> str:
    pieces = []
    for event in events(raw):
        assert "error" not in event, event
        for choice in event["choices"]:
            pieces.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(pieces)


def stream_legs(worker: Worker, path: str) -> int:
    return sum(1 for r in worker.requests() if r["path"] == path and r["body"].get("stream"))


def stream_errors(fleet: LocalFleet) -> float:
    labels = {"role": "decode", "reason": "stream_error"}
    return metric_value(fleet.proxy_url, "pdproxy_upstream_errors_total", labels)


@pytest.mark.parametrize(
    ("path", "migration"), [(PATHS[0], "off"), (PATHS[1], "off"), (PATHS[0], "on")]
)
def test_a_stream_failing_before_its_first_token_is_retried_on_another_decode(
    fleet_factory: FleetFactory, path: str, migration: str
) -> None:
    # With migration on, the stream is relayed through its ledger: the same verdict comes first.
    fleet = fleet_factory(
        [WorkerSpec("P"), WorkerSpec("D"), WorkerSpec("D")],
        [*ROUND_ROBIN, "--migration", migration],
    )
    broken, healthy = fleet.role("D")
    set_behaviour(broken.url, stream_error=SERVER_ERROR)
    answers = []
    for n in range(4):  # round robin: some first attempts go to the broken decode
        answer = post_json(fleet.proxy_url + path, body(path, n))
        assert answer.status == 200, answer.body
        answers.append(answer.body)
    # Each client got the healthy decode's own answer (asked directly: the fake's text is the
    # prompt's), none of the broken one's error, and the prompts' answers differ.
    direct = [post_json(healthy.url + path, body(path, n)).body for n in range(4)]
    assert [text(a) for a in answers] == [text(d) for d in direct]
    assert len({text(a) for a in answers}) == 4
    failed = len(broken.events()["stream_error"])
    assert failed >= 1
    assert stream_legs(broken, path) == failed  # every leg it was sent failed, and only those
    assert stream_errors(fleet) == failed
    retries = {"role": "decode", "reason": "stream_error"}
    assert metric_value(fleet.proxy_url, "pdproxy_retries_total", retries) == failed


def test_a_stream_error_the_instance_blames_on_the_request_is_relayed_once(
    fleet_factory: FleetFactory,
) -> None:
    fleet = fleet_factory([WorkerSpec("P"), WorkerSpec("D"), WorkerSpec("D")], ROUND_ROBIN)
    refusal = {"code": 400, "message": "the request cannot be served as asked"}
    for decode in fleet.role("D"):
        set_behaviour(decode.url, stream_error=refusal)
    path = "/v1/chat/completions"
    answer = post_json(fleet.proxy_url + path, body(path, 1))
    assert answer.status == 200
    role, error = events(answer.body)
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert error["error"]["code"] == 400 and error["error"]["message"] == refusal["message"]
    assert sum(stream_legs(d, path) for d in fleet.role("D")) == 1  # not retried
    assert stream_errors(fleet) == 0


def test_a_stream_failing_on_every_decode_ends_in_a_502_before_any_byte(
    fleet_factory: FleetFactory,
) -> None:
    fleet = fleet_factory([WorkerSpec("P"), WorkerSpec("D"), WorkerSpec("D")], ROUND_ROBIN)
    for decode in fleet.role("D"):
        set_behaviour(decode.url, stream_error=SERVER_ERROR)
    path = "/v1/completions"
    answer = post_json(fleet.proxy_url + path, body(path, 2))
    assert answer.status == 502
    error = answer.json()["error"]
    assert error["code"] == "decode_stream_error"
    assert "before any token: Internal server error" in error["message"]
    # The default three attempts: both decodes, one of them twice.
    assert sum(stream_legs(d, path) for d in fleet.role("D")) == 3
    assert stream_errors(fleet) == 3
