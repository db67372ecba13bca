"""A client's completion request: parsed once, validated just enough to route it, and the
prefill leg's body derived from it. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from pdproxy.proxy.errors import ProxyError
from pdproxy.proxy.kv_params import PARAMS_FIELD

# The prefill leg must produce exactly one token and return: minimums above 1 are capped.
_MIN_FIELDS = ("min_tokens", "min_completion_tokens")


@dataclass(slots=True, init=False)
class CompletionRequest:
    path: str
    body: bytes  # the client's bytes, sent unchanged on the decode leg
    payload: dict[str, Any]
    model: str
    stream: bool

    # A hand-written __init__ (not frozen): see pdproxy/compiled.py on dataclasses.
    def __init__(
        self, path: str, body: bytes, payload: dict[str, Any], model: str, stream: bool
    ) -> None:
        self.path = path
        self.body = body
        self.payload = payload
        self.model = model
        self.stream = stream

    @property
    def chat(self) -> bool:
        return self.path.endswith("/chat/completions")

    def prefill_body(self, kv_transfer_params: dict[str, Any] | None = None) -> bytes:
        """The client's request made into a prefill leg: one token, no stream."""
        payload = dict(self.payload)
        if kv_transfer_params is not None:
            payload[PARAMS_FIELD] = kv_transfer_params
        payload["max_tokens"] = 1
        if "max_completion_tokens" in payload:
            payload["max_completion_tokens"] = 1
        for key in _MIN_FIELDS:
            value = payload.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) and value > 1:
                payload[key] = 1
        payload["stream"] = False
        payload.pop("stream_options", None)
        return orjson.dumps(payload)

    def decode_body(self, kv_transfer_params: dict[str, Any] | None = None) -> bytes:
        """The client's bytes, unchanged, unless the prefill's KV location must ride along."""
        if kv_transfer_params is None:
            return self.body
        return orjson.dumps({**self.payload, PARAMS_FIELD: kv_transfer_params})


def parse_completion(path: str, body: bytes) -> CompletionRequest:
    """Raise ProxyError (400) unless the body is a JSON object naming a model."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ProxyError(
            400, f"request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
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
    stream = payload.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise ProxyError(400, "'stream' must be a boolean", param="stream", code="invalid_type")
    return CompletionRequest(path, body, payload, model, bool(stream))


def _json_kind(value: object) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return "a number"
