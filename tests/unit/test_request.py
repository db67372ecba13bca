"""pdproxy.proxy.request: parsing a client's completion request and deriving the prefill leg."""

from __future__ import annotations

import copy
import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.proxy.errors import ProxyError
from pdproxy.proxy.request import (
    BYTES_PER_VALUE,
    MAX_DEPTH,
    CompletionRequest,
    max_values,
    parse_completion,
)

# Deterministic and load-tolerant: same examples every run, no deadline, no example database.
PROFILE = settings(derandomize=True, database=None, deadline=None)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

# Keys prefill_body() may change; everything else must come through untouched.
CHANGED = {
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "stream_options",
    "min_tokens",
    "min_completion_tokens",
}


def parse(payload: object, path: str = CHAT) -> CompletionRequest:
    return parse_completion(path, json.dumps(payload).encode())


def prefill(payload: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = orjson.loads(parse(payload).prefill_body())
    return out


def error(body: bytes) -> ProxyError:
    with pytest.raises(ProxyError) as info:
        parse_completion(CHAT, body)
    assert info.value.status == 400
    return info.value


# ---------------------------------------------------------------------------------------------
# parse_completion: accepted


def test_parse_keeps_the_original_bytes() -> None:
    body = b'{ "model" : "m",\n "messages": [{"role": "user", "content": "hi \\u00e9"}] }'
    request = parse_completion(CHAT, body)
    assert request.body is body
    assert request.path == CHAT
    assert request.model == "m"
    assert request.stream is False
    assert request.payload == {"model": "m", "messages": [{"role": "user", "content": "hi é"}]}


@pytest.mark.parametrize(("stream", "expected"), [(True, True), (False, False), (None, False)])
def test_stream_values(stream: bool | None, expected: bool) -> None:
    assert parse({"model": "m", "stream": stream}).stream is expected


def test_stream_absent_is_false() -> None:
    assert parse({"model": "m"}, COMPLETIONS).stream is False


def test_unicode_model() -> None:
    assert parse({"model": "Qwen/Qwen2.5-0.5B-Instruct@é"}).model == "Qwen/Qwen2.5-0.5B-Instruct@é"


# ---------------------------------------------------------------------------------------------
# parse_completion: refused


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b"not json",
        b'{"model": "m",}',
        b"{'model': 'm'}",
        b"\xff\xfe",
        b'{"a":1} x',
        b"NaN",
        b'{"model": "m", "n": 1e400}',
    ],
)
def test_invalid_json(body: bytes) -> None:
    exc = error(body)
    assert exc.code == "invalid_json"
    assert exc.message.startswith("request body is not valid JSON: ")
    assert json.loads(exc.body())["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        (b"[]", "an array"),
        (b'[{"model": "m"}]', "an array"),
        (b'"model"', "a string"),
        (b"42", "a number"),
        (b"4.5", "a number"),
        (b"null", "null"),
        (b"true", "a boolean"),
    ],
)
def test_non_object_bodies(body: bytes, kind: str) -> None:
    exc = error(body)
    assert exc.message == f"request body must be a JSON object, got {kind}"
    assert exc.code == "invalid_request"


@pytest.mark.parametrize(
    "payload",
    [
        {},
        {"model": ""},
        {"model": None},
        {"model": 1},
        {"model": ["m"]},
        {"model": {"id": "m"}},
        {"model": True},
        {"messages": []},
    ],
)
def test_missing_empty_or_non_string_model(payload: dict[str, Any]) -> None:
    exc = error(json.dumps(payload).encode())
    assert exc.message == "'model' is required and must be a non-empty string"
    assert exc.param == "model"
    assert exc.code == "missing_model"
    assert json.loads(exc.body()) == {
        "error": {
            "message": "'model' is required and must be a non-empty string",
            "type": "invalid_request_error",
            "param": "model",
            "code": "missing_model",
        }
    }


@pytest.mark.parametrize("stream", ["true", "false", 1, 0, [], {}, "yes"])
def test_non_boolean_stream(stream: object) -> None:
    exc = error(json.dumps({"model": "m", "stream": stream}).encode())
    assert exc.message == "'stream' must be a boolean"
    assert exc.param == "stream"
    assert exc.code == "invalid_type"


# ---------------------------------------------------------------------------------------------
# prefill_body


def test_prefill_body_chat() -> None:
    payload = {
        "model": "m",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "max_tokens": 256,
        "temperature": 0.7,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert prefill(payload) == {
        "model": "m",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "temperature": 0.7,
        "stream": False,
    }


def test_prefill_body_sets_max_tokens_when_absent() -> None:
    assert prefill({"model": "m", "prompt": "x"}) == {
        "model": "m",
        "prompt": "x",
        "max_tokens": 1,
        "stream": False,
    }


@pytest.mark.parametrize("value", [512, None, 0, 1])
def test_prefill_body_max_completion_tokens_only_if_present(value: int | None) -> None:
    out = prefill({"model": "m", "max_completion_tokens": value})
    assert out["max_completion_tokens"] == 1
    assert out["max_tokens"] == 1
    assert "max_completion_tokens" not in prefill({"model": "m"})


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (5, 1),
        (2, 1),
        (1.5, 1),
        (1_000_000, 1),
        (1, 1),
        (0, 0),
        (0.5, 0.5),
        (-3, -3),
        ("5", "5"),
        (True, True),
        (None, None),
        ([5], [5]),
    ],
)
@pytest.mark.parametrize("key", ["min_tokens", "min_completion_tokens"])
def test_prefill_body_caps_minimums_at_one(key: str, value: object, expected: object) -> None:
    out = prefill({"model": "m", key: value})
    assert out[key] == expected
    assert type(out[key]) is type(expected)


def test_prefill_body_does_not_add_minimums() -> None:
    out = prefill({"model": "m"})
    assert "min_tokens" not in out and "min_completion_tokens" not in out


def test_prefill_body_removes_stream_options_even_when_not_streaming() -> None:
    out = prefill({"model": "m", "stream": False, "stream_options": None})
    assert "stream_options" not in out
    assert out["stream"] is False


EVERYTHING: dict[str, Any] = {
    "model": "m",
    "prompt": [[1, 2, 3], [4, 5]],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": 'ünïcødé \u2028 "q" \\'}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "t", "type": "function"}]},
    ],
    "temperature": 0.1,
    "top_p": 1e-7,
    "top_k": -1,
    "seed": 2**63 - 1,
    "n": 2,
    "logprobs": True,
    "echo": False,
    "stop": ["\n\n", "</s>"],
    "logit_bias": {"50256": -100},
    "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "user": "",
    "extra_unknown_field": {"nested": [1, 2.5, None, "x", {"deep": [[]]}]},
    "max_tokens": 99,
    "max_completion_tokens": 99,
    "min_tokens": 7,
    "min_completion_tokens": 0,
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
}


def test_clients_may_not_send_kv_transfer_params() -> None:
    # It tells a decode instance where to read KV from: only the proxy sets it.
    body = orjson.dumps({**EVERYTHING, "kv_transfer_params": {"do_remote_prefill": True}})
    with pytest.raises(ProxyError) as caught:
        parse_completion(CHAT, body)
    assert caught.value.status == 400
    assert caught.value.param == "kv_transfer_params"


def test_nixl_legs_carry_kv_transfer_params() -> None:
    request = parse_completion(CHAT, orjson.dumps(EVERYTHING))
    asked = {"do_remote_decode": True, "remote_host": None}
    assert orjson.loads(request.prefill_body(asked))["kv_transfer_params"] == asked
    answered = {"do_remote_prefill": True, "remote_port": 5, "remote_block_ids": [1, 2]}
    decode = orjson.loads(request.decode_body(answered))
    assert decode == {**EVERYTHING, "kv_transfer_params": answered}
    assert request.decode_body() is request.body  # other pairs: the client's bytes


def test_prefill_body_keeps_every_other_field_exactly() -> None:
    request = parse_completion(CHAT, orjson.dumps(EVERYTHING))
    original = copy.deepcopy(request.payload)
    body = request.prefill_body()
    out = orjson.loads(body)
    assert {k: v for k, v in out.items() if k not in CHANGED} == {
        k: v for k, v in EVERYTHING.items() if k not in CHANGED
    }
    for key in EVERYTHING.keys() - CHANGED:
        assert orjson.dumps(out[key]) == orjson.dumps(EVERYTHING[key]), key
    assert out["max_tokens"] == 1
    assert out["max_completion_tokens"] == 1
    assert out["min_tokens"] == 1
    assert out["min_completion_tokens"] == 0
    assert out["stream"] is False
    assert "stream_options" not in out
    # The parsed request is untouched: the decode leg still sends the client's request.
    assert request.payload == original
    assert request.body == orjson.dumps(EVERYTHING)
    assert request.stream is True
    assert request.prefill_body() == body


json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=10),
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=12,
)


@settings(PROFILE, max_examples=300)
@given(
    extra=st.dictionaries(st.text(max_size=12), json_values, max_size=6),
    model=st.text(min_size=1, max_size=20),
)
def test_prefill_body_property(extra: dict[str, Any], model: str) -> None:
    payload = {**extra, "model": model}
    stream = payload.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        payload["stream"] = True
    body = orjson.dumps(payload)
    request = parse_completion(COMPLETIONS, body)
    snapshot = copy.deepcopy(request.payload)
    out = orjson.loads(request.prefill_body())
    assert request.payload == snapshot
    assert request.body is body
    assert out["max_tokens"] == 1
    assert out["stream"] is False
    assert "stream_options" not in out
    if "max_completion_tokens" in payload:
        assert out["max_completion_tokens"] == 1
    else:
        assert "max_completion_tokens" not in out
    for key in ("min_tokens", "min_completion_tokens"):
        if key not in payload:
            assert key not in out
            continue
        value = payload[key]
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        assert out[key] == (1 if numeric and value > 1 else value)
    for key in payload.keys() - CHANGED:
        assert orjson.dumps(out[key]) == orjson.dumps(request.payload[key]), key
    assert out.keys() - CHANGED == payload.keys() - CHANGED


# ---------------------------------------------------------------------------------------------
# bodies pdproxy cannot carry: too deep to write back, too many values to hold


def nested(depth: int, inner: object = 0) -> object:
    """`inner` inside depth - 1 arrays, as the value of a request's field: the request's
    object is the depth-th level."""
    value = inner
    for _ in range(depth - 1):
        value = [value]
    return value


def test_orjson_writes_exactly_max_depth_levels() -> None:
    # The bound parse_completion enforces is orjson's own: a new orjson that moved it fails here.
    orjson.dumps(nested(MAX_DEPTH + 1))  # MAX_DEPTH arrays
    with pytest.raises(orjson.JSONEncodeError):
        orjson.dumps(nested(MAX_DEPTH + 2))


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_nesting_to_the_limit_is_accepted_and_forwarded(path: str) -> None:
    body = orjson.dumps({"model": "m", "extra": nested(MAX_DEPTH)})
    request = parse_completion(path, body)
    assert orjson.loads(request.prefill_body())["extra"] == nested(MAX_DEPTH)
    assert orjson.loads(request.decode_body({"a": 1}))["extra"] == nested(MAX_DEPTH)


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 500, 1024])
def test_nesting_deeper_than_pdproxy_can_write_is_400(depth: int) -> None:
    body = b'{"model": "m", "extra": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"
    exc = error(body)
    assert exc.code == "too_deep"
    assert exc.message == (
        f"request body nests JSON deeper than {MAX_DEPTH} levels, which pdproxy cannot forward"
    )
    assert json.loads(exc.body())["error"]["type"] == "invalid_request_error"


def test_nesting_deeper_than_orjson_reads_is_invalid_json() -> None:
    exc = error(b'{"model": "m", "extra": ' + b"[" * 1100 + b"]" * 1100 + b"}")
    assert exc.code == "invalid_json"


def test_many_brackets_in_strings_are_not_nesting() -> None:
    body = orjson.dumps({"model": "m", "prompt": "[{" * 5000, "n": [[[1]]]})
    assert parse_completion(COMPLETIONS, body).payload["prompt"] == "[{" * 5000


def test_max_values_is_one_per_sixteen_bytes_of_the_body_limit() -> None:
    assert max_values(32 * 1024 * 1024) == 2 * 1024 * 1024
    assert max_values(1024) == 64
    assert BYTES_PER_VALUE == 16


def test_values_are_counted_from_the_body_before_parsing() -> None:
    ids = list(range(200))
    body = orjson.dumps({"model": "m", "prompt": ids, "max_tokens": 5, "stream": False})
    # 209 values: the object, 4 keys, 4 values, 200 ids; one '{', one '[', 4 ':', 3 + 199 ','.
    assert sum(body.count(mark) for mark in (b"{", b"[", b":", b",")) == 208
    assert parse_completion(COMPLETIONS, body, value_limit=209).payload["prompt"] == ids
    with pytest.raises(ProxyError) as caught:
        parse_completion(COMPLETIONS, body, value_limit=208)
    assert caught.value.status == 413
    assert caught.value.code == "too_many_values"
    assert caught.value.message.startswith("request body holds more than 208 JSON values")
    # Not parsed: invalid JSON past the limit is still a 413.
    with pytest.raises(ProxyError) as caught:
        parse_completion(COMPLETIONS, b"[" * 300, value_limit=205)
    assert caught.value.status == 413


def test_a_body_no_longer_than_the_value_limit_is_not_counted() -> None:
    body = orjson.dumps({"model": "m", "prompt": ",,,,,,,,,,"})  # 12 marks, 33 bytes
    assert parse_completion(COMPLETIONS, body, value_limit=len(body)).model == "m"


# ---------------------------------------------------------------------------------------------
# vllm_xargs.kv_transfer_params: vLLM copies vllm_xargs where connectors read kv_transfer_params


@pytest.mark.parametrize("value", [{"do_remote_prefill": True}, "x", 1, None, []])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_clients_may_not_send_kv_transfer_params_in_vllm_xargs(path: str, value: object) -> None:
    body = orjson.dumps({"model": "m", "vllm_xargs": {"a": 1, "kv_transfer_params": value}})
    with pytest.raises(ProxyError) as caught:
        parse_completion(path, body)
    assert caught.value.status == 400
    assert caught.value.param == "vllm_xargs.kv_transfer_params"
    assert caught.value.message == (
        "'vllm_xargs.kv_transfer_params' is set by pdproxy, not by clients"
    )


@pytest.mark.parametrize("xargs", [{"my_extension": "on", "n": [1, 2]}, "not a map", None, [1]])
def test_other_vllm_xargs_pass(xargs: object) -> None:
    body = orjson.dumps({"model": "m", "vllm_xargs": xargs})
    assert parse_completion(CHAT, body).payload["vllm_xargs"] == xargs


def test_an_escaped_key_is_the_same_key() -> None:
    body = b'{"model": "m", "vllm_xargs": {"kv_transfer\\u005fparams": 1}}'
    with pytest.raises(ProxyError):
        parse_completion(CHAT, body)
    with pytest.raises(ProxyError):
        parse_completion(CHAT, b'{"model": "m", "kv\\u005ftransfer_params": {}}')


# ---------------------------------------------------------------------------------------------
# decode_body with kv_transfer_params: the client's bytes and one more field


@pytest.mark.parametrize(
    "body",
    [
        b'{"model":"m","prompt":"hi"}',
        b' { "model" : "m", "n": 1.50, "big": 18446744073709551615 }\r\n\t ',
        b'{"model": "m", "messages": [{"role": "user", "content": "}"}]}\n',
    ],
)
def test_decode_body_adds_the_field_to_the_clients_bytes(body: bytes) -> None:
    request = parse_completion(CHAT, body)
    params = {"remote_host": "10.0.0.5", "remote_block_ids": [1, 2]}
    out = request.decode_body(params)
    assert out.startswith(body.rstrip()[:-1])  # nothing of the client's request rewritten
    assert orjson.loads(out) == {**request.payload, "kv_transfer_params": params}
    assert json.loads(out) == {**json.loads(body), "kv_transfer_params": params}


# ---------------------------------------------------------------------------------------------
# context_refusal: what vLLM 0.32 answers a request for more output tokens than the context


def refusal(payload: dict[str, Any], path: str, max_model_len: int = 512) -> Any:
    body = parse_completion(path, orjson.dumps({"model": "m", **payload})).context_refusal(
        max_model_len
    )
    return None if body is None else orjson.loads(body)


def test_context_refusal_is_vllms_own_answer() -> None:
    assert refusal({"prompt": "hi", "max_tokens": 513}, COMPLETIONS) == {
        "error": {
            "message": "max_tokens=513 cannot be greater than max_model_len=512. Please request "
            "fewer output tokens. (parameter=max_tokens, value=513)",
            "type": "BadRequestError",
            "param": "max_tokens",
            "code": 400,
        }
    }


@pytest.mark.parametrize(
    ("path", "payload", "param"),
    [
        (COMPLETIONS, {"max_tokens": 513}, "max_tokens"),
        (COMPLETIONS, {"max_tokens": 512}, None),  # vLLM 0.32 cuts the output to fit
        (COMPLETIONS, {"max_tokens": 2**64 - 1}, "max_tokens"),
        (COMPLETIONS, {}, None),  # the default, 16
        (COMPLETIONS, {"max_tokens": None}, None),
        (COMPLETIONS, {"max_completion_tokens": 9999}, None),  # not a completions field
        (CHAT, {"max_tokens": 513}, "max_tokens"),
        (CHAT, {"max_completion_tokens": 513, "max_tokens": 1}, "max_completion_tokens"),
        (CHAT, {"max_completion_tokens": 1, "max_tokens": 9999}, None),  # it wins
        (CHAT, {"max_completion_tokens": None, "max_tokens": 513}, "max_tokens"),
        (CHAT, {}, None),  # chat has no default: until the context is full
        # Only JSON integers are judged here; vLLM judges the rest itself.
        (CHAT, {"max_tokens": True}, None),
        (CHAT, {"max_tokens": 600.0}, None),
        (CHAT, {"max_tokens": "600"}, None),
        (CHAT, {"max_tokens": -1}, None),
    ],
)
def test_context_refusal_cases(path: str, payload: dict[str, Any], param: str | None) -> None:
    answer = refusal(payload, path)
    assert (None if answer is None else answer["error"]["param"]) == param


def test_completions_default_counts_against_a_tiny_context() -> None:
    answer = refusal({"prompt": "x"}, COMPLETIONS, max_model_len=8)
    assert (
        answer is not None
        and "max_tokens=16 cannot be greater than max_model_len=8" in (answer["error"]["message"])
    )
