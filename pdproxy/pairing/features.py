"""What pairing knows of one request: its model, its size and its prefix. Pure."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, init=False, unsafe_hash=True)
class PrefixWindow:
    """A hash of the prompt's first `tokens` tokens (or all of it, if shorter)."""

    tokens: int
    key: int

    # Why a hand-written __init__ (not frozen): docs/performance.md, "Dataclass constructors".
    def __init__(self, tokens: int, key: int) -> None:
        self.tokens = tokens
        self.key = key


@dataclass(slots=True, init=False, unsafe_hash=True)
class RequestFeatures:
    model: str
    # Estimated: exact for token-id prompts, about 4 characters per token for text.
    prompt_tokens: int
    # The KV a decode instance may have to hold for it: prompt plus the tokens it may generate.
    decode_tokens: int
    # Hashes of growing leading windows (each twice the last), shortest first; the first one
    # places the request for prefix affinity, the longest one an instance was sent tells how
    # much of the prompt it probably has cached.
    prefix_windows: tuple[PrefixWindow, ...]

    # Why a hand-written __init__ (not frozen): docs/performance.md, "Dataclass constructors".
    def __init__(
        self,
        model: str,
        prompt_tokens: int = 0,
        decode_tokens: int = 0,
        prefix_windows: tuple[PrefixWindow, ...] = (),
    ) -> None:
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.decode_tokens = decode_tokens
        self.prefix_windows = prefix_windows

    @property
    def prefix_key(self) -> int | None:
        """A stable 64-bit hash of the prompt's leading block(s), or None without a prompt."""
        return self.prefix_windows[0].key if self.prefix_windows else None
