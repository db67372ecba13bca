"""A prefill with a smaller KV block size than its decode: the connector's token-major wire
re-lays the KV into the decode's own blocks, and the answer is still exactly one vLLM's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pdproxy.demo.processes import http_json, wait_until
from pdproxy.ids import parse_request_id
from tests.harness.vllm_cpu import MODEL_NAME
from tests.harness.vllm_env import VllmEnv
from tests.vllm.conftest import PairStack, pair_stack

pytestmark = pytest.mark.vllm

PREFILL_BLOCK, DECODE_BLOCK = 32, 128  # the CPU backend prefers multiples of 32
PROMPT = " ".join(["amber", "basalt", "cobalt", "dune", "ember", "fjord", "glacier"] * 30)
TOKENS = 12


@pytest.fixture(scope="module")
def stack(
    vllm_env: VllmEnv, vllm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PairStack]:
    with pair_stack(
        vllm_env,
        vllm_model,
        tmp_path_factory.mktemp("kv-block-sizes"),
        ("vllm-P-b32", "vllm-D-b128"),
        prefill={"block_size": PREFILL_BLOCK},
        decode={"block_size": DECODE_BLOCK},
    ) as made:
        yield made


def complete(url: str) -> openai.types.Completion:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=TOKENS, temperature=0.0, logprobs=1
    )


def test_the_pair_is_compatible_and_listed_with_its_block_ratio(stack: PairStack) -> None:
    listing = http_json(f"{stack.proxy.proxy_url}/v1/instances/pairs")["prefills"]
    assert len(listing) == 1, listing
    text = str(listing[0])
    assert stack.decode.http_address in text
    assert "'block_size_ratio': 4" in text, text


def test_a_smaller_prefill_block_gives_the_same_answer(stack: PairStack) -> None:
    through = complete(stack.proxy.proxy_url)
    alone = complete(stack.prefill.url)  # one vLLM computing everything itself
    assert through.choices[0].text == alone.choices[0].text
    through_logprobs = through.choices[0].logprobs
    alone_logprobs = alone.choices[0].logprobs
    assert through_logprobs is not None and alone_logprobs is not None
    pairs = zip(
        through_logprobs.token_logprobs or [], alone_logprobs.token_logprobs or [], strict=True
    )
    assert all(abs((a or 0.0) - (b or 0.0)) <= 1e-3 for a, b in pairs)
    assert through.usage is not None
    prompt_tokens = through.usage.prompt_tokens
    assert prompt_tokens > DECODE_BLOCK  # several blocks on both sides

    tagged = parse_request_id(through.id)
    assert tagged is not None
    wait_until(
        lambda: any(r["transfer"].startswith(tagged.uid) for r in stack.decode.records("transfer")),
        10,
        "the decode's transfer record",
    )
    received = [r for r in stack.decode.records("transfer") if r["transfer"].startswith(tagged.uid)]
    sent = [r for r in stack.prefill.records("transfer") if r["transfer"].startswith(tagged.uid)]
    loaded = prompt_tokens - 1
    assert [(r["outcome"], r["blocks"]) for r in received] == [("ok", -(-loaded // DECODE_BLOCK))]
    assert [(r["outcome"], r["blocks"]) for r in sent] == [("ok", -(-loaded // PREFILL_BLOCK))]
    assert received[0]["bytes"] == sent[0]["bytes"]
