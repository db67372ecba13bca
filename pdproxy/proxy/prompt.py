"""A request's features for pairing, estimated from its OpenAI body without a tokenizer. Pure.

Never raises: a body vLLM will reject still gets features (it is routed, and vLLM's own 400
reaches the client).
"""

from __future__ import annotations

import hashlib
from typing import Any

from pdproxy.pairing.features import RequestFeatures

CHARS_PER_TOKEN = 4  # English text with the common BPE vocabularies
# When the client sets no limit: the completions API's default, and a guess for chat, whose
# vLLM default is "until the context is full".
DEFAULT_COMPLETION_TOKENS = 16
DEFAULT_CHAT_TOKENS = 256


def request_features(
    payload: dict[str, Any], model: str, chat: bool, prefix_tokens: int
) -> RequestFeatures:
    """`prefix_tokens`: how much of the prompt's start identifies its prefix (prefix affinity)."""
    if chat:
        text, ids = _chat_text(payload.get("messages")), None
    else:
        text, ids = _completion_prompt(payload.get("prompt"))
    if ids is not None:
        prompt_tokens = len(ids)
        lead = ",".join(str(t) for t in ids[:prefix_tokens] if _is_token(t)).encode()
    else:
        prompt_tokens = -(-len(text) // CHARS_PER_TOKEN)
        lead = text[: prefix_tokens * CHARS_PER_TOKEN].encode("utf-8", "surrogatepass")
    prefix_key = None if not lead else int.from_bytes(_digest(lead, ids is not None), "big")
    limit = _limit(payload, DEFAULT_CHAT_TOKENS if chat else DEFAULT_COMPLETION_TOKENS)
    return RequestFeatures(model, prompt_tokens, prompt_tokens + limit, prefix_key)


def _digest(lead: bytes, token_ids: bool) -> bytes:
    # Text and token ids hash apart: the same digits as text are not the same prompt.
    return hashlib.blake2b(lead, digest_size=8, person=b"ids" if token_ids else b"text").digest()


def _limit(payload: dict[str, Any], default: int) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        value = payload.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return default


def _completion_prompt(prompt: Any) -> tuple[str, list[int] | None]:
    """(text, token ids or None). A batch is routed as one request: the first prompt decides
    the prefix, all of them count for size."""
    if isinstance(prompt, str):
        return prompt, None
    # Shapes are told by their first element: checking every id of a long token-id prompt cost
    # about 0.6 ms per request. A list that mixes kinds gets rough features; vLLM refuses it.
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if _is_token(first):
            return "", prompt
        if isinstance(first, str):
            return "\x00".join(p for p in prompt if isinstance(p, str)), None
        if isinstance(first, list):
            return "", [t for p in prompt if isinstance(p, list) for t in p]
    return "", None


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _chat_text(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    parts = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        parts.append(f"{message.get('role')}\x00{_content_text(message.get('content'))}")
    return "\x01".join(parts)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""
