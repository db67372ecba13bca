"""What the fake "model" outputs for one prompt: its token ids, each token's text, and why it
ended (its length, or a stop string, as vLLM ends it: the text is cut before the stop string
unless include_stop_str_in_output; this fake holds no text back while streaming)."""

from __future__ import annotations

from dataclasses import dataclass

from pdproxy.fake_vllm.deterministic_text import detokenize, next_tokens, tokenize
from pdproxy.fake_vllm.generation import Generation, Prompt


@dataclass(frozen=True, slots=True)
class Output:
    prompt_ids: list[int]
    token_ids: list[int]
    pieces: list[str]  # each token's text (the last one cut at a stop string)
    finish_reason: str
    stop_reason: str | None

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def output_of(prompt: Prompt, generation: Generation) -> Output:
    prompt_ids = tokenize(prompt.text)
    ids = next_tokens(prompt_ids, generation.max_tokens)
    pieces: list[str] = []
    text = ""
    for count, token in enumerate(ids, start=1):
        piece = detokenize(token)
        hit = _first_stop(text + piece, generation.stops, len(text))
        if hit is not None:
            at, stop = hit
            end = at + len(stop) if generation.include_stop else at
            pieces.append((text + piece)[len(text) : max(end, len(text))])
            return Output(prompt_ids, ids[:count], pieces, "stop", stop)
        pieces.append(piece)
        text += piece
    return Output(prompt_ids, ids, pieces, "length", None)


def _first_stop(text: str, stops: tuple[str, ...], old: int) -> tuple[int, str] | None:
    """The earliest stop string in `text` that ends after its first `old` characters."""
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop, max(0, old - len(stop) + 1))
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    return best
