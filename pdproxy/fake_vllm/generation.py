"""A completion, chat or token-in/token-out generate request, validated the way vLLM
validates it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdproxy.fake_vllm.http_json import ApiError

DEFAULT_MAX_TOKENS = 16
GENERATE_PATH = "/inference/v1/generate"  # vLLM's token-in/token-out endpoint


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    tokens: int


@dataclass(frozen=True, slots=True)
class Generation:
    """A validated completion, chat or generate (`tokens`) request."""

    chat: bool
    prompts: tuple[Prompt, ...]
    max_tokens: int
    stream: bool
    include_usage: bool
    tokens: bool = False  # /inference/v1/generate: token ids in, token ids out
    # "/v1/responses" or "/v1/messages": chat answered in that API's shape (chat_apis.py)
    api: str = ""
    return_token_ids: bool = False  # vLLM's extension: prompt and output token ids too
    stops: tuple[str, ...] = ()  # stop strings: the output ends before the first one
    include_stop: bool = False  # include_stop_str_in_output

    @property
    def prompt_tokens(self) -> int:
        return sum(p.tokens for p in self.prompts)

    @property
    def unindexed(self) -> bool:
        """Whether vLLM's engine id has no prompt index (chat and generate: one prompt)."""
        return self.chat or self.tokens


def text_prompt(text: str) -> Prompt:
    return Prompt(text, len(text.split()))


def token_prompt(ids: list[Any]) -> Prompt:
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ApiError(400, "prompt token ids must be integers", "prompt")
    return Prompt(" ".join(map(str, ids)), len(ids))


def parse_prompts(value: Any) -> tuple[Prompt, ...]:
    """`prompt`: a string, a list of strings, a list of ints, or a list of lists of ints."""
    if value is None:
        raise ApiError(400, "Field required: prompt", "prompt")
    if isinstance(value, str):
        return (text_prompt(value),)
    if not isinstance(value, list) or not value:
        raise ApiError(400, "prompt must be a string or a non-empty list", "prompt")
    if all(isinstance(item, str) for item in value):
        return tuple(text_prompt(item) for item in value)
    if all(isinstance(item, list) for item in value):
        return tuple(token_prompt(item) for item in value)
    return (token_prompt(value),)


def message_text(message: Any) -> str:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ApiError(400, "each message must be an object with a string 'role'", "messages")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        # OpenAI content parts; only text parts carry prompt text here.
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        )
    raise ApiError(400, "message content must be a string, a list of parts or null", "messages")


def parse_messages(value: Any) -> Prompt:
    """Chat `messages` -> one prompt: the message contents joined by newlines."""
    if value is None:
        raise ApiError(400, "Field required: messages", "messages")
    if not isinstance(value, list) or not value:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    return text_prompt("\n".join(message_text(m) for m in value))


def parse_max_tokens(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ApiError(400, f"{name} must be an integer, got {value!r}", name)
    if value < 1:
        raise ApiError(400, f"{name} must be at least 1, got {value}.", name)
    return value


def check_sampling(body: dict[str, Any]) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        # Loud rather than silently answering one choice where vLLM would answer n.
        raise ApiError(400, f"fake worker supports only n=1, got {n!r}", "n")
    temperature = body.get("temperature")
    if temperature is None:
        return
    if not isinstance(temperature, int | float) or isinstance(temperature, bool):
        raise ApiError(400, f"temperature must be a number, got {temperature!r}", "temperature")
    if temperature < 0:
        raise ApiError(400, f"temperature must be non-negative, got {temperature}.", "temperature")


def parse_stream(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage). vLLM refuses stream_options on a non-streaming request."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, f"stream must be a boolean, got {stream!r}", "stream")
    options = body.get("stream_options")
    if options is None:
        return bool(stream), False
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    if not stream:
        raise ApiError(
            400, "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    return True, bool(options.get("include_usage"))


def check_output_limit(limit: int | None, param: str, max_model_len: int) -> None:
    """vLLM 0.32 (renderers/params.py): more output tokens than the context holds is refused,
    whatever the prompt."""
    if limit is not None and limit > max_model_len:
        raise ApiError(
            400,
            f"{param}={limit} cannot be greater than max_model_len={max_model_len}. Please "
            f"request fewer output tokens. (parameter={param}, value={limit})",
            param,
        )


def fit_context(prompts: tuple[Prompt, ...], max_tokens: int, max_model_len: int) -> int:
    """vLLM 0.32: a prompt longer than the context is refused; otherwise the output is cut to
    what the context leaves (get_max_tokens; for the longest prompt of a batch here)."""
    for prompt in prompts:
        if prompt.tokens > max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"prompt contains {prompt.tokens} input tokens, which exceeds this limit even "
                "without any output tokens. Please reduce the length of the input prompt. "
                f"(parameter=input_tokens, value={prompt.tokens})",
                "input_tokens",
            )
    room = max_model_len - max(prompt.tokens for prompt in prompts)
    if room < 1:
        raise ApiError(
            400,
            f"max_tokens must be at least 1, got {room}. (parameter=max_tokens, value={room})",
            "max_tokens",
        )
    return min(max_tokens, room)


def parse_generation(body: dict[str, Any], chat: bool, max_model_len: int) -> Generation:
    if chat:
        # Like vLLM: max_completion_tokens wins over the deprecated max_tokens.
        completion_max = parse_max_tokens(body, "max_completion_tokens")
        legacy_max = parse_max_tokens(body, "max_tokens")
        max_tokens = completion_max if completion_max is not None else legacy_max
        param = "max_completion_tokens" if completion_max is not None else "max_tokens"
        limit = max_tokens
        prompts: tuple[Prompt, ...] = (parse_messages(body.get("messages")),)
    else:
        max_tokens = parse_max_tokens(body, "max_tokens")
        # vLLM's completions default of 16 counts against the context too (null does not).
        param = "max_tokens"
        limit = max_tokens if "max_tokens" in body else DEFAULT_MAX_TOKENS
        prompts = parse_prompts(body.get("prompt"))
    check_sampling(body)
    stream, include_usage = parse_stream(body)
    check_output_limit(limit, param, max_model_len)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    max_tokens = fit_context(prompts, max_tokens, max_model_len)
    stops, include_stop = parse_stops(body)
    return Generation(
        chat,
        prompts,
        max_tokens,
        stream,
        include_usage,
        return_token_ids=parse_token_ids_flag(body),
        stops=stops,
        include_stop=include_stop,
    )


def parse_token_generation(body: dict[str, Any], max_model_len: int) -> Generation:
    """vLLM 0.32's GenerateRequest (entrypoints/scale_out/token_in_token_out/protocol.py):
    token_ids (non-empty, non-negative) and a sampling_params object are required; the
    output limit is sampling_params.max_tokens (here 16 when unset; vLLM: the context left)."""
    ids = body.get("token_ids")
    if ids is None:
        raise ApiError(400, "Field required: token_ids", "token_ids")
    if not isinstance(ids, list) or not ids:
        raise ApiError(400, "token_ids must be a non-empty list of integers", "token_ids")
    prompt = token_prompt(ids)
    if any(i < 0 for i in ids):
        raise ApiError(400, "token_ids must not contain negative values", "token_ids")
    sampling = body.get("sampling_params")
    if sampling is None:
        raise ApiError(400, "Field required: sampling_params", "sampling_params")
    if not isinstance(sampling, dict):
        raise ApiError(400, "sampling_params must be an object", "sampling_params")
    max_tokens = parse_max_tokens(sampling, "max_tokens")
    check_sampling(sampling)
    stream, include_usage = parse_stream(body)
    check_output_limit(max_tokens, "max_tokens", max_model_len)
    limit = fit_context((prompt,), max_tokens or DEFAULT_MAX_TOKENS, max_model_len)
    return Generation(False, (prompt,), limit, stream, include_usage, tokens=True)


def parse_stops(body: dict[str, Any]) -> tuple[tuple[str, ...], bool]:
    """(stop strings, include_stop_str_in_output); `stop` is a string or a list of them."""
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(item, str) for item in stop):
        stops = tuple(item for item in stop if item)
    else:
        raise ApiError(400, "stop must be a string or a list of strings", "stop")
    return stops, bool(body.get("include_stop_str_in_output"))


def parse_token_ids_flag(body: dict[str, Any]) -> bool:
    value = body.get("return_token_ids")
    if value is not None and not isinstance(value, bool):
        raise ApiError(
            400, f"return_token_ids must be a boolean, got {value!r}", "return_token_ids"
        )
    return bool(value)


def check_model(body: dict[str, Any], served: str) -> None:
    model = body.get("model")
    if model is not None and model != served:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")
