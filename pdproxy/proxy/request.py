"""A client's completion request (completions, chat, or vLLM's token-in/token-out generate):
parsed once, validated just enough to route it, and the
prefill leg's body derived from it. Pure.

Two bounds keep a body the proxy accepts one it can carry: its nesting (what orjson can write
back) and how many JSON values it holds (what parsing it costs in memory: up to about 72 bytes
per value, against about one byte per byte of string).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from pdproxy.proxy.api_bodies import (
    MESSAGES_PATH,
    RESPONSES_ID_FIELD,
    RESPONSES_PATH,
    check_messages,
    check_responses,
    messages_prefill,
    responses_leg_id,
    responses_prefill,
)
from pdproxy.proxy.errors import ProxyError, VllmBadRequest, vllm_bad_request
from pdproxy.proxy.kv_params import PARAMS_FIELD

# The prefill leg must produce exactly one token and return: minimums above 1 are capped.
_MIN_FIELDS = ("min_tokens", "min_completion_tokens")

# orjson reads JSON nested up to 1024 levels but writes at most 254 (its recursion limit,
# pinned by a test): the prefill leg's body is written back, so nothing deeper is accepted.
MAX_DEPTH = 254
# One JSON value per this many bytes of the body limit (2 Mi values for 32 MiB): parsed, a
# value costs up to about 72 bytes (an empty list, a one-character string), so the parsed body
# costs at most about 4.5 times the body limit in values, plus its strings.
BYTES_PER_VALUE = 16
# Every value but the top one follows one of these bytes (an array's first element '[', an
# object's first key '{', a key's value ':', any other element or key ','): their count bounds
# the values, and can be taken before parsing. In strings they count too, which only overcounts.
_VALUE_MARKS = b",:[{"
# vLLM's default max_tokens for /v1/completions (chat has none: until the context is full).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Where vLLM takes extra request arguments from (its SamplingParams.extra_args), which is also
# where connectors read kv_transfer_params from.
XARGS_FIELD = "vllm_xargs"
# vLLM's token-in/token-out endpoint (vllm/entrypoints/scale_out/token_in_token_out): token ids
# in, token ids out; its sampling parameters sit in one object, whose `extra_args` is where the
# connectors read kv_transfer_params (the endpoint copies the top-level field there).
GENERATE_PATH = "/inference/v1/generate"
SAMPLING_FIELD = "sampling_params"
_EXTRA_ARGS_FIELD = "extra_args"


def max_values(max_body_bytes: int) -> int:
    """How many JSON values a body may hold under a body limit of `max_body_bytes`."""
    return max(1, max_body_bytes // BYTES_PER_VALUE)


@dataclass(slots=True, init=False)
class CompletionRequest:
    path: str
    body: bytes  # the client's bytes, sent unchanged on the decode leg
    payload: dict[str, Any]
    model: str
    stream: bool
    # vLLM's token-in/token-out generate (its limits sit in `sampling_params`): judged once,
    # one comparison per request, read as an attribute by every step that differs.
    generate: bool
    # OpenAI's Responses API and Anthropic's Messages API (proxy/api_bodies.py), judged alike.
    responses: bool
    messages: bool
    # The tagged request id of the attempt under way (set by the Dispatcher): Responses legs
    # carry it in their bodies, where vLLM takes that API's engine id from.
    leg_id: str | None

    # Why a hand-written __init__ (not frozen): docs/performance.md, "Dataclass constructors".
    def __init__(
        self, path: str, body: bytes, payload: dict[str, Any], model: str, stream: bool
    ) -> None:
        self.path = path
        self.body = body
        self.payload = payload
        self.model = model
        self.stream = stream
        self.generate = path == GENERATE_PATH
        self.responses = path == RESPONSES_PATH
        self.messages = path == MESSAGES_PATH
        self.leg_id = None

    @property
    def chat(self) -> bool:
        """A list of chat messages holds the prompt (chat completions, Anthropic messages)."""
        return self.messages or self.path.endswith("/chat/completions")

    def prefill_body(self, kv_transfer_params: dict[str, Any] | None = None) -> bytes:
        """The client's request made into a prefill leg: one token, no stream."""
        payload = dict(self.payload)
        if kv_transfer_params is not None:
            payload[PARAMS_FIELD] = kv_transfer_params
        if self.generate:
            # parse_completion made sure it is an object
            payload[SAMPLING_FIELD] = _one_token(dict(payload[SAMPLING_FIELD]))
        elif self.responses:
            responses_prefill(payload)
            if self.leg_id is not None:
                payload[RESPONSES_ID_FIELD] = responses_leg_id(self.leg_id)
            return orjson.dumps(payload)
        elif self.messages:
            messages_prefill(payload)
            return orjson.dumps(payload)
        else:
            _one_token(payload)
        payload["stream"] = False
        payload.pop("stream_options", None)
        return orjson.dumps(payload)

    def decode_body(self, kv_transfer_params: dict[str, Any] | None = None) -> bytes:
        """The client's bytes, unchanged, unless the prefill's KV location must ride along:
        then the same bytes with that one field added before the closing brace (the object
        has at least `model`, and never this field: parse_completion refused it). A Responses
        leg also gets the tagged id as its `request_id` (which clients may not send either)."""
        body = self.body
        if self.responses and self.leg_id is not None:
            body = _with_field(body, RESPONSES_ID_FIELD, responses_leg_id(self.leg_id))
        if kv_transfer_params is None:
            return body
        return _with_field(body, PARAMS_FIELD, kv_transfer_params)

    def context_refusal(self, max_model_len: int) -> bytes | None:
        """vLLM's own 400 body when this request asks for more output tokens than a model of
        `max_model_len` can hold, else None.

        vLLM 0.32 refuses exactly that, whatever the prompt (renderers/params.py); a prompt
        that leaves less room only shortens the output (get_max_tokens), and a prompt that is
        too long alone is refused by the prefill leg already. So this needs no tokenizer and
        refuses nothing vLLM would serve; older vLLM refused prompt + max_tokens beyond the
        context, which a prompt of at least one token makes true here too (its words differ).
        Only JSON integers are judged: vLLM also takes "600" or 600.0, and judges those itself.
        Generate, Responses and Messages requests are left to vLLM: their limits are other
        endpoints' words.
        """
        if self.generate or self.responses or self.messages:
            return None
        param, value = self._output_limit()
        if not isinstance(value, int) or isinstance(value, bool) or value <= max_model_len:
            return None
        message = (
            f"{param}={value} cannot be greater than max_model_len={max_model_len}. "
            f"Please request fewer output tokens. (parameter={param}, value={value})"
        )
        return vllm_bad_request(message, param)

    def _output_limit(self) -> tuple[str, object]:
        """The output limit vLLM checks against the context, and the field it came from: for
        chat max_completion_tokens, else max_tokens; for completions max_tokens, whose
        default is 16 (null: none)."""
        payload = self.payload
        if not self.chat:
            return "max_tokens", payload.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
        value = payload.get("max_completion_tokens")
        if value is not None:
            return "max_completion_tokens", value
        return "max_tokens", payload.get("max_tokens")


def _with_field(body: bytes, name: str, value: object) -> bytes:
    """The JSON object `body` with `name` added before its closing brace (it holds at least
    `model`, and never `name`)."""
    head = body.rstrip(b" \t\r\n")[:-1]
    return b'%s,"%s":%s}' % (head, name.encode(), orjson.dumps(value))


def _one_token(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` (a request body, or generate's sampling_params) capped to one output token."""
    fields["max_tokens"] = 1
    if "max_completion_tokens" in fields:
        fields["max_completion_tokens"] = 1
    for key in _MIN_FIELDS:
        value = fields.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 1:
            fields[key] = 1
    return fields


def parse_completion(
    path: str, body: bytes, value_limit: int = max_values(32 * 1024 * 1024)
) -> CompletionRequest:
    """Raise ProxyError (400; 413 for more than `value_limit` JSON values) unless the body is
    a JSON object naming a model that pdproxy can forward."""
    _check_values(body, value_limit)
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ProxyError(
            400, f"request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    _check_depth(payload)
    if not isinstance(payload, dict):
        raise ProxyError(
            400,
            f"request body must be a JSON object, got {_json_kind(payload)}",
            code="invalid_request",
        )
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise ProxyError(
            400,
            "'model' is required and must be a non-empty string",
            param="model",
            code="missing_model",
        )
    if PARAMS_FIELD in payload:
        # It tells a decode instance where to read KV from: only the proxy may set it.
        raise ProxyError(
            400,
            f"'{PARAMS_FIELD}' is set by pdproxy, not by clients",
            param=PARAMS_FIELD,
            code="invalid_request",
        )
    xargs = payload.get(XARGS_FIELD)
    if isinstance(xargs, dict) and PARAMS_FIELD in xargs:
        # vLLM copies vllm_xargs into the request's extra args, where the connectors read
        # kv_transfer_params: the same field by another door. (Not a map: vLLM refuses it.)
        raise ProxyError(
            400,
            f"'{XARGS_FIELD}.{PARAMS_FIELD}' is set by pdproxy, not by clients",
            param=f"{XARGS_FIELD}.{PARAMS_FIELD}",
            code="invalid_request",
        )
    stream = payload.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise ProxyError(400, "'stream' must be a boolean", param="stream", code="invalid_type")
    request = CompletionRequest(path, body, payload, model, bool(stream))
    if request.generate:
        _check_generate(payload)
    elif request.responses:
        check_responses(payload)
    elif request.messages:
        check_messages(payload)
    return request


def _check_generate(payload: dict[str, Any]) -> None:
    """400, in vLLM's words' shape, unless the body has what vLLM's generate requires and the
    legs need: token ids (a non-empty list of non-negative integers) and a sampling_params
    object, whose extra_args the client may not fill with kv_transfer_params."""
    ids = payload.get("token_ids")
    if ids is None:
        raise VllmBadRequest("'token_ids' is required: a non-empty list of token ids", "token_ids")
    if not isinstance(ids, list) or not ids:
        raise VllmBadRequest(
            f"'token_ids' must be a non-empty list of token ids, got "
            f"{_json_kind(ids) if ids else 'an empty one'}",
            "token_ids",
        )
    for token in ids:
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise VllmBadRequest(
                f"'token_ids' must hold non-negative integers only, got {_shown(token)}",
                "token_ids",
            )
    sampling = payload.get(SAMPLING_FIELD)
    if sampling is None:
        raise VllmBadRequest(
            f"'{SAMPLING_FIELD}' is required: an object such as {{'max_tokens': 16}}",
            SAMPLING_FIELD,
        )
    if not isinstance(sampling, dict):
        raise VllmBadRequest(
            f"'{SAMPLING_FIELD}' must be an object, got {_json_kind(sampling)}", SAMPLING_FIELD
        )
    extra = sampling.get(_EXTRA_ARGS_FIELD)
    if isinstance(extra, dict) and PARAMS_FIELD in extra:
        # vLLM's engine reads the connectors' field there too: only the proxy may set it.
        param = f"{SAMPLING_FIELD}.{_EXTRA_ARGS_FIELD}.{PARAMS_FIELD}"
        raise VllmBadRequest(f"'{param}' is set by pdproxy, not by clients", param)


def _check_values(body: bytes, limit: int) -> None:
    """413 when the body holds more than `limit` JSON values: counted from its bytes before
    parsing, which is what the values would cost (a body shorter than the limit cannot hold
    more values than bytes, and is not even scanned)."""
    if len(body) <= limit:
        return
    marks = len(body) - len(body.translate(None, _VALUE_MARKS))
    if marks >= limit:
        raise ProxyError(
            413,
            f"request body holds more than {limit} JSON values (counted from its , : [ and {{ "
            f"characters; at most one per {BYTES_PER_VALUE} bytes of the body limit)",
            code="too_many_values",
        )


def _check_depth(payload: object) -> None:
    """400 when the payload nests deeper than pdproxy can write back. Writing it is the exact
    test, and the cheapest (docs/performance.md, "Request body checks")."""
    try:
        orjson.dumps(payload)
    except orjson.JSONEncodeError:
        raise ProxyError(
            400,
            f"request body nests JSON deeper than {MAX_DEPTH} levels, which pdproxy cannot forward",
            code="too_deep",
        ) from None


def _shown(value: object) -> str:
    """A value as JSON, cut short (it is the client's, quoted back)."""
    text = orjson.dumps(value).decode()
    return text if len(text) <= 40 else f"{text[:37]}..."


def _json_kind(value: object) -> str:
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return "a number"
