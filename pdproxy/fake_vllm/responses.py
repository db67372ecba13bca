"""vLLM-shaped response bodies for a whole (non-streamed) completion, chat completion or
token-in/token-out generation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdproxy.fake_vllm.deterministic_text import generated_token_ids, generated_words
from pdproxy.fake_vllm.generation import Generation


@dataclass(frozen=True, slots=True)
class Envelope:
    """The fields every response object and chunk of one request shares."""

    id: str
    created: int
    model: str

    def wrap(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        return {**body, "choices": choices, **extra}


def usage(generation: Generation) -> dict[str, Any]:
    prompt_tokens = sum(p.tokens for p in generation.prompts)
    completion_tokens = generation.max_tokens * len(generation.prompts)
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


def full_response(env: Envelope, generation: Generation) -> dict[str, Any]:
    choices = []
    for index, prompt in enumerate(generation.prompts):
        text = "".join(f" {w}" for w in generated_words(prompt.text, generation.max_tokens))
        if generation.chat:
            message = {"role": "assistant", "content": text}
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                }
            )
        else:
            choices.append(
                {
                    "index": index,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                }
            )
    obj = "chat.completion" if generation.chat else "text_completion"
    return env.wrap(obj, choices, usage=usage(generation))


def tokens_envelope(env: Envelope) -> dict[str, Any]:
    """What vLLM 0.32's generate answers (GenerateTokensResponse) carry besides choices."""
    return {"request_id": env.id, "model": env.model, "created": env.created}


def tokens_response(env: Envelope, generation: Generation) -> dict[str, Any]:
    """/inference/v1/generate's whole answer (output_mode "tokens"): token ids only."""
    prompt = generation.prompts[0]
    choice = {
        "index": 0,
        "finish_reason": "length",
        "stop_reason": None,
        "token_ids": generated_token_ids(prompt.text, generation.max_tokens),
        "logprobs": None,
    }
    return {
        **tokens_envelope(env),
        "usage": usage(generation),
        "prompt_logprobs": None,
        "output_mode": "tokens",
        "choices": [choice],
    }
