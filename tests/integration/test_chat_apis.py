"""OpenAI's Responses API (`POST /v1/responses`) and Anthropic's Messages API
(`POST /v1/messages`) through a live `pdproxy serve` and fake workers, asked with the official
`openai` and `anthropic` clients: disaggregated like chat (the prefill leg capped at one token,
not streamed, not stored; the id tags; each connector's kv_transfer_params), retried, cancelled,
counted and logged; pdproxy's own errors in each API's shape, whole and mid-stream; the
`x-api-key` header Anthropic's clients send."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from pdproxy.demo.fleet import LocalFleet, Worker, WorkerSpec
from pdproxy.demo.processes import wait_until
from pdproxy.ids import parse_request_id
from tests.conftest import FleetFactory
from tests.integration.support import (
    metric_value,
    one_pair_fleet,
    open_raw_request,
    post_json,
    read_until,
    set_behaviour,
)

MODEL = "fake-model"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
ROUND_ROBIN = ["--prefill-policy", "round_robin", "--decode-policy", "round_robin"]
KEY = "chat-apis-key"


def legs(worker: Worker, path: str) -> list[dict[str, Any]]:
    return [r for r in worker.requests() if r["path"] == path]


def responses_body(topic: str = "ships", **fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "instructions": "answer briefly",
        "input": [{"role": "user", "content": f"tell me about {topic} " * 8}],
        "max_output_tokens": 6,
        "temperature": 0,
        **fields,
    }


def messages_body(topic: str = "ships", **fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "system": "answer briefly",
        "messages": [{"role": "user", "content": f"tell me about {topic} " * 8}],
        "max_tokens": 6,
        "temperature": 0,
        **fields,
    }


# What `anthropic`'s Messages.create names; vLLM's other fields go in `extra_body`.
_SDK_FIELDS = frozenset(("model", "messages", "max_tokens", "system", "stream"))


def sdk(body: dict[str, Any]) -> dict[str, Any]:
    """A Messages body as `anthropic`'s keyword arguments."""
    named = {k: v for k, v in body.items() if k in _SDK_FIELDS}
    return {**named, "extra_body": {k: v for k, v in body.items() if k not in _SDK_FIELDS}}


def text_of(message: anthropic.types.Message) -> str:
    """A Messages answer's one block's text."""
    [block] = message.content
    assert isinstance(block, anthropic.types.TextBlock), block
    return block.text


def events(body: bytes) -> list[tuple[str, dict[str, Any]]]:
    """An event stream's (event type, data), checking each event names its own type."""
    found = []
    for frame in body.decode().split("\n\n"):
        if not frame:
            continue
        kind, data = frame.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: "), frame
        found.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return found


def openai_client(fleet: LocalFleet, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.proxy_url + "/v1", api_key=key, max_retries=0)


def anthropic_client(fleet: LocalFleet, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=fleet.proxy_url, api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    with one_pair_fleet(tmp_path_factory.mktemp("chat-apis")) as fleet:
        yield fleet


def test_responses_runs_both_legs_and_relays_the_decodes_answer(fleet: LocalFleet) -> None:
    fleet.reset_records()
    [prefill], [decode] = fleet.role("P"), fleet.role("D")
    body = responses_body()
    response = openai_client(fleet).responses.create(**body)
    assert response.status == "completed" and len(response.output_text.split()) == 6

    [p_leg], [d_leg] = legs(prefill, RESPONSES), legs(decode, RESPONSES)
    request_id = p_leg["headers"]["x-request-id"]
    tagged = parse_request_id(request_id)
    assert tagged is not None
    assert str(tagged.prefill) == prefill.zmq_address and str(tagged.decode) == decode.zmq_address
    assert d_leg["headers"]["x-request-id"] == request_id
    # vLLM's Responses API takes its engine id from the body: both legs carry the tag there.
    leg_id = f"resp_{request_id}"
    assert response.id == leg_id
    assert p_leg["body"] == {
        **body,
        "request_id": leg_id,
        "max_output_tokens": 1,
        "stream": False,
        "store": False,
    }
    assert d_leg["body"] == {**body, "request_id": leg_id}
    assert decode.events()["kv_ok"] == [request_id]
    # The decode's own answer to the same request, asked directly, is what came back.
    direct = post_json(decode.url + RESPONSES, body).json()
    assert direct["output"][0]["content"][0]["text"] == response.output_text


def test_a_streamed_response_relays_the_decodes_events(fleet: LocalFleet) -> None:
    fleet.reset_records()
    [prefill], [decode] = fleet.role("P"), fleet.role("D")
    body = responses_body("trains")
    stream = openai_client(fleet).responses.create(**body, stream=True)
    kinds, text = [], ""
    for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") == 6
    whole = openai_client(fleet).responses.create(**body)
    assert text == whole.output_text
    p_leg = legs(prefill, RESPONSES)[0]
    assert p_leg["body"]["stream"] is False and p_leg["body"]["max_output_tokens"] == 1
    assert legs(decode, RESPONSES)[0]["body"]["stream"] is True
    assert len(decode.events()["kv_ok"]) == 2


def test_messages_runs_both_legs_and_relays_the_decodes_answer(fleet: LocalFleet) -> None:
    fleet.reset_records()
    [prefill], [decode] = fleet.role("P"), fleet.role("D")
    body = messages_body()
    message = anthropic_client(fleet).messages.create(**sdk(body))
    text = text_of(message)
    assert len(text.split()) == 6
    assert message.stop_reason == "max_tokens"

    [p_leg], [d_leg] = legs(prefill, MESSAGES), legs(decode, MESSAGES)
    request_id = p_leg["headers"]["x-request-id"]
    assert parse_request_id(request_id) is not None
    assert d_leg["headers"]["x-request-id"] == request_id
    assert message.id == f"chatcmpl-{request_id}"
    assert p_leg["body"] == {**body, "max_tokens": 1, "stream": False}
    assert d_leg["body"] == body  # the client's body, unchanged
    assert decode.events()["kv_ok"] == [request_id]
    direct = post_json(decode.url + MESSAGES, body).json()
    assert direct["content"][0]["text"] == text


def test_a_streamed_message_relays_the_decodes_events(fleet: LocalFleet) -> None:
    fleet.reset_records()
    [prefill], [decode] = fleet.role("P"), fleet.role("D")
    body = messages_body("trains")
    with anthropic_client(fleet).messages.stream(**sdk(body)) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    whole = anthropic_client(fleet).messages.create(**sdk(body))
    assert text == text_of(whole) == text_of(final)
    raw = post_json(fleet.proxy_url + MESSAGES, {**body, "stream": True})
    kinds = [kind for kind, _ in events(raw.body)]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_delta") == 6
    assert legs(prefill, MESSAGES)[0]["body"] == {**body, "max_tokens": 1, "stream": False}
    assert legs(decode, MESSAGES)[0]["body"] == {**body, "stream": True}


def test_different_prompts_give_different_answers(fleet: LocalFleet) -> None:
    client = openai_client(fleet)
    first = client.responses.create(**responses_body("ships")).output_text
    second = client.responses.create(**responses_body("clouds")).output_text
    assert first != second
    claude = anthropic_client(fleet)
    one = text_of(claude.messages.create(**sdk(messages_body("ships"))))
    other = text_of(claude.messages.create(**sdk(messages_body("clouds"))))
    assert one != other


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"previous_response_id": "resp_earlier"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"request_id": "mine"}, "request_id"),
        ({"kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params"),
        ({"stream": "yes"}, "stream"),
    ],
)
def test_responses_refusals_are_openai_shaped_and_send_no_leg(
    fleet: LocalFleet, change: dict[str, Any], param: str
) -> None:
    fleet.reset_records()
    answer = post_json(fleet.proxy_url + RESPONSES, responses_body(**change))
    assert answer.status == 400, answer.body
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"] and b"Traceback" not in answer.body
    assert fleet.completion_requests() == []
    if param == "previous_response_id":
        with pytest.raises(openai.BadRequestError, match="previous_response_id"):
            openai_client(fleet).responses.create(**responses_body(**change))


@pytest.mark.parametrize(
    "change",
    [
        {"max_tokens": None},
        {"max_tokens": 0},
        {"kv_transfer_params": {"do_remote_prefill": True}},
        {"vllm_xargs": {"kv_transfer_params": {"x": 1}}},
        {"stream": "yes"},
        {"model": ""},
    ],
)
def test_messages_refusals_are_anthropic_shaped_and_send_no_leg(
    fleet: LocalFleet, change: dict[str, Any]
) -> None:
    fleet.reset_records()
    body = {k: v for k, v in {**messages_body(), **change}.items() if v is not None}
    answer = post_json(fleet.proxy_url + MESSAGES, body)
    assert answer.status == 400, answer.body
    reply = answer.json()
    assert reply["type"] == "error" and set(reply) == {"type", "error"}
    assert reply["error"]["type"] == "invalid_request_error" and reply["error"]["message"]
    assert fleet.completion_requests() == []
    if "max_tokens" in body:  # the client itself refuses to send a body without it
        with pytest.raises(anthropic.BadRequestError) as raised:
            anthropic_client(fleet).messages.create(**sdk(body))
        assert raised.value.body == reply


def test_messages_without_an_instance_or_method_answer_in_anthropics_shape(
    fleet: LocalFleet,
) -> None:
    answer = post_json(fleet.proxy_url + MESSAGES, messages_body(model="no-such-model"))
    assert answer.status >= 400
    reply = answer.json()
    assert reply["type"] == "error" and reply["error"]["message"], reply
    with pytest.raises(anthropic.APIStatusError) as raised:
        anthropic_client(fleet).messages.create(**sdk(messages_body(model="no-such-model")))
    assert raised.value.status_code == answer.status
    # Responses stays OpenAI-shaped for the same failure.
    other = post_json(fleet.proxy_url + RESPONSES, responses_body(model="no-such-model"))
    assert other.status == answer.status and other.json()["error"]["message"]


def test_an_instances_own_refusal_is_relayed_verbatim(fleet: LocalFleet) -> None:
    """The decode refuses more output than its context holds: its own Anthropic-shaped body."""
    [decode] = fleet.role("D")
    body = messages_body(max_tokens=10**6)
    answer = post_json(fleet.proxy_url + MESSAGES, body)
    direct = post_json(decode.url + MESSAGES, body)
    assert answer.status == direct.status == 400
    assert answer.body == direct.body and answer.json()["type"] == "error"
    body = responses_body(max_output_tokens=10**6)
    answer = post_json(fleet.proxy_url + RESPONSES, body)
    direct = post_json(decode.url + RESPONSES, body)
    assert answer.status == direct.status == 400 and answer.body == direct.body


def test_both_apis_are_counted_and_logged(fleet: LocalFleet) -> None:
    for path, body in ((RESPONSES, responses_body("logs")), (MESSAGES, messages_body("logs"))):
        labels = {"endpoint": path, "status": "200"}
        before = metric_value(fleet.proxy_url, "pdproxy_requests_total", labels)
        mine = {"X-Request-Id": f"counted-and-logged{path.replace('/', '-')}"}
        answer = post_json(fleet.proxy_url + path, body, headers=mine)
        assert answer.status == 200 and answer.headers["x-request-id"] == mine["X-Request-Id"]
        assert metric_value(fleet.proxy_url, "pdproxy_requests_total", labels) == before + 1

        def logged(mine: dict[str, str] = mine) -> list[dict[str, Any]]:
            text = (fleet.log_dir / "pdproxy.log").read_text()
            lines = [json.loads(line) for line in text.splitlines() if line.strip()]
            return [x for x in lines if x.get("client_request_id") == mine["X-Request-Id"]]

        wait_until(lambda: len(logged()) >= 1, 10, f"the access line of {path}")
        [line] = logged()
        assert line["endpoint"] == path and line["status"] == 200 and line["outcome"] == "ok"
        assert line["prefill"] and line["decode"] and line["direct"] is False


def spec(role: str, connector: str) -> WorkerSpec:
    return WorkerSpec(role, extra_args=("--connector", connector))  # type: ignore[arg-type]


@pytest.mark.parametrize("connector", ["nixl", "nixl_push", "mooncake", "pdproxy"])
def test_each_connectors_kv_reaches_the_decode(fleet_factory: FleetFactory, connector: str) -> None:
    fleet = fleet_factory([spec("P", connector), spec("D", connector)])
    [prefill], [decode] = fleet.role("P"), fleet.role("D")
    for path, body in ((RESPONSES, responses_body()), (MESSAGES, messages_body())):
        for stream in (False, True):
            answer = post_json(fleet.proxy_url + path, {**body, "stream": stream})
            assert answer.status == 200, answer.body
            p_leg, d_leg = legs(prefill, path)[-1], legs(decode, path)[-1]
            assert p_leg["headers"]["x-request-id"] == d_leg["headers"]["x-request-id"]
            p_params = p_leg["body"].get("kv_transfer_params")
            d_params = d_leg["body"].get("kv_transfer_params")
            if connector in ("nixl", "nixl_push", "mooncake"):
                assert p_params["do_remote_decode"] is True
                assert d_params["do_remote_prefill"] is True
            if connector == "nixl":  # the prefill's answer, handed on
                assert d_params["remote_engine_id"]
    events_seen = decode.events()
    assert len(events_seen["kv_ok"]) == 4 and not events_seen.get("computed_locally")
    assert events_seen["kv_failed"] == []


def test_a_failing_prefill_is_retried_on_another(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory([WorkerSpec("P"), WorkerSpec("P"), WorkerSpec("D")], ROUND_ROBIN)
    failing, healthy = fleet.role("P")
    set_behaviour(failing.url, status=503)
    for i in range(2):  # round robin: one of the two starts on the failing prefill
        text = openai_client(fleet).responses.create(**responses_body(f"retry {i}")).output_text
        assert len(text.split()) == 6
        message = anthropic_client(fleet).messages.create(**sdk(messages_body(f"retry {i}")))
        assert message.stop_reason == "max_tokens"
    labels = {"role": "prefill", "reason": "status_5xx"}
    assert metric_value(fleet.proxy_url, "pdproxy_retries_total", labels) >= 2
    assert len(legs(healthy, RESPONSES)) == 2 and len(legs(healthy, MESSAGES)) == 2
    assert len(fleet.role("D")[0].events()["kv_ok"]) == 4


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (RESPONSES, responses_body(max_output_tokens=400, stream=True)),
        (MESSAGES, messages_body(max_tokens=400, stream=True)),
    ],
)
def test_a_client_that_leaves_mid_stream_cancels_the_decode(
    fleet_factory: FleetFactory, path: str, body: dict[str, Any]
) -> None:
    fleet = fleet_factory([WorkerSpec("P"), WorkerSpec("D", token_latency_ms=50)])
    [decode] = fleet.role("D")
    sock = open_raw_request(fleet.proxy_url + path, body)
    read_until(sock, b"delta", timeout=10)  # deltas are flowing
    sock.close()
    wait_until(lambda: len(decode.events()["aborted"]) == 1, 10, "the decode leg aborted")
    assert decode.events()["completed"] == []


def test_a_stream_cut_by_the_decode_ends_with_the_apis_error_event(
    fleet_factory: FleetFactory,
) -> None:
    fleet = fleet_factory([WorkerSpec("P"), WorkerSpec("D")])
    set_behaviour(fleet.role("D")[0].url, drop_after_chunks=3)
    answer = post_json(fleet.proxy_url + MESSAGES, messages_body(stream=True))
    assert answer.status == 200
    found = events(answer.body)
    assert [k for k, _ in found[:3]] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
    ]
    kind, error = found[-1]
    assert kind == "error" and error["type"] == "error"
    assert error["error"]["type"] == "api_error" and error["error"]["message"]
    assert b"[DONE]" not in answer.body
    client = anthropic_client(fleet)
    with (
        pytest.raises(anthropic.APIStatusError, match="decode"),
        client.messages.stream(**sdk(messages_body())) as stream,
    ):
        for _ in stream.text_stream:
            pass

    answer = post_json(fleet.proxy_url + RESPONSES, responses_body(stream=True))
    found = events(answer.body)
    assert found[0][0] == "response.created"
    kind, error = found[-1]
    assert kind == "error" and error["type"] == "error" and error["message"]
    assert b"[DONE]" not in answer.body
    kinds = [e.type for e in openai_client(fleet).responses.create(**responses_body(), stream=True)]
    assert kinds[-1] == "error" and "response.completed" not in kinds


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[LocalFleet]:
    fleet = LocalFleet(
        tmp_path / "keyed", [WorkerSpec("P"), WorkerSpec("D")], ["--api-key", KEY], api_key=KEY
    )
    fleet.start()
    try:
        yield fleet
    finally:
        fleet.stop()


def test_anthropic_clients_key_header_is_accepted(keyed: LocalFleet) -> None:
    message = anthropic_client(keyed, KEY).messages.create(**sdk(messages_body()))  # x-api-key
    assert message.stop_reason == "max_tokens"
    bearer = post_json(
        keyed.proxy_url + MESSAGES, messages_body(), {"Authorization": f"Bearer {KEY}"}
    )
    assert bearer.status == 200
    assert openai_client(keyed, KEY).responses.create(**responses_body()).status == "completed"
    with pytest.raises(anthropic.AuthenticationError) as raised:
        anthropic_client(keyed, "wrong").messages.create(**sdk(messages_body()))
    assert raised.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": raised.value.body["error"]["message"]},  # type: ignore[index]
    }
    with pytest.raises(openai.AuthenticationError):
        openai_client(keyed, "wrong").responses.create(**responses_body())
    # The key is pdproxy's: never passed on to the instances.
    for worker in keyed.workers:
        for leg in worker.requests():
            assert "x-api-key" not in leg["headers"] and "authorization" not in leg["headers"]


def test_short_prompts_go_to_the_decode_alone_unchanged(fleet_factory: FleetFactory) -> None:
    """Below --disagg-min-tokens there is no pair (for a connector whose decode can compute a
    prompt itself): no tag, no request_id written in."""
    workers = [spec("P", "nixl"), spec("D", "nixl")]
    fleet = fleet_factory(workers, ["--disagg-min-tokens", "1000"])
    [prefill], [decode] = fleet.role("P"), fleet.role("D")
    response = openai_client(fleet).responses.create(**responses_body())
    assert response.status == "completed"
    message = anthropic_client(fleet).messages.create(**sdk(messages_body()))
    assert message.stop_reason == "max_tokens"
    assert legs(prefill, RESPONSES) == legs(prefill, MESSAGES) == []
    [r_leg], [m_leg] = legs(decode, RESPONSES), legs(decode, MESSAGES)
    assert r_leg["body"] == responses_body() and m_leg["body"] == messages_body()
    assert parse_request_id(r_leg["headers"]["x-request-id"]) is None
    assert response.id == f"resp_{r_leg['headers']['x-request-id']}"


def test_several_http_workers_serve_both_apis(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory([WorkerSpec("P"), WorkerSpec("D")], ["--workers", "2"])
    for i in range(3):  # each a new connection: either worker may answer
        text = openai_client(fleet).responses.create(**responses_body(f"w{i}")).output_text
        assert len(text.split()) == 6
        message = anthropic_client(fleet).messages.create(**sdk(messages_body(f"w{i}")))
        assert len(text_of(message).split()) == 6
    assert len(fleet.role("D")[0].events()["kv_ok"]) == 6
    refused = post_json(fleet.proxy_url + MESSAGES, messages_body(max_tokens=None))
    assert refused.status == 400 and refused.json()["type"] == "error"
