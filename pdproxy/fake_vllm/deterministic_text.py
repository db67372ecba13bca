"""The fake's "model": words picked by hashing the prompt, so every answer is reproducible."""

from __future__ import annotations

import hashlib

# Output words; token i of a completion is VOCABULARY[sha256(prompt_text + str(i)) % len].
# fmt: off
VOCABULARY = (
    "alpha", "bravo", "cache", "delta", "echo", "fleet", "gamma", "hello",
    "index", "joule", "kilo", "lima", "model", "nova", "omega", "prefill",
    "quartz", "relay", "sigma", "token", "union", "vector", "whisky", "xenon",
    "yield", "zulu", "decode", "tensor", "block", "layer", "head", "stream",
)
# fmt: on


def generated_words(prompt_text: str, count: int) -> list[str]:
    """Deterministic "tokens": the same prompt gives the same words, streamed or not."""
    words = []
    for i in range(count):
        digest = hashlib.sha256(f"{prompt_text}{i}".encode()).digest()
        words.append(VOCABULARY[int.from_bytes(digest[:8], "big") % len(VOCABULARY)])
    return words


_IDS = {word: index for index, word in enumerate(VOCABULARY)}


def generated_token_ids(prompt_text: str, count: int) -> list[int]:
    """The same "tokens" as ids (their place in VOCABULARY), for the token-in/token-out API."""
    return [_IDS[word] for word in generated_words(prompt_text, count)]
