"""A streamed completion: vLLM's chunk shapes and SSE framing, one token per latency tick."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from pdproxy.fake_vllm.asyncio_helpers import sleep
from pdproxy.fake_vllm.deterministic_text import generated_token_ids
from pdproxy.fake_vllm.generation import Generation
from pdproxy.fake_vllm.output import output_of
from pdproxy.fake_vllm.responses import Envelope, usage

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def stream_error_event(error: dict[str, Any]) -> bytes:
    """vLLM's event for a request that failed after its 200 status (json.dumps, as vLLM
    writes it: with spaces)."""
    code = error["code"]
    kind = "InternalServerError" if code >= 500 else "BadRequestError"
    body = {"error": {"message": error["message"], "type": kind, "param": None, "code": code}}
    return f"data: {json.dumps(body)}\n\n".encode()


def finish_reason(step: int, generation: Generation) -> str | None:
    # Token-in/token-out generations always run to max_tokens.
    return "length" if step == generation.max_tokens - 1 else None


def stream_choice(
    generation: Generation, index: int, delta: dict[str, Any] | str, finish: str | None
) -> dict[str, Any]:
    if generation.chat:
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {
        "index": index,
        "text": delta,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
    }


async def chunks(
    env: Envelope,
    generation: Generation,
    token_latency_s: float,
    generated: Callable[[int], None],
) -> AsyncIterator[dict[str, Any]]:
    """The chunks of a streamed answer; `generated(n)` hears of each step's n new tokens."""
    if generation.tokens:
        async for chunk in _token_chunks(env, generation, token_latency_s, generated):
            yield chunk
        return
    obj = "chat.completion.chunk" if generation.chat else "text_completion"
    outputs = [output_of(prompt, generation) for prompt in generation.prompts]
    ids = generation.return_token_ids
    if generation.chat:  # vLLM opens each chat choice with a role-only delta
        for index, output in enumerate(outputs):
            role = {"role": "assistant", "content": ""}
            extra = {"prompt_token_ids": output.prompt_ids} if ids else {}
            yield env.wrap(obj, [stream_choice(generation, index, role, None)], **extra)
    steps = max(len(output.token_ids) for output in outputs)
    for step in range(steps):
        await sleep(token_latency_s)
        generated(len(outputs))
        for index, output in enumerate(outputs):
            if step >= len(output.token_ids):
                continue
            last = step == len(output.token_ids) - 1
            text = output.pieces[step]
            delta: dict[str, Any] | str = {"content": text} if generation.chat else text
            choice = stream_choice(generation, index, delta, output.finish_reason if last else None)
            if last:
                choice["stop_reason"] = output.stop_reason
            if ids:
                if step == 0 and not generation.chat:
                    choice["prompt_token_ids"] = output.prompt_ids
                choice["token_ids"] = [output.token_ids[step]]
            yield env.wrap(obj, [choice])
    if generation.include_usage:
        yield env.wrap(obj, [], usage=usage(generation, outputs))


async def _token_chunks(
    env: Envelope,
    generation: Generation,
    token_latency_s: float,
    generated: Callable[[int], None],
) -> AsyncIterator[dict[str, Any]]:
    """/inference/v1/generate's chunks (GenerateTokensStreamResponse): one token id each,
    then the usage alone when asked for."""
    ids = generated_token_ids(generation.prompts[0].text, generation.max_tokens)
    for step, token in enumerate(ids):
        await sleep(token_latency_s)
        generated(1)
        choice = {
            "index": 0,
            "finish_reason": finish_reason(step, generation),
            "stop_reason": None,
            "token_ids": [token],
            "logprobs": None,
        }
        yield {"request_id": env.id, "usage": None, "output_mode": "tokens", "choices": [choice]}
    if generation.include_usage:
        yield {
            "request_id": env.id,
            "usage": usage(generation),
            "output_mode": "tokens",
            "choices": [],
        }
