"""Real vLLM answers through the proxy, seen with the official openai client."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest

from tests.harness.vllm_cpu import MAX_MODEL_LEN, MODEL_NAME
from tests.vllm.conftest import RealStack

pytestmark = pytest.mark.vllm

PROMPT = "The quick brown fox jumps over the lazy dog and then"
MESSAGES: list[Any] = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Name three colours of the rainbow."},
]
TOKENS = 24
GREEDY: dict[str, Any] = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def test_completion_streamed_text_equals_non_streamed(real_stack: RealStack) -> None:
    client = real_stack.client()
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=TOKENS, **GREEDY)
    assert whole.id.startswith("cmpl-___prefill_addr_")
    assert whole.model == MODEL_NAME
    assert whole.usage is not None and whole.usage.completion_tokens == TOKENS
    assert whole.choices[0].finish_reason == "length"
    text = whole.choices[0].text
    assert text

    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == text
    assert len([c for c in chunks if c.choices]) > 1  # really streamed, not one blob
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert usage.completion_tokens == TOKENS
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.total_tokens == usage.prompt_tokens + TOKENS


def test_chat_streamed_text_equals_non_streamed(real_stack: RealStack) -> None:
    client = real_stack.client()
    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=TOKENS, **GREEDY
    )
    assert whole.id.startswith("chatcmpl-___prefill_addr_")
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    text = whole.choices[0].message.content
    assert text
    assert whole.usage is not None and whole.usage.completion_tokens == TOKENS

    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[0].choices[0].delta.role == "assistant"
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == TOKENS
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_stream_without_include_usage_carries_no_usage(real_stack: RealStack) -> None:
    stream = real_stack.client().completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=4, stream=True, **GREEDY
    )
    assert all(chunk.usage is None for chunk in stream)


def _direct_error(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            raise AssertionError(f"expected an error, got {response.status}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize(
    ("case", "body"),
    [
        # Only the decode leg asks for many tokens (the prefill leg asks for one): D refuses.
        ("max_tokens beyond the context", {"prompt": PROMPT, "max_tokens": MAX_MODEL_LEN + 100}),
        # The prompt alone is too long: the prefill leg is refused by P.
        ("prompt beyond the context", {"prompt": "fox " * (MAX_MODEL_LEN + 50), "max_tokens": 4}),
    ],
)
def test_vllm_400_reaches_the_client_unchanged(
    real_stack: RealStack, case: str, body: dict[str, Any]
) -> None:
    body = {"model": MODEL_NAME, **body}
    status, direct = _direct_error(f"{real_stack.decode.url}/v1/completions", body)
    assert status == 400, direct

    with pytest.raises(openai.BadRequestError) as raised:
        real_stack.client().completions.create(**body)
    assert raised.value.status_code == 400
    assert raised.value.body is not None
    through_proxy = raised.value.response.json()
    assert through_proxy == direct, case
