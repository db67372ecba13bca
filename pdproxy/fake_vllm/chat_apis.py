"""OpenAI's Responses API (POST /v1/responses) and Anthropic's Messages API (POST /v1/messages)
as vLLM 0.32 serves them: their requests validated the way vLLM does, their whole answers and
their event streams (`event: TYPE` then `data: JSON`, no `[DONE]`), and their error bodies
(Messages: `{"type": "error", "error": {"type", "message"}}`).

Both are chat underneath (vLLM runs them through its chat machinery), so a Generation of
either is a chat one: the same words for the same messages, the same KV handoff.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from pdproxy.fake_vllm.asyncio_helpers import sleep
from pdproxy.fake_vllm.deterministic_text import generated_words
from pdproxy.fake_vllm.generation import (
    DEFAULT_MAX_TOKENS,
    Generation,
    Prompt,
    check_output_limit,
    check_sampling,
    fit_context,
    message_text,
    parse_max_tokens,
    text_prompt,
)
from pdproxy.fake_vllm.http_json import ApiError, error_type, json_response
from pdproxy.fake_vllm.responses import Envelope
from pdproxy.fake_vllm.streaming import chunks, sse

RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"
CHAT_API_PATHS = (RESPONSES_PATH, MESSAGES_PATH)


def answer_id(api: str, header_id: str, body_id: object) -> str:
    """vLLM's answer id: Responses takes the body's `request_id` (default `resp_` + uuid);
    Messages is chat's `chatcmpl-{X-Request-Id}`."""
    if api == RESPONSES_PATH:
        return body_id if isinstance(body_id, str) else f"resp_{header_id}"
    return f"chatcmpl-{header_id}"


def parse_api_generation(api: str, body: dict[str, Any], max_model_len: int) -> Generation:
    if api == RESPONSES_PATH:
        prompt = _responses_prompt(body)
        param = "max_output_tokens"
        if body.get("previous_response_id") is not None:
            # Nothing is ever stored here (as vLLM without VLLM_ENABLE_RESPONSES_API_STORE).
            raise ApiError(404, f"Response with id '{body['previous_response_id']}' not found.")
    else:
        prompt = _messages_prompt(body)
        param = "max_tokens"
        if body.get(param) is None:
            raise ApiError(400, "Field required: max_tokens", param)
    limit = parse_max_tokens(body, param)
    check_sampling(body)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, f"stream must be a boolean, got {stream!r}", "stream")
    check_output_limit(limit, param, max_model_len)
    max_tokens = fit_context((prompt,), limit or DEFAULT_MAX_TOKENS, max_model_len)
    return Generation(True, (prompt,), max_tokens, bool(stream), False, api=api)


def _responses_prompt(body: dict[str, Any]) -> Prompt:
    given = body.get("input")
    if given is None:
        raise ApiError(400, "Field required: input", "input")
    if isinstance(given, str):
        text = given
    elif isinstance(given, list) and given:
        text = "\n".join(message_text(_as_chat(item)) for item in given)
    else:
        raise ApiError(400, "input must be a string or a non-empty list of items", "input")
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        text = f"{instructions}\n{text}"
    return text_prompt(text)


def _as_chat(item: Any) -> Any:
    """A Responses input item as a chat message: its content parts are `input_text`."""
    if isinstance(item, dict) and isinstance(item.get("content"), list):
        parts = [
            {**part, "type": "text"} if isinstance(part, dict) else part for part in item["content"]
        ]
        return {**item, "content": parts}
    return item


def _messages_prompt(body: dict[str, Any]) -> Prompt:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    text = "\n".join(message_text(m) for m in messages)
    system = body.get("system")
    if isinstance(system, str):
        text = f"{system}\n{text}"
    return text_prompt(text)


def error_response(err: ApiError, api: str) -> web.Response:
    """An ApiError as `api` answers it (vLLM translates its errors for Messages)."""
    if api != MESSAGES_PATH:
        return err.response()
    body = {"type": "error", "error": {"type": error_type(err.status), "message": err.message}}
    return json_response(body, err.status)


def _text(generation: Generation) -> list[str]:
    return [f" {w}" for w in generated_words(generation.prompts[0].text, generation.max_tokens)]


def whole_answer(env: Envelope, generation: Generation) -> dict[str, Any]:
    text = "".join(_text(generation))
    if generation.api == RESPONSES_PATH:
        return _response(env, generation, "completed", text)
    return {
        **_message(env, generation, generation.max_tokens),
        "content": [{"type": "text", "text": text}],
        "stop_reason": "max_tokens",
    }


def _response(
    env: Envelope, generation: Generation, status: str, text: str | None
) -> dict[str, Any]:
    """A Responses object; `text` None: nothing generated yet."""
    output = []
    if text is not None:
        output.append(
            {
                "type": "message",
                "id": f"msg_{env.id}",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        )
    prompt_tokens = generation.prompt_tokens
    done = generation.max_tokens if text is not None else 0
    return {
        "id": env.id,
        "object": "response",
        "created_at": env.created,
        "model": env.model,
        "status": status,
        "output": output,
        "max_output_tokens": generation.max_tokens,
        "usage": {
            "input_tokens": prompt_tokens,
            "output_tokens": done,
            "total_tokens": prompt_tokens + done,
        },
    }


def _message(env: Envelope, generation: Generation, output_tokens: int) -> dict[str, Any]:
    return {
        "id": env.id,
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": env.model,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": generation.prompt_tokens, "output_tokens": output_tokens},
    }


def event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def frames(
    env: Envelope,
    generation: Generation,
    token_latency_s: float,
    generated: Callable[[int], None],
) -> AsyncIterator[bytes]:
    """A streamed answer's frames: chunks as `data:` lines for the OpenAI APIs (the caller
    adds `[DONE]`), events for Responses and Messages; one frame per token at least."""
    if not generation.api:
        async for chunk in chunks(env, generation, token_latency_s, generated):
            yield sse(chunk)
        return
    events = _responses_events if generation.api == RESPONSES_PATH else _messages_events
    async for frame in events(env, generation, token_latency_s, generated):
        yield frame


async def _responses_events(
    env: Envelope, generation: Generation, latency: float, generated: Callable[[int], None]
) -> AsyncIterator[bytes]:
    number = 0

    def next_event(kind: str, **fields: Any) -> bytes:
        nonlocal number
        number += 1
        return event(kind, {"type": kind, "sequence_number": number - 1, **fields})

    item_id = f"msg_{env.id}"
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    yield next_event("response.created", response=_response(env, generation, "in_progress", None))
    yield next_event(
        "response.in_progress", response=_response(env, generation, "in_progress", None)
    )
    item = {"type": "message", "id": item_id, "role": "assistant", "status": "in_progress"}
    yield next_event("response.output_item.added", output_index=0, item={**item, "content": []})
    part = {"type": "output_text", "text": "", "annotations": []}
    yield next_event("response.content_part.added", part=part, **where)
    texts = _text(generation)
    for text in texts:
        await sleep(latency)
        generated(1)
        yield next_event("response.output_text.delta", delta=text, logprobs=[], **where)
    whole = "".join(texts)
    yield next_event("response.output_text.done", text=whole, logprobs=[], **where)
    done_part = {**part, "text": whole}
    yield next_event("response.content_part.done", part=done_part, **where)
    done_item = {**item, "status": "completed", "content": [done_part]}
    yield next_event("response.output_item.done", output_index=0, item=done_item)
    yield next_event("response.completed", response=_response(env, generation, "completed", whole))


async def _messages_events(
    env: Envelope, generation: Generation, latency: float, generated: Callable[[int], None]
) -> AsyncIterator[bytes]:
    yield event("message_start", {"type": "message_start", "message": _message(env, generation, 0)})
    block = {"type": "text", "text": ""}
    yield event(
        "content_block_start", {"type": "content_block_start", "index": 0, "content_block": block}
    )
    for text in _text(generation):
        await sleep(latency)
        generated(1)
        delta = {"type": "text_delta", "text": text}
        yield event(
            "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
        )
    yield event("content_block_stop", {"type": "content_block_stop", "index": 0})
    usage = {"input_tokens": generation.prompt_tokens, "output_tokens": generation.max_tokens}
    stop = {"stop_reason": "max_tokens", "stop_sequence": None}
    yield event("message_delta", {"type": "message_delta", "delta": stop, "usage": usage})
    yield event("message_stop", {"type": "message_stop"})
