"""The fake worker's context checks, which follow vLLM 0.32 (renderers/params.py and
get_max_tokens): more output tokens than the context is refused, a prompt beyond it too, and
otherwise the output is cut to what the context leaves."""

from __future__ import annotations

from typing import Any

import pytest

from pdproxy.fake_vllm.generation import parse_generation
from pdproxy.fake_vllm.http_json import ApiError


def refusal(body: dict[str, Any], chat: bool, max_model_len: int = 100) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_generation(body, chat, max_model_len)
    assert info.value.status == 400
    return info.value


def test_more_output_tokens_than_the_context_is_refused_in_vllm_0_32_words() -> None:
    error = refusal({"prompt": "a b", "max_tokens": 101}, chat=False)
    assert error.message == (
        "max_tokens=101 cannot be greater than max_model_len=100. Please request fewer output "
        "tokens. (parameter=max_tokens, value=101)"
    )
    assert error.param == "max_tokens"
    messages = [{"role": "user", "content": "hi"}]
    error = refusal({"messages": messages, "max_completion_tokens": 101, "max_tokens": 5}, True)
    assert error.param == "max_completion_tokens"
    assert error.message.startswith("max_completion_tokens=101 cannot be greater than")
    # Chat without a limit is never refused for it; completions default to 16.
    assert parse_generation({"messages": messages}, True, 10).max_tokens <= 10
    assert refusal({"prompt": "a"}, chat=False, max_model_len=10).param == "max_tokens"
    assert parse_generation({"prompt": "a", "max_tokens": None}, False, 10).max_tokens <= 10


def test_a_prompt_leaving_less_room_shortens_the_output() -> None:
    # 90 prompt tokens + 100 asked > 100: vLLM 0.32 generates the 10 that fit.
    generation = parse_generation({"prompt": "w " * 90, "max_tokens": 100}, False, 100)
    assert generation.max_tokens == 10
    assert parse_generation({"prompt": "w", "max_tokens": 100}, False, 100).max_tokens == 99


def test_a_prompt_beyond_the_context_is_refused() -> None:
    error = refusal({"prompt": "w " * 101, "max_tokens": 1}, chat=False)
    assert error.param == "input_tokens"
    assert error.message.startswith(
        "This model's maximum context length is 100 tokens. However, your prompt contains 101 "
        "input tokens"
    )
    assert refusal({"prompt": "w " * 100, "max_tokens": 1}, chat=False).param == "max_tokens"
