"""vLLM's /inference/v1/generate in pdproxy.proxy.request and .prompt (pure): what is accepted,
what is refused in vLLM's error shape, how the prefill leg is rewritten, how the decode leg
carries kv_transfer_params, and the features pairing sees."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.proxy.errors import VllmBadRequest
from pdproxy.proxy.prompt import DEFAULT_CHAT_TOKENS, request_features
from pdproxy.proxy.request import GENERATE_PATH, CompletionRequest, parse_completion

PROFILE = settings(derandomize=True, database=None, deadline=None)


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 9}, **fields}


def parse(payload: dict[str, Any]) -> CompletionRequest:
    return parse_completion(GENERATE_PATH, json.dumps(payload).encode())


def refusal(payload: dict[str, Any]) -> dict[str, Any]:
    with pytest.raises(VllmBadRequest) as info:
        parse(payload)
    assert info.value.status == 400
    error: dict[str, Any] = orjson.loads(info.value.body())["error"]
    assert error["type"] == "Bad Request" and error["code"] == 400
    return error


def test_a_generate_request_is_parsed() -> None:
    request = parse(body(stream=True))
    assert request.generate and not request.chat and request.stream and request.model == "m"


def test_completions_are_not_generate() -> None:
    request = parse_completion("/v1/completions", b'{"model": "m", "prompt": "x"}')
    assert not request.generate


def test_the_prefill_leg_makes_one_token_and_does_not_stream() -> None:
    sampling = {"max_tokens": 50, "min_tokens": 20, "temperature": 0.5, "stop_token_ids": [2]}
    payload = body(
        sampling_params=sampling,
        stream=True,
        stream_options={"include_usage": True},
        request_id="client-id",
        cache_salt="salt",
    )
    request = parse(payload)
    leg = orjson.loads(request.prefill_body({"do_remote_decode": True}))
    assert leg == {
        **body(),
        "sampling_params": {**sampling, "max_tokens": 1, "min_tokens": 1},
        "stream": False,
        "request_id": "client-id",
        "cache_salt": "salt",
        "kv_transfer_params": {"do_remote_decode": True},
    }
    assert request.payload["sampling_params"] == sampling  # the client's object, untouched


def test_a_prefill_leg_caps_max_tokens_even_when_the_client_set_none() -> None:
    leg = orjson.loads(parse(body(sampling_params={})).prefill_body())
    assert leg["sampling_params"] == {"max_tokens": 1} and leg["stream"] is False
    assert "kv_transfer_params" not in leg
    assert "max_tokens" not in leg  # generate's limits live in sampling_params only


def test_the_decode_leg_is_the_clients_bytes_plus_the_kv_params() -> None:
    raw = json.dumps(body(stream=True)).encode()
    request = parse_completion(GENERATE_PATH, raw)
    assert request.decode_body() == raw
    assert orjson.loads(request.decode_body({"remote_engine_id": "e"})) == {
        **body(stream=True),
        "kv_transfer_params": {"remote_engine_id": "e"},
    }


def test_generate_leaves_context_limits_to_vllm() -> None:
    request = parse(body(sampling_params={"max_tokens": 10**6}))
    assert request.context_refusal(128) is None


@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        ({"token_ids": None}, "token_ids", "'token_ids' is required"),
        ({"token_ids": []}, "token_ids", "got an empty one"),
        ({"token_ids": {"a": 1}}, "token_ids", "got an object"),
        ({"token_ids": "1 2"}, "token_ids", "got a string"),
        ({"token_ids": [1, 2.5]}, "token_ids", "got 2.5"),
        ({"token_ids": [1, -1]}, "token_ids", "got -1"),
        ({"token_ids": [False]}, "token_ids", "got false"),
        ({"token_ids": [1, ["x" * 100]]}, "token_ids", "..."),
        ({"sampling_params": None}, "sampling_params", "'sampling_params' is required"),
        ({"sampling_params": 3}, "sampling_params", "got a number"),
        ({"sampling_params": []}, "sampling_params", "got an array"),
        (
            {"sampling_params": {"extra_args": {"kv_transfer_params": {}}}},
            "sampling_params.extra_args.kv_transfer_params",
            "set by pdproxy",
        ),
    ],
)
def test_bad_input_is_refused_in_vllms_shape(
    change: dict[str, Any], param: str, words: str
) -> None:
    payload = {k: v for k, v in body(**change).items() if v is not None}
    error = refusal(payload)
    assert error["param"] == f"body.{param}" and words in error["message"]
    assert len(error["message"]) < 200


@given(st.lists(st.integers(min_value=0, max_value=2**40), min_size=1, max_size=50))
@PROFILE
def test_any_list_of_token_ids_is_accepted_and_kept(ids: list[int]) -> None:
    request = parse(body(token_ids=ids))
    assert orjson.loads(request.prefill_body())["token_ids"] == ids


def test_features_come_from_the_token_ids_and_sampling_limit() -> None:
    ids = list(range(40))
    features = request_features(body(token_ids=ids), "m", False, 16, generate=True)
    assert features.prompt_tokens == 40 and features.decode_tokens == 40 + 9
    same_prefix = request_features(body(token_ids=[*ids[:16], 99]), "m", False, 16, generate=True)
    assert features.prefix_windows[0] == same_prefix.prefix_windows[0]
    other = request_features(body(token_ids=[1, *ids[1:]]), "m", False, 16, generate=True)
    assert features.prefix_windows[0].key != other.prefix_windows[0].key


def test_features_hash_token_ids_as_a_completions_token_prompt_does() -> None:
    ids = list(range(40))
    generate = request_features(body(token_ids=ids), "m", False, 16, generate=True)
    completion = request_features({"prompt": ids, "max_tokens": 9}, "m", False, 16)
    assert generate == completion


def test_features_without_a_limit_guess_as_for_chat() -> None:
    features = request_features(body(sampling_params={}), "m", False, 16, generate=True)
    assert features.decode_tokens == 3 + DEFAULT_CHAT_TOKENS
