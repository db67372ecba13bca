"""Which answers migrate, and the continuation request built from token ids."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdproxy.proxy.migration_plan import (
    CONTINUATION_PATH,
    continuation,
    migration_refusal,
    replays,
    upstream_for_migration,
)
from pdproxy.proxy.request import CompletionRequest, parse_completion


def request(path: str = "/v1/completions", **fields: Any) -> CompletionRequest:
    body: dict[str, Any] = {"model": "m", "stream": True}
    if path.endswith(("/chat/completions", "/messages")):
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hello"
    return parse_completion(path, json.dumps(body | fields).encode())


CHAT = "/v1/chat/completions"
LONG = 256  # the default of migration_whole_min_tokens


@pytest.mark.parametrize(
    ("path", "fields", "reason"),
    [
        ("/v1/completions", {}, None),
        (CHAT, {}, None),
        (CHAT, {"tools": [{"type": "function"}], "tool_choice": "none"}, None),
        ("/v1/completions", {"prompt": [1, 2, 3]}, None),
        ("/v1/completions", {"stream": False}, "a short whole answer"),  # 16 by default
        ("/v1/completions", {"stream": False, "max_tokens": LONG}, None),
        ("/v1/completions", {"stream": False, "max_tokens": LONG - 1}, "a short whole answer"),
        (CHAT, {"stream": False}, None),  # no limit: until the context is full
        (CHAT, {"stream": False, "max_completion_tokens": 8}, "a short whole answer"),
        (
            CHAT,
            {"stream": False, "stream_options": {"include_usage": True}},
            "stream options without a stream",
        ),
        (CHAT, {"stream": False, "n": 2}, "n > 1"),
        (CHAT, {"stream": False, "prompt_logprobs": 1}, "prompt logprobs"),
        ("/v1/completions", {"n": 2}, "n > 1"),
        ("/v1/completions", {"best_of": 3}, "best_of > 1"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "several prompts"),
        ("/v1/completions", {"prompt": [[1], [2]]}, "several prompts"),
        ("/v1/completions", {"echo": True}, "echo"),
        ("/v1/completions", {"response_format": {"type": "json_object"}}, "structured output"),
        (CHAT, {"tools": [{"type": "function"}]}, "tools"),
        (CHAT, {"logprobs": True}, "chat logprobs"),
        ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {}}, "generate"),
        ("/v1/messages", {"max_tokens": 8}, "responses or messages API"),
        ("/v1/responses", {"input": "hi"}, "responses or messages API"),
    ],
)
def test_which_requests_migrate(path: str, fields: dict[str, Any], reason: str | None) -> None:
    assert migration_refusal(request(path, **fields), LONG) == reason


def test_every_whole_answer_migrates_when_the_minimum_is_zero() -> None:
    assert migration_refusal(request(stream=False, max_tokens=1), 0) is None
    assert migration_refusal(request(CHAT, stream=False, max_tokens=1), 0) is None


def test_token_ids_are_asked_for_only_when_the_client_did_not() -> None:
    plain = request()
    asked = upstream_for_migration(plain)
    assert json.loads(asked.body)["return_token_ids"] is True
    assert asked.payload["prompt"] == "hello" and asked.stream and asked.path == plain.path
    already = request(return_token_ids=True)
    assert upstream_for_migration(already) is already


def test_a_whole_answer_is_asked_for_as_a_stream_with_its_usage() -> None:
    whole = request(CHAT, stream=False, return_token_ids=True)
    asked = upstream_for_migration(whole)
    body = json.loads(asked.body)
    assert body["stream"] is True and asked.stream and not whole.stream
    assert body["stream_options"] == {"include_usage": True}
    assert body["return_token_ids"] is True and body["messages"] == whole.payload["messages"]


def test_a_completions_continuation_owes_what_is_left_from_token_ids() -> None:
    original = request(max_tokens=10, min_tokens=6, logprobs=2, echo=False, prompt_logprobs=1)
    following = continuation(original, [7, 8], [1, 2, 3, 4])
    assert following is not None and following.path == CONTINUATION_PATH
    body = json.loads(following.body)
    assert body["prompt"] == [7, 8, 1, 2, 3, 4]
    assert body["max_tokens"] == 6 and body["min_tokens"] == 2
    assert body["logprobs"] == 2 and body["return_token_ids"] is True and body["stream"]
    assert "echo" not in body and "prompt_logprobs" not in body


def test_the_completions_default_limit_counts_and_a_spent_limit_owes_nothing() -> None:
    following = continuation(request(), [5], [1] * 10)
    assert following is not None and following.payload["max_tokens"] == 6
    assert continuation(request(max_tokens=4), [5], [1, 2, 3, 4]) is None


def test_a_chat_continuation_is_a_completions_request_without_chat_fields() -> None:
    original = request(
        CHAT, max_completion_tokens=9, tool_choice="none", tools=[{"type": "function"}]
    )
    following = continuation(original, [1, 2], [3])
    assert following is not None and following.path == CONTINUATION_PATH
    body = json.loads(following.body)
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 8
    for field in ("messages", "max_completion_tokens", "tools", "tool_choice"):
        assert field not in body
    # Without a limit a chat answer runs until the context is full: so does its continuation.
    unlimited = continuation(request(CHAT), [1], [2])
    assert unlimited is not None and "max_tokens" not in unlimited.payload


def test_stop_strings_replay_from_the_prompt_with_the_original_limits() -> None:
    original = request(stop=["ab"], max_tokens=10)
    assert replays(original)
    following = continuation(original, [7, 8], [1, 2, 3])
    assert following is not None
    assert following.payload["prompt"] == [7, 8] and following.payload["max_tokens"] == 10
    # With the stop string in the output vLLM holds nothing back: a plain continuation.
    assert not replays(request(stop=["ab"], include_stop_str_in_output=True))
