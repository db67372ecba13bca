"""Request migration, the request side (pure): which answers may be continued on another pair,
the decode body that asks upstream for token ids (and, for a whole answer, for a stream the
proxy reads and answers whole), and the continuation request.

A continuation is always a /v1/completions request whose prompt is token ids: the original
prompt's ids followed by the ids generated so far, so the new pair computes exactly the context
the failed decode held (no text is tokenised again), and a greedy request goes on with the
tokens the uninterrupted run would have produced. Its limits are what is still owed. (The ids
after the last clean cut, StreamLedger.settled, are generated again: a prompt that ends inside
a UTF-8 character would give the whole prompt's text back as the continuation's first text.)

With stop strings the continuation is a replay instead: the original prompt's ids alone and the
original limits, so vLLM checks its stop strings over the whole output (one that spans the cut
included) and streams the text it held back while waiting to rule one out (up to the longest
stop string less one character, lost with the failed decode otherwise); the relay takes out
what the client already holds. It costs generating those tokens again.
"""

from __future__ import annotations

import orjson

from pdproxy.proxy.request import COMPLETIONS_DEFAULT_MAX_TOKENS, CompletionRequest

CONTINUATION_PATH = "/v1/completions"
TOKEN_IDS_FIELD = "return_token_ids"

# Fields a continuation drops: the chat prompt and answer's shape (a completions continuation
# has neither), the prompt's echo and logprobs (sent with the first chunk already).
_NOT_CONTINUED = (
    "messages",
    "max_completion_tokens",
    "min_completion_tokens",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "reasoning_effort",
    "include_reasoning",
    "top_logprobs",
    "logprobs",
    "echo",
    "prompt_logprobs",
    "user",
)
# Fields whose state lives in the server across the whole output: a grammar restarted at the
# cut would constrain the continuation from its own start, not from where the output was.
_STATEFUL = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)


def migration_refusal(request: CompletionRequest, whole_min_tokens: int) -> str | None:
    """Why this request's answer cannot be continued on another pair, or None if it can. A
    whole answer that may run fewer than `whole_min_tokens` output tokens is computed again
    from its prompt instead: cheaper than reading every token of every such answer
    (docs/performance.md)."""
    if not request.stream:
        limit = output_limit(request)
        if limit is not None and limit < whole_min_tokens:
            return "a short whole answer"
        if request.payload.get("stream_options") is not None:
            return "stream options without a stream"  # vLLM's own 400, not a stream of ours
        if request.payload.get("prompt_logprobs") is not None:
            return "prompt logprobs"  # kept in the answer vLLM puts together, not in chunks
    if request.generate:
        return "generate"
    if request.responses or request.messages:
        return "responses or messages API"  # their events are not completions chunks
    payload = request.payload
    for field in ("n", "best_of"):
        value = payload.get(field)
        if value is not None and value != 1:
            return f"{field} > 1"
    if any(payload.get(field) is not None for field in _STATEFUL):
        return "structured output"
    if payload.get("echo"):
        return "echo"  # vLLM echoes no prompt text when asked for token ids
    if request.chat:
        if payload.get("tools") and payload.get("tool_choice") != "none":
            return "tools"
        if payload.get("logprobs"):
            return "chat logprobs"
    else:
        prompt = payload.get("prompt")
        # One prompt: a string, or one list of ids (a list of prompts answers several choices).
        if not isinstance(prompt, str) and not (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
        ):
            return "several prompts"
    return None


def upstream_for_migration(request: CompletionRequest) -> CompletionRequest:
    """`request` asking upstream for its prompt's and output's token ids (what a continuation
    is built from), and a whole answer asked for as a stream with its usage (the proxy reads
    it and answers whole); the request itself if it asks for all that already."""
    payload = request.payload
    if request.stream and payload.get(TOKEN_IDS_FIELD) is True:
        return request
    payload = dict(payload)
    payload[TOKEN_IDS_FIELD] = True
    if not request.stream:
        payload["stream"] = True
        payload["stream_options"] = {"include_usage": True}
    return CompletionRequest(request.path, orjson.dumps(payload), payload, request.model, True)


def output_limit(request: CompletionRequest) -> int | None:
    """The most output tokens the client asked for (None: until the context is full)."""
    payload = request.payload
    if request.chat:
        value = payload.get("max_completion_tokens")
        if value is None:
            value = payload.get("max_tokens")
    else:
        value = payload.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def replays(request: CompletionRequest) -> bool:
    """Whether a continuation of `request` starts from its prompt again: with stop strings
    that vLLM checks (and holds text back for) over the whole output."""
    stop = request.payload.get("stop")
    return bool(stop) and not request.payload.get("include_stop_str_in_output")


def continuation(
    original: CompletionRequest, prompt_ids: list[int], generated: list[int]
) -> CompletionRequest | None:
    """The request that generates what is still owed after `generated` (from the prompt
    again when `replays`); None when nothing is owed (the limit is reached)."""
    payload = {k: v for k, v in original.payload.items() if k not in _NOT_CONTINUED}
    if replays(original):
        generated = []
    limit = output_limit(original)
    if limit is not None:
        owed = limit - len(generated)
        if owed < 1:
            return None
        payload["max_tokens"] = owed
    else:
        payload.pop("max_tokens", None)
    minimum = original.payload.get(
        "min_completion_tokens" if original.chat else "min_tokens"
    ) or original.payload.get("min_tokens")
    if isinstance(minimum, int) and not isinstance(minimum, bool) and minimum > 0:
        payload["min_tokens"] = max(0, minimum - len(generated))
    payload["prompt"] = prompt_ids + generated
    payload[TOKEN_IDS_FIELD] = True
    payload["stream"] = True
    if not original.chat and original.payload.get("logprobs") is not None:
        payload["logprobs"] = original.payload["logprobs"]
    return CompletionRequest(
        CONTINUATION_PATH, orjson.dumps(payload), payload, original.model, True
    )
