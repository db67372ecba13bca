"""A request's features for pairing, estimated from its OpenAI body without a tokenizer. Pure.

Never raises: a body vLLM will reject still gets features (it is routed, and vLLM's own 400
reaches the client).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from typing import Any

from pdproxy.pairing.features import PrefixWindow, RequestFeatures
from pdproxy.proxy.api_bodies import responses_text

CHARS_PER_TOKEN = 4  # English text with the common BPE vocabularies
# When the client sets no limit: the completions API's default, and a guess for chat, whose
# vLLM default is "until the context is full".
DEFAULT_COMPLETION_TOKENS = 16
DEFAULT_CHAT_TOKENS = 256


# Prefix windows: the first covers `prefix_tokens`, each next one twice as many, up to the whole
# prompt or this many windows (256 x 2^5 = 8,192 tokens with the default), which bounds the
# hashing per request (docs/performance.md, "Prompt features").
MAX_PREFIX_WINDOWS = 6


def request_features(
    payload: dict[str, Any],
    model: str,
    chat: bool,
    prefix_tokens: int,
    generate: bool = False,
    responses: bool = False,
) -> RequestFeatures:
    """`prefix_tokens`: how much of the prompt's start identifies its prefix (prefix affinity);
    0 computes no prefix windows. `generate`: vLLM's token-in/token-out body (token_ids, limits
    in sampling_params). `responses`: a Responses body (instructions and input; its limit
    max_output_tokens). A chat body may have a top-level `system` (Anthropic's): it leads."""
    if generate:
        return _generate_features(payload, model, prefix_tokens)
    if responses:
        return _responses_features(payload, model, prefix_tokens)
    if chat:
        text, ids = _chat_text(payload.get("messages")), None
        system = payload.get("system")
        if system is not None:
            text = f"system\x00{_content_text(system)}\x01{text}"
    else:
        text, ids = _completion_prompt(payload.get("prompt"))
    if ids is not None:
        prompt_tokens = len(ids)
        windows = _windows(_id_bytes(ids, prefix_tokens), prompt_tokens, prefix_tokens, 8, b"ids")
    else:
        prompt_tokens = -(-len(text) // CHARS_PER_TOKEN)
        longest = prefix_tokens << (MAX_PREFIX_WINDOWS - 1)
        lead = text[: longest * CHARS_PER_TOKEN]
        windows = _windows(lead, prompt_tokens, prefix_tokens, CHARS_PER_TOKEN, b"text")
    limit = _limit(payload, DEFAULT_CHAT_TOKENS if chat else DEFAULT_COMPLETION_TOKENS)
    return RequestFeatures(model, prompt_tokens, prompt_tokens + limit, windows)


def _generate_features(payload: dict[str, Any], model: str, prefix_tokens: int) -> RequestFeatures:
    """The prompt is the token ids, hashed as a completion's token-id prompt is (the same ids
    are the same prefix, whichever endpoint they came by); the limit is sampling_params'
    max_tokens (vLLM's default: until the context is full, guessed as for chat)."""
    ids = payload.get("token_ids")
    ids = ids if isinstance(ids, list) else []
    prompt_tokens = len(ids)
    windows = _windows(_id_bytes(ids, prefix_tokens), prompt_tokens, prefix_tokens, 8, b"ids")
    sampling = payload.get("sampling_params")
    limit = _limit(sampling if isinstance(sampling, dict) else {}, DEFAULT_CHAT_TOKENS)
    return RequestFeatures(model, prompt_tokens, prompt_tokens + limit, windows)


def _responses_features(payload: dict[str, Any], model: str, prefix_tokens: int) -> RequestFeatures:
    """Instructions, then the input (a string, or items shaped like chat messages), counted
    and hashed as chat text is; the limit is max_output_tokens (vLLM's default: until the
    context is full, guessed as for chat)."""
    instructions, given = responses_text(payload)
    text = given if isinstance(given, str) else _chat_text(given)
    if instructions:
        text = f"system\x00{instructions}\x01{text}"
    prompt_tokens = -(-len(text) // CHARS_PER_TOKEN)
    lead = text[: (prefix_tokens << (MAX_PREFIX_WINDOWS - 1)) * CHARS_PER_TOKEN]
    windows = _windows(lead, prompt_tokens, prefix_tokens, CHARS_PER_TOKEN, b"text")
    value = payload.get("max_output_tokens")
    limit = value if isinstance(value, int) and not isinstance(value, bool) else -1
    if limit < 0:
        limit = DEFAULT_CHAT_TOKENS
    return RequestFeatures(model, prompt_tokens, prompt_tokens + limit, windows)


def _windows(
    lead: str | bytes, prompt_tokens: int, prefix_tokens: int, units_per_token: int, kind: bytes
) -> tuple[PrefixWindow, ...]:
    """Hashes of lead[: tokens x units_per_token] (characters of text, bytes of packed ids) for
    tokens = prefix_tokens, x2, x4 ...; one incremental hash, so the cost is one pass over the
    longest window. Text is cut by characters, as prompt_tokens counts them, never inside a
    multi-byte character. Text and token ids hash apart (`kind`): the same digits as text are
    not the same prompt."""
    if not lead or prefix_tokens < 1:
        return ()
    digest = hashlib.blake2b(digest_size=8, person=kind)
    windows: list[PrefixWindow] = []
    done = 0
    tokens = prefix_tokens
    while done < len(lead) and len(windows) < MAX_PREFIX_WINDOWS:
        end = min(len(lead), tokens * units_per_token)
        part = lead[done:end]
        digest.update(part.encode("utf-8", "surrogatepass") if isinstance(part, str) else part)
        done = end
        key = int.from_bytes(digest.copy().digest(), "big")
        windows.append(PrefixWindow(min(tokens, prompt_tokens), key))
        tokens *= 2
    return tuple(windows)


def _id_bytes(ids: list[Any], prefix_tokens: int) -> bytes:
    """The leading ids as little-endian 8-byte words (the same on every machine, so every
    proxy replica computes the same keys), up to the longest window."""
    lead = ids[: prefix_tokens << (MAX_PREFIX_WINDOWS - 1)]
    try:
        words = array("q", lead)
    except (TypeError, OverflowError):
        # Not all 64-bit ints (vLLM will refuse the prompt): hash what is there, still bounded.
        return b"".join(
            int(t).to_bytes(8, "little", signed=True) if _fits(t) else b"?" * 8 for t in lead
        )
    if sys.byteorder == "big":
        words.byteswap()
    return words.tobytes()


def _fits(value: Any) -> bool:
    return _is_token(value) and -(2**63) <= value < 2**63


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
    # Shapes are told by their first element, not by every id of a long token-id prompt
    # (docs/performance.md, "Prompt features"). A list that mixes kinds gets rough features;
    # vLLM refuses it.
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
