"""What pairing knows of one request: its model, its size and its prefix. Pure."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    model: str
    # Estimated: exact for token-id prompts, about 4 characters per token for text.
    prompt_tokens: int = 0
    # The KV a decode instance may have to hold for it: prompt plus the tokens it may generate.
    decode_tokens: int = 0
    # A stable 64-bit hash of the prompt's leading block(s), or None when there is no prompt.
    prefix_key: int | None = None
