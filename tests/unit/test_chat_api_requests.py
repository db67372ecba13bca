"""OpenAI Responses and Anthropic Messages bodies: what the proxy refuses, the prefill and decode
legs it writes, their prompt features, and each API's error shapes. Pure."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from pdproxy.proxy.api_bodies import MESSAGES_PATH, RESPONSES_PATH, error_shape
from pdproxy.proxy.error_shapes import ANTHROPIC_SHAPE, OPENAI_SHAPE, RESPONSES_SHAPE
from pdproxy.proxy.errors import ProxyError
from pdproxy.proxy.prompt import request_features
from pdproxy.proxy.request import parse_completion

TAG = "___prefill_addr_10.0.0.1:21001___decode_addr_10.0.0.2:22001_" + "ab" * 16


def parsed(path: str, payload: dict[str, Any]) -> Any:
    return parse_completion(path, orjson.dumps(payload))


def test_a_responses_prefill_leg_is_one_token_unstreamed_unstored_and_tagged() -> None:
    body = {"model": "m", "input": "hi", "max_output_tokens": 50, "stream": True}
    body["stream_options"] = {"include_obfuscation": False}
    request = parsed(RESPONSES_PATH, body)
    request.leg_id = TAG
    prefill = orjson.loads(request.prefill_body({"do_remote_decode": True}))
    assert prefill == {
        "model": "m",
        "input": "hi",
        "max_output_tokens": 1,
        "stream": False,
        "store": False,
        "request_id": f"resp_{TAG}",
        "kv_transfer_params": {"do_remote_decode": True},
    }
    decode = orjson.loads(request.decode_body({"do_remote_prefill": True}))
    assert decode == {
        **body,
        "request_id": f"resp_{TAG}",
        "kv_transfer_params": {"do_remote_prefill": True},
    }
    assert request.context_refusal(10) is None  # vLLM's own words for this API


def test_a_responses_leg_without_a_pair_keeps_the_clients_bytes() -> None:
    request = parsed(RESPONSES_PATH, {"model": "m", "input": "hi"})
    assert request.decode_body() == request.body


def test_a_messages_prefill_leg_is_one_token_unstreamed() -> None:
    body = {"model": "m", "max_tokens": 64, "stream": True, "messages": [], "thinking": None}
    request = parsed(MESSAGES_PATH, body)
    request.leg_id = TAG  # Messages reads the id from the header: the body stays as it is
    assert orjson.loads(request.prefill_body()) == {**body, "max_tokens": 1, "stream": False}
    assert request.decode_body() == request.body


def test_a_messages_prefill_leg_goes_without_a_thinking_budget() -> None:
    thinking = {"type": "enabled", "budget_tokens": 2048}
    body = {"model": "m", "max_tokens": 4096, "messages": [], "thinking": thinking}
    request = parsed(MESSAGES_PATH, body)
    prefill = orjson.loads(request.prefill_body())
    assert prefill == {"model": "m", "max_tokens": 1, "messages": [], "stream": False}
    assert request.decode_body() == request.body  # the decode still thinks within its budget
    # Disabling thinking may change the prompt (vLLM's reasoning_effort): it stays.
    off = {**body, "thinking": {"type": "disabled"}}
    assert orjson.loads(parsed(MESSAGES_PATH, off).prefill_body())["thinking"] == {
        "type": "disabled"
    }


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"request_id": "mine"}, "request_id"),
    ],
)
def test_responses_refusals(payload: dict[str, Any], param: str) -> None:
    with pytest.raises(ProxyError) as raised:
        parsed(RESPONSES_PATH, {"model": "m", "input": "x", **payload})
    assert raised.value.status == 400 and raised.value.param == param


def test_responses_accepts_what_it_can_serve() -> None:
    payload = {"model": "m", "input": "x", "previous_response_id": None, "background": False}
    assert parsed(RESPONSES_PATH, payload).responses


@pytest.mark.parametrize("max_tokens", [None, 0, -1, "5", True, 1.5])
def test_messages_needs_a_positive_max_tokens(max_tokens: object) -> None:
    payload: dict[str, Any] = {"model": "m", "messages": []}
    if max_tokens is not None:
        payload["max_tokens"] = max_tokens
    with pytest.raises(ProxyError) as raised:
        parsed(MESSAGES_PATH, payload)
    assert raised.value.param == "max_tokens"


def test_features_read_each_apis_prompt_and_limit() -> None:
    responses = {"model": "m", "instructions": "be brief", "input": "a" * 400}
    features = request_features(responses, "m", False, 16, responses=True)
    assert features.prompt_tokens == 104  # ("system", NUL, instructions, SOH, input) / 4
    assert features.decode_tokens == 104 + 256  # no limit given: chat's guess
    items = {**responses, "input": [{"role": "user", "content": [{"text": "a" * 400}]}]}
    limited = {**items, "max_output_tokens": 7}
    features = request_features(limited, "m", False, 16, responses=True)
    assert features.decode_tokens == features.prompt_tokens + 7 and features.prefix_windows
    other = request_features({**items, "instructions": "be long"}, "m", False, 16, responses=True)
    assert other.prefix_windows[0].key != features.prefix_windows[0].key

    messages = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "b" * 80}]}
    plain = request_features(messages, "m", True, 4)
    with_system = request_features({**messages, "system": "s" * 40}, "m", True, 4)
    assert with_system.prompt_tokens > plain.prompt_tokens
    assert with_system.decode_tokens == with_system.prompt_tokens + 9
    assert with_system.prefix_windows[0].key != plain.prefix_windows[0].key


def test_each_path_has_its_error_shape() -> None:
    error = ProxyError(503, "no compatible pair", code="no_instance", param=None)
    assert error_shape(MESSAGES_PATH) is ANTHROPIC_SHAPE
    assert error_shape(RESPONSES_PATH) is RESPONSES_SHAPE
    assert error_shape("/v1/chat/completions") is OPENAI_SHAPE

    assert orjson.loads(ANTHROPIC_SHAPE.body(error)) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "no compatible pair"},
    }
    assert ANTHROPIC_SHAPE.stream_tail(error) == (
        b"event: error\ndata: " + ANTHROPIC_SHAPE.body(error) + b"\n\n"
    )
    assert orjson.loads(RESPONSES_SHAPE.body(error))["error"]["code"] == "no_instance"
    kind, data = RESPONSES_SHAPE.stream_tail(error).split(b"\n", 1)
    assert kind == b"event: error"
    assert orjson.loads(data.removeprefix(b"data: ")) == {
        "type": "error",
        "code": "no_instance",
        "message": "no compatible pair",
        "param": None,
    }
    assert OPENAI_SHAPE.stream_tail(error).endswith(b"data: [DONE]\n\n")


def test_each_shape_knows_its_streams_last_event() -> None:
    assert ANTHROPIC_SHAPE.completes(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    assert not ANTHROPIC_SHAPE.completes(b"event: message_delta\ndata: {}\n\n")
    assert RESPONSES_SHAPE.completes(b"event: response.completed\ndata: {}\n\n")
    assert RESPONSES_SHAPE.completes(b"event: response.incomplete\ndata: {}\n\n")
    assert not RESPONSES_SHAPE.completes(b"event: response.output_text.delta\ndata: {}\n\n")
    assert OPENAI_SHAPE.completes(b"data: {}\n\ndata: [DONE]\n\n")
    assert not OPENAI_SHAPE.completes(b"event: message_stop\ndata: {}\n\n")
