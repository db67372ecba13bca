"""OpenAI's Responses API and Anthropic's Messages API disaggregated through the proxy between
the session's two real vLLM servers (pdproxy's own connector), asked with the official `openai`
and `anthropic` clients: a greedy answer, streamed or not, is exactly what one vLLM computing
everything gives, the decode loaded the prompt's KV from the prefill, and vLLM's refusals reach
the client verbatim."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import anthropic
import openai
import pytest

from pdproxy.base.roles import Role
from pdproxy.demo.processes import wait_until
from pdproxy.ids import parse_request_id
from tests.harness.vllm_cpu import MODEL_NAME, VllmServer
from tests.vllm.conftest import CLIENT_TIMEOUT_S, RealStack

pytestmark = pytest.mark.vllm

TOKENS = 10
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india"]
PROMPTS = (
    "The quick brown fox jumps over the lazy dog again and again",
    " ".join(WORDS[(i * 5) % len(WORDS)] for i in range(150)),  # more than one 128-token block
)
LAYERS, KV_HEADS, HEAD_DIM, FLOAT32 = 2, 2, 32, 4  # the tiny model (tests.harness.tiny_model)
BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * FLOAT32


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S
    )


def anthropic_client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=url, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S
    )


def responses_args(prompt: str) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "input": prompt,
        "max_output_tokens": TOKENS,
        "temperature": 0.0,
    }


def messages_args(prompt: str) -> dict[str, Any]:
    # `anthropic`'s Messages.create names no temperature: vLLM reads it from the body.
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": TOKENS,
        "extra_body": {"temperature": 0.0},
    }


def message_text(message: anthropic.types.Message) -> str:
    return "".join(b.text for b in message.content if isinstance(b, anthropic.types.TextBlock))


def transfer_records(server: VllmServer, side: Role, uid: str) -> list[dict[str, Any]]:
    return [
        row
        for row in server.records("transfer")
        if row["side"] == side and row["transfer"].startswith(uid)
    ]


def assert_kv_moved(stack: RealStack, answer_id: str, prompt_tokens: int) -> None:
    """The decode received the prompt's KV but its last token from the prefill, which sent it."""
    tagged = parse_request_id(answer_id)
    assert tagged is not None, answer_id
    uid = tagged.uid

    def recorded() -> bool:
        return bool(transfer_records(stack.decode, Role.DECODE, uid))

    wait_until(recorded, 10, f"the decode's transfer record of {answer_id}")
    expected = [("ok", (prompt_tokens - 1) * BYTES_PER_TOKEN)]
    received = transfer_records(stack.decode, Role.DECODE, uid)
    sent = transfer_records(stack.prefill, Role.PREFILL, uid)
    assert [(r["outcome"], r["bytes"]) for r in received] == expected
    assert [(r["outcome"], r["bytes"]) for r in sent] == expected


def test_responses_through_the_proxy_equal_one_vllm_and_move_the_kv(
    real_stack: RealStack,
) -> None:
    through_client = openai_client(real_stack.proxy.proxy_url)
    alone_client = openai_client(real_stack.prefill.url)
    texts = []
    for prompt in PROMPTS:
        through = through_client.responses.create(**responses_args(prompt))
        # One vLLM computing the prompt itself: the prefill instance, asked directly.
        alone = alone_client.responses.create(**responses_args(prompt))
        assert through.output_text == alone.output_text, prompt
        assert through.output_text and through.usage is not None
        assert alone.usage is not None
        assert through.usage.output_tokens == alone.usage.output_tokens
        # The response's id is the tagged id the proxy wrote into both legs' bodies.
        assert through.id.startswith("resp____prefill_addr_")
        assert_kv_moved(real_stack, through.id, through.usage.input_tokens)

        streamed, kinds = "", []
        for event in through_client.responses.create(**responses_args(prompt), stream=True):
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                streamed += event.delta
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert streamed == through.output_text
        texts.append(through.output_text)
    # The equality means something: the two prompts' answers differ.
    assert texts[0] != texts[1]


def test_messages_through_the_proxy_equal_one_vllm_and_move_the_kv(
    real_stack: RealStack,
) -> None:
    through_client = anthropic_client(real_stack.proxy.proxy_url)
    alone_client = anthropic_client(real_stack.prefill.url)
    texts = []
    for prompt in PROMPTS:
        through = through_client.messages.create(**messages_args(prompt))
        alone = alone_client.messages.create(**messages_args(prompt))
        assert message_text(through) == message_text(alone), prompt
        assert message_text(through) and through.stop_reason == alone.stop_reason
        assert through.usage.output_tokens == alone.usage.output_tokens
        assert_kv_moved(real_stack, through.id, through.usage.input_tokens)

        with through_client.messages.stream(**messages_args(prompt)) as stream:
            streamed = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert streamed == message_text(through) == message_text(final)
        texts.append(message_text(through))
    assert texts[0] != texts[1]


def post(url: str, payload: Any) -> tuple[int, bytes]:
    request = urllib.request.Request(
        url, json.dumps(payload).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=CLIENT_TIMEOUT_S) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@pytest.mark.parametrize(
    ("path", "body", "anthropic_shaped"),
    [
        # refused by the prefill leg, in vLLM's validation shape (OpenAI's, on both paths)
        ("/v1/responses", {"model": MODEL_NAME, "input": 5}, False),
        ("/v1/messages", {"model": MODEL_NAME, "max_tokens": 4, "messages": "hello"}, False),
        # refused by the decode leg (the prefill leg asks for one token only), which vLLM's
        # Messages endpoint words in Anthropic's shape
        (
            "/v1/messages",
            {
                "model": MODEL_NAME,
                "max_tokens": 100_000,
                "messages": [{"role": "user", "content": "hello"}],
            },
            True,
        ),
    ],
)
def test_vllms_refusals_reach_the_client_verbatim(
    real_stack: RealStack, path: str, body: dict[str, Any], anthropic_shaped: bool
) -> None:
    status, through = post(real_stack.proxy.proxy_url + path, body)
    status_alone, alone = post(real_stack.decode.url + path, body)
    assert 400 <= status == status_alone < 500, (through, alone)
    assert json.loads(through) == json.loads(alone)
    shape = set(json.loads(through))
    assert shape == ({"type", "error"} if anthropic_shaped else {"error"}), through
