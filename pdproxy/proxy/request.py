"""A client's completion request: parsed once, validated just enough to route it, and the
prefill leg's body derived from it. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from pdproxy.proxy.errors import ProxyError

# The prefill leg must produce exactly one token and return: minimums above 1 are capped.
_MIN_FIELDS = ("min_tokens", "min_completion_tokens")


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    path: str
    body: bytes  # the client's bytes, sent unchanged on the decode leg
    payload: dict[str, Any]
    model: str
    stream: bool

    def prefill_body(self) -> bytes:
        """The client's request made into a prefill leg: one token, no stream."""
        payload = dict(self.payload)
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
