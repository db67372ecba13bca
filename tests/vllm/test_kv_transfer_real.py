"""pdproxy's own connector between two real vLLM servers: the decode instance loads the KV the
prefill computed, and the answer is exactly what one vLLM computing everything gives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import openai
import pytest

from pdproxy.base.roles import Role
from pdproxy.demo.processes import wait_until
from pdproxy.ids import parse_request_id
from tests.harness.vllm_cpu import MODEL_NAME
from tests.integration.support import metric_value
from tests.vllm.conftest import RealStack, metric_sum

pytestmark = pytest.mark.vllm

TOKENS = 16
GREEDY: dict[str, Any] = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india"]
# The tiny model's tokenizer gives about one token per short word; the CPU block is 128 tokens.
PROMPTS = {
    "short": "The quick brown fox jumps over",
    "multi_block": " ".join(WORDS[i % len(WORDS)] for i in range(60)),
    "over_four_blocks": " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(220)),
}
BLOCK = 128  # vLLM's CPU default
# What each prompt must be, in blocks of prompt tokens, for its name to be true.
BLOCKS = {"short": range(1, 2), "multi_block": range(2, 5), "over_four_blocks": range(5, 16)}
LAYERS, KV_HEADS, HEAD_DIM, FLOAT32 = 2, 2, 32, 4  # the tiny model (tests.harness.tiny_model)
BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * FLOAT32


def direct(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@dataclass(frozen=True)
class Answer:
    text: str
    id: str
    prompt_tokens: int
    logprobs: tuple[float, ...]  # of each generated token: they depend on every KV value


def ask(client: openai.OpenAI, endpoint: str, prompt: str) -> Answer:
    if endpoint == "completions":
        answer = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=TOKENS, logprobs=1, **GREEDY
        )
        choice = answer.choices[0]
        assert answer.usage is not None and choice.logprobs is not None
        values = [v for v in choice.logprobs.token_logprobs or [] if v is not None]
        return Answer(choice.text, answer.id, answer.usage.prompt_tokens, tuple(values))
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=TOKENS,
        logprobs=True,
        **GREEDY,
    )
    message = chat.choices[0]
    assert chat.usage is not None and message.logprobs is not None
    values = [item.logprob for item in message.logprobs.content or []]
    return Answer(message.message.content or "", chat.id, chat.usage.prompt_tokens, tuple(values))


def same_logprobs(a: Answer, b: Answer) -> bool:
    # Float32 on CPU; the decode computes the last prompt token alone, the single vLLM the whole
    # prompt at once, so the kernels may round differently in the last bits.
    return len(a.logprobs) == len(b.logprobs) == TOKENS and all(
        abs(x - y) <= 1e-3 for x, y in zip(a.logprobs, b.logprobs, strict=True)
    )


def transfer_records(stack: RealStack, side: Role, uid: str) -> list[dict[str, Any]]:
    server = stack.prefill if side is Role.PREFILL else stack.decode
    return [
        row
        for row in server.records("transfer")
        if row["side"] == side and row["transfer"].startswith(uid)
    ]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("name", list(PROMPTS))
def test_disaggregated_answer_equals_one_vllm_and_decode_loaded_the_kv(
    real_stack: RealStack, endpoint: str, name: str
) -> None:
    prompt = PROMPTS[name]
    external_before = _external_tokens(real_stack)
    pair = {"prefill": real_stack.prefill.http_address, "decode": real_stack.decode.http_address}
    proxy = real_stack.proxy.proxy_url
    ok_before = metric_value(proxy, "pdproxy_kv_transfers_total", {"outcome": "ok"})
    bytes_before = metric_value(proxy, "pdproxy_kv_transfer_bytes_total", pair)
    through = ask(real_stack.client(), endpoint, prompt)
    # One vLLM computing the prompt itself: the prefill instance, asked directly (untagged).
    alone = ask(direct(real_stack.prefill.url), endpoint, prompt)
    assert through.prompt_tokens == alone.prompt_tokens
    assert through.text == alone.text, (name, endpoint)
    assert same_logprobs(through, alone), (through.logprobs, alone.logprobs)
    prompt_tokens = through.prompt_tokens
    response_id = through.id
    assert -(-prompt_tokens // BLOCK) in BLOCKS[name], prompt_tokens

    tagged = parse_request_id(response_id)
    assert tagged is not None, response_id
    wait_until(
        lambda: bool(transfer_records(real_stack, Role.DECODE, tagged.uid)),
        10,
        "the decode's transfer record",
    )
    received = transfer_records(real_stack, Role.DECODE, tagged.uid)
    sent = transfer_records(real_stack, Role.PREFILL, tagged.uid)
    expected_bytes = (prompt_tokens - 1) * BYTES_PER_TOKEN
    assert [r["outcome"] for r in received] == ["ok"]
    assert received[0]["bytes"] == expected_bytes
    assert received[0]["blocks"] == -(-(prompt_tokens - 1) // BLOCK)
    assert [(r["outcome"], r["bytes"]) for r in sent] == [("ok", expected_bytes)]
    # vLLM's own count: the decode took all but the last prompt token from the transfer.
    wait_until(
        lambda: _external_tokens(real_stack) - external_before >= prompt_tokens - 1,
        10,
        "vLLM to count the externally loaded tokens",
    )
    assert _external_tokens(real_stack) - external_before == prompt_tokens - 1
    # The proxy counted the transfer once, with the bytes the geometry predicts.
    wait_until(
        lambda: metric_value(proxy, "pdproxy_kv_transfers_total", {"outcome": "ok"}) > ok_before,
        10,
        "the proxy to count the transfer",
    )
    assert metric_value(proxy, "pdproxy_kv_transfers_total", {"outcome": "ok"}) == ok_before + 1
    moved = metric_value(proxy, "pdproxy_kv_transfer_bytes_total", pair) - bytes_before
    assert moved == expected_bytes
    assert metric_value(proxy, "pdproxy_kv_transfer_bandwidth_bytes_per_second", pair) > 0


def test_logprobs_tell_prompts_apart(real_stack: RealStack) -> None:
    """The equality above means something: with random weights the text may repeat one
    token, but the logprobs depend on every KV value of the prompt; a prompt differing in one
    early word already changes them."""
    first = ask(direct(real_stack.prefill.url), "completions", PROMPTS["multi_block"])
    changed = "zulu" + PROMPTS["multi_block"][len("alpha") :]
    second = ask(direct(real_stack.prefill.url), "completions", changed)
    assert not same_logprobs(first, second)


def _external_tokens(stack: RealStack) -> float:
    return _by_source(stack, "external_kv_transfer")


def _by_source(stack: RealStack, source: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(stack.decode.metrics_text()):
        for sample in family.samples:
            if sample.name == "vllm:prompt_tokens_by_source_total" and (
                sample.labels.get("source") == source
            ):
                total += sample.value
    return total


def test_the_decode_computed_only_what_it_did_not_load(real_stack: RealStack) -> None:
    computed_before = _by_source(real_stack, "local_compute")
    external_before = _external_tokens(real_stack)
    prompt_tokens = ask(
        real_stack.client(), "completions", PROMPTS["multi_block"] + " x"
    ).prompt_tokens
    wait_until(lambda: _external_tokens(real_stack) > external_before, 10, "the load to be counted")
    assert _by_source(real_stack, "local_compute") - computed_before <= 1
    assert metric_sum(real_stack.decode, "vllm:prompt_tokens_by_source_total") > 0
    assert prompt_tokens > BLOCK
