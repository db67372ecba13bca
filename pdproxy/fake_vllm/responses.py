"""vLLM-shaped response bodies for a whole (non-streamed) completion, chat completion or
token-in/token-out generation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdproxy.fake_vllm.deterministic_text import generated_token_ids
from pdproxy.fake_vllm.generation import Generation
from pdproxy.fake_vllm.output import Output, output_of


@dataclass(frozen=True, slots=True)
class Envelope:
    """The fields every response object and chunk of one request shares."""

    id: str
    created: int
    model: str

    def wrap(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        return {**body, "choices": choices, **extra}


def usage(generation: Generation, outputs: list[Output] | None = None) -> dict[str, Any]:
    prompt_tokens = sum(p.tokens for p in generation.prompts)
    if outputs is None:
        completion_tokens = generation.max_tokens * len(generation.prompts)
    else:
        completion_tokens = sum(len(output.token_ids) for output in outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


def full_response(env: Envelope, generation: Generation) -> dict[str, Any]:
    choices = []
    outputs = [output_of(prompt, generation) for prompt in generation.prompts]
    for index, output in enumerate(outputs):
        choice: dict[str, Any] = {"index": index}
        if generation.chat:
            choice["message"] = {"role": "assistant", "content": output.text}
        else:
            choice["text"] = output.text
        choice |= {
            "logprobs": None,
            "finish_reason": output.finish_reason,
            "stop_reason": output.stop_reason,
        }
        if generation.return_token_ids:
            # vLLM: completions name each choice's prompt ids, chat the response's.
            if not generation.chat:
                choice["prompt_token_ids"] = output.prompt_ids
            choice["token_ids"] = output.token_ids
        choices.append(choice)
    obj = "chat.completion" if generation.chat else "text_completion"
    extra: dict[str, Any] = {"usage": usage(generation, outputs)}
    if generation.chat and generation.return_token_ids:
        extra["prompt_token_ids"] = outputs[0].prompt_ids
    return env.wrap(obj, choices, **extra)


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
