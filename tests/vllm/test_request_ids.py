"""The ids real vLLM's engine handed the KV connector on P and on D name, by vLLM's own
regexes, the P and D the proxy chose; the prefill leg generated one token, the decode leg the
rest."""

from __future__ import annotations

from typing import Any

import pytest

from pdproxy.ids import vllm_decode_address, vllm_prefill_address
from tests.harness.vllm_cpu import MODEL_NAME
from tests.vllm.conftest import IdPatterns, RealStack

pytestmark = pytest.mark.vllm

TOKENS = 12
GREEDY: dict[str, Any] = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def _tag(response_id: str) -> str:
    for prefix in ("chatcmpl-", "cmpl-"):
        if response_id.startswith(prefix):
            return response_id.removeprefix(prefix)
    raise AssertionError(f"unexpected response id {response_id}")


def _check_legs(
    stack: RealStack, patterns: IdPatterns, tag: str, engine_prefix: str, prompts: int
) -> None:
    p_rows = stack.wait_finished(stack.prefill, tag, prompts)
    d_rows = stack.wait_finished(stack.decode, tag, prompts)
    assert len(p_rows) == len(d_rows) == prompts
    expected = (stack.prefill.zmq_address, stack.decode.zmq_address)
    for row in p_rows + d_rows:
        engine_id = row["request_id"]
        assert engine_id.startswith(f"{engine_prefix}{tag}-"), engine_id
        # vLLM 0.32's own parser (MoRIIO's) and the P2pNcclConnector patterns DESIGN.md fixes
        assert patterns.addresses(engine_id) == expected
        assert str(vllm_prefill_address(engine_id)) == stack.prefill.zmq_address
        assert str(vllm_decode_address(engine_id)) == stack.decode.zmq_address
    # The prefill leg really was a one-token request on P; the decode leg the full one on D.
    p_new = [r for r in stack.records_for(stack.prefill, tag) if r["event"] == "new"]
    d_new = [r for r in stack.records_for(stack.decode, tag) if r["event"] == "new"]
    assert [r["max_tokens"] for r in p_new] == [1] * prompts
    assert [r["output_tokens"] for r in p_rows] == [1] * prompts
    assert [r["max_tokens"] for r in d_new] == [TOKENS] * prompts
    assert [r["output_tokens"] for r in d_rows] == [TOKENS] * prompts
    # Same prompt on both sides: P computed what D will (today) recompute.
    assert sorted(r["prompt_tokens"] for r in p_new) == sorted(r["prompt_tokens"] for r in d_new)


def test_completion_ids_name_the_chosen_pair(
    real_stack: RealStack, id_patterns: IdPatterns
) -> None:
    response = real_stack.client().completions.create(
        model=MODEL_NAME, prompt="Once upon a time", max_tokens=TOKENS, **GREEDY
    )
    _check_legs(real_stack, id_patterns, _tag(response.id), "cmpl-", prompts=1)


def test_multi_prompt_completion_ids_name_the_chosen_pair(
    real_stack: RealStack, id_patterns: IdPatterns
) -> None:
    response = real_stack.client().completions.create(
        model=MODEL_NAME, prompt=["First prompt here", "A second one"], max_tokens=TOKENS, **GREEDY
    )
    assert sorted(choice.index for choice in response.choices) == [0, 1]
    tag = _tag(response.id)
    _check_legs(real_stack, id_patterns, tag, "cmpl-", prompts=2)
    # One engine request per prompt, numbered by prompt index, on each side.
    for server in (real_stack.prefill, real_stack.decode):
        rows = [r for r in real_stack.records_for(server, tag) if r["event"] == "new"]
        indexes = sorted(r["request_id"].removeprefix(f"cmpl-{tag}-").split("-")[0] for r in rows)
        assert indexes == ["0", "1"]


def test_chat_ids_name_the_chosen_pair(real_stack: RealStack, id_patterns: IdPatterns) -> None:
    response = real_stack.client().chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=TOKENS,
        **GREEDY,
    )
    _check_legs(real_stack, id_patterns, _tag(response.id), "chatcmpl-", prompts=1)


def test_streamed_request_ids_name_the_chosen_pair(
    real_stack: RealStack, id_patterns: IdPatterns
) -> None:
    stream = real_stack.client().completions.create(
        model=MODEL_NAME, prompt="Streaming now", max_tokens=TOKENS, stream=True, **GREEDY
    )
    ids = {chunk.id for chunk in stream}
    assert len(ids) == 1
    _check_legs(real_stack, id_patterns, _tag(ids.pop()), "cmpl-", prompts=1)
