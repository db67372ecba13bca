"""vLLM's token-in/token-out `POST /inference/v1/generate` through a live `pdproxy serve` and
fake workers: disaggregated like completions (both legs, the prefill leg capped at one token
and not streamed, the id tags and kv_transfer_params of each connector), retried, cancelled,
counted and logged; bad input refused in vLLM's error shape before any leg."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from pdproxy.demo.fleet import LocalFleet, Worker, WorkerSpec
from pdproxy.demo.processes import wait_until
from pdproxy.ids import parse_request_id
from tests.conftest import FleetFactory
from tests.integration.support import (
    hang_up_mid_stream_aborts,
    metric_value,
    one_pair_fleet,
    open_raw_request,
    post_json,
)

MODEL = "fake-model"
GENERATE = "/inference/v1/generate"
ROUND_ROBIN = ["--prefill-policy", "round_robin", "--decode-policy", "round_robin"]


def generate_body(prompt: int = 0, stream: bool = False, **sampling: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "token_ids": [prompt, *range(100, 140)],
        "sampling_params": {"max_tokens": 6, "temperature": 0, **sampling},
        "stream": stream,
    }


def legs(worker: Worker) -> list[dict[str, Any]]:
    return [r for r in worker.requests() if r["path"] == GENERATE]


def streamed(body: bytes) -> list[dict[str, Any]]:
    """The SSE events of a stream, [DONE] checked and left out."""
    events = [e.removeprefix(b"data: ") for e in body.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    with one_pair_fleet(tmp_path_factory.mktemp("generate")) as fleet:
        yield fleet


def test_generate_runs_both_legs_and_relays_the_decodes_token_ids(fleet: LocalFleet) -> None:
    fleet.reset_records()
    [prefill], [decode] = fleet.role("P"), fleet.role("D")
    body = {**generate_body(min_tokens=3), "request_id": "client-body-id", "extra": [1, "x"]}
    answer = post_json(fleet.proxy_url + GENERATE, body, headers={"X-Request-Id": "client-7"})
    assert answer.status == 200, answer.body
    assert answer.headers["x-request-id"] == "client-7"
    reply = answer.json()
    assert reply["output_mode"] == "tokens"
    (choice,) = reply["choices"]
    assert len(choice["token_ids"]) == 6 and choice["finish_reason"] == "length"
    # The decode's own answer to the same request, asked directly, is what came back.
    direct = post_json(decode.url + GENERATE, body).json()
    assert direct["choices"][0]["token_ids"] == choice["token_ids"]

    [p_leg], [d_leg, _direct] = legs(prefill), legs(decode)
    request_id = reply["request_id"].removeprefix("generate-tokens-")
    tagged = parse_request_id(request_id)
    assert tagged is not None
    assert str(tagged.prefill) == prefill.zmq_address and str(tagged.decode) == decode.zmq_address
    assert p_leg["headers"]["x-request-id"] == d_leg["headers"]["x-request-id"] == request_id
    sampling = {**body["sampling_params"], "max_tokens": 1, "min_tokens": 1}
    assert p_leg["body"] == {**body, "sampling_params": sampling, "stream": False}
    assert d_leg["body"] == body  # the client's body, unchanged
    assert decode.events()["kv_ok"] == [request_id]


def test_a_streamed_generate_relays_the_decodes_chunks(fleet: LocalFleet) -> None:
    fleet.reset_records()
    [prefill], [decode] = fleet.role("P"), fleet.role("D")
    body = generate_body(1, stream=True)
    body["stream_options"] = {"include_usage": True}
    answer = post_json(fleet.proxy_url + GENERATE, body)
    assert answer.status == 200, answer.body
    assert answer.headers["content-type"].startswith("text/event-stream")
    *chunks, usage = streamed(answer.body)
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    whole = post_json(fleet.proxy_url + GENERATE, {**body, "stream": False, "stream_options": None})
    assert ids == whole.json()["choices"][0]["token_ids"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    p_leg = legs(prefill)[0]
    expected = {**body, "sampling_params": {**body["sampling_params"], "max_tokens": 1}}
    expected["stream"] = False
    del expected["stream_options"]
    assert p_leg["body"] == expected
    assert legs(decode)[0]["body"] == body
    assert len(decode.events()["kv_ok"]) == 2


def test_different_prompts_give_different_tokens(fleet: LocalFleet) -> None:
    first = post_json(fleet.proxy_url + GENERATE, generate_body(1)).json()
    second = post_json(fleet.proxy_url + GENERATE, generate_body(2)).json()
    assert first["choices"][0]["token_ids"] != second["choices"][0]["token_ids"]


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"token_ids": None}, "token_ids"),
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": "1 2 3"}, "token_ids"),
        ({"token_ids": [1, "2"]}, "token_ids"),
        ({"token_ids": [1, -2]}, "token_ids"),
        ({"token_ids": [1, True]}, "token_ids"),
        ({"sampling_params": None}, "sampling_params"),
        ({"sampling_params": [1]}, "sampling_params"),
        (
            {"sampling_params": {"extra_args": {"kv_transfer_params": {"x": 1}}}},
            "sampling_params.extra_args.kv_transfer_params",
        ),
        ({"kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params"),
        ({"stream": "yes"}, "stream"),
    ],
)
def test_bad_input_is_a_400_in_vllms_shape_and_sends_no_leg(
    fleet: LocalFleet, change: dict[str, Any], param: str
) -> None:
    fleet.reset_records()
    body = {k: v for k, v in {**generate_body(), **change}.items() if v is not None}
    answer = post_json(fleet.proxy_url + GENERATE, body)
    assert answer.status == 400, answer.body
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param in ("stream", "kv_transfer_params"):  # refused as for completions
        assert error["param"] == param and error["type"] == "invalid_request_error"
    else:  # vLLM's validation error shape
        assert error["param"] == f"body.{param}" and error["type"] == "Bad Request"
    assert error["message"] and error["code"] in (400, "invalid_type", "invalid_request")
    assert b"Traceback" not in answer.body
    assert fleet.completion_requests() == []


def test_generate_is_counted_and_logged(fleet: LocalFleet) -> None:
    labels = {"endpoint": GENERATE, "status": "200"}
    before = metric_value(fleet.proxy_url, "pdproxy_requests_total", labels)
    mine = {"X-Request-Id": "generate-counted-and-logged"}
    answer = post_json(fleet.proxy_url + GENERATE, generate_body(3), headers=mine)
    assert answer.status == 200
    assert metric_value(fleet.proxy_url, "pdproxy_requests_total", labels) == before + 1

    def logged() -> list[dict[str, Any]]:
        # This request's line: the module's other requests are logged too, and lines are
        # written from a queue, so "the last line" may be another's.
        text = (fleet.log_dir / "pdproxy.log").read_text()
        lines = [json.loads(line) for line in text.splitlines() if line.strip()]
        return [line for line in lines if line.get("client_request_id") == mine["X-Request-Id"]]

    wait_until(lambda: len(logged()) >= 1, 10, "the access line of this generate request")
    [line] = logged()
    assert line["endpoint"] == GENERATE
    assert line["status"] == 200 and line["outcome"] == "ok" and line["model"] == MODEL
    assert line["prefill"] and line["decode"] and line["direct"] is False


def spec(role: str, connector: str) -> WorkerSpec:
    return WorkerSpec(role, extra_args=("--connector", connector))  # type: ignore[arg-type]


@pytest.mark.parametrize("connector", ["nixl", "nixl_push", "mooncake", "pdproxy"])
@pytest.mark.parametrize("stream", [False, True])
def test_each_connectors_kv_reaches_the_decode(
    fleet_factory: FleetFactory, connector: str, stream: bool
) -> None:
    fleet = fleet_factory([spec("P", connector), spec("D", connector)])
    [prefill], [decode] = fleet.role("P"), fleet.role("D")
    answer = post_json(fleet.proxy_url + GENERATE, generate_body(4, stream=stream))
    assert answer.status == 200, answer.body
    [p_leg], [d_leg] = legs(prefill), legs(decode)
    request_id = p_leg["headers"]["x-request-id"]
    assert d_leg["headers"]["x-request-id"] == request_id
    p_params = p_leg["body"].get("kv_transfer_params")
    d_params = d_leg["body"].get("kv_transfer_params")
    if connector in ("nixl", "nixl_push", "mooncake"):
        assert p_params["do_remote_decode"] is True
        assert d_params["do_remote_prefill"] is True
    if connector == "mooncake":
        assert p_params["transfer_id"] == d_params["transfer_id"]
    events = decode.events()
    assert len(events["kv_ok"]) == 1 and not events.get("computed_locally"), events
    assert events["kv_failed"] == []


def test_a_prefill_that_refuses_connections_is_retried_on_another(
    fleet_factory: FleetFactory,
) -> None:
    fleet = fleet_factory([WorkerSpec("P"), WorkerSpec("P"), WorkerSpec("D")], ROUND_ROBIN)
    dead, alive = fleet.role("P")
    dead.process.signal(signal.SIGKILL)  # no `leave`: still registered, its port refuses
    # Refuses once it is gone: until then the kernel still queues connections on its socket, and
    # the proxy's attempt is reset instead of refused (seen on a loaded machine).
    wait_until(lambda: not dead.process.alive(), 10, "the killed prefill to exit")
    for i in range(2):  # round robin: one of the two starts on the dead prefill
        answer = post_json(fleet.proxy_url + GENERATE, generate_body(10 + i))
        assert answer.status == 200, answer.body
    labels = {"role": "prefill", "reason": "connect"}
    assert metric_value(fleet.proxy_url, "pdproxy_retries_total", labels) >= 1
    assert len(legs(alive)) == 2
    assert len(fleet.role("D")[0].events()["kv_ok"]) == 2


def test_a_client_that_leaves_mid_stream_aborts_the_decode(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory([WorkerSpec("P"), WorkerSpec("D", token_latency_ms=100)])
    body = generate_body(5, stream=True, max_tokens=500)
    sock = open_raw_request(fleet.proxy_url + GENERATE, body)
    hang_up_mid_stream_aborts(fleet.role("D")[0], sock)
