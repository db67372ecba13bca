"""The fake's "model": a causal one over token ids, so every answer is reproducible and a
generation continued from any point (its prompt's ids plus the ids generated so far) goes on
exactly as the uninterrupted one would.

The tokenizer is a toy: a prompt's words are its tokens (a decimal number is that token id, an
output word its place in VOCABULARY, any other word a hashed id above the vocabulary), so a
prompt given as token ids reads the same as its ids written out as words.
"""

from __future__ import annotations

import hashlib

# Output words: token id i is VOCABULARY[i], written " word".
# fmt: off
VOCABULARY = (
    "alpha", "bravo", "cache", "delta", "echo", "fleet", "gamma", "hello",
    "index", "joule", "kilo", "lima", "model", "nova", "omega", "prefill",
    "quartz", "relay", "sigma", "token", "union", "vector", "whisky", "xenon",
    "yield", "zulu", "decode", "tensor", "block", "layer", "head", "stream",
)
# fmt: on

_IDS = {word: index for index, word in enumerate(VOCABULARY)}
# Prompt words that are neither numbers nor output words get ids from here up.
_HASHED_BASE = 1000
_HASHED_SPAN = 1_000_000


def tokenize(text: str) -> list[int]:
    """A prompt's token ids: one per whitespace-separated word."""
    return [_token(word) for word in text.split()]


def _token(word: str) -> int:
    if word.isascii() and word.isdigit():
        return int(word)
    known = _IDS.get(word)
    if known is not None:
        return known
    digest = hashlib.sha256(word.encode()).digest()
    return _HASHED_BASE + int.from_bytes(digest[:8], "big") % _HASHED_SPAN


def detokenize(token: int) -> str:
    """The text of one generated token."""
    return f" {VOCABULARY[token]}"


def next_tokens(context: list[int], count: int) -> list[int]:
    """`count` tokens following `context` (prompt ids, then any ids generated so far): each a
    function of every token before it, like a causal model's greedy choice."""
    state = hashlib.sha256()
    for token in context:
        state.update(token.to_bytes(8, "big"))
    out = []
    for _ in range(count):
        token = int.from_bytes(state.copy().digest()[:8], "big") % len(VOCABULARY)
        out.append(token)
        state.update(token.to_bytes(8, "big"))
    return out


def generated_token_ids(prompt_text: str, count: int) -> list[int]:
    """The first `count` tokens generated for a prompt."""
    return next_tokens(tokenize(prompt_text), count)


def generated_words(prompt_text: str, count: int) -> list[str]:
    """The same tokens as words: the same prompt gives the same words, streamed or not."""
    return [VOCABULARY[token] for token in generated_token_ids(prompt_text, count)]
