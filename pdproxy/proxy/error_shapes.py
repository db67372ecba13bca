"""How each API the proxy disaggregates writes the errors pdproxy itself produces, and how its
event stream ends: the OpenAI APIs (completions, chat, generate), OpenAI's Responses API, and
Anthropic's Messages API. Pure.

A whole error answer is the API's own error body. An error after the stream started (the
status is out: only an event can follow) is the API's own error event: a `data:` error and
`[DONE]` for completions and chat, an `error` event for Responses and Messages, whose streams
end with an event of their own (`response.completed`, `message_stop`) and no `[DONE]`.
"""

from __future__ import annotations

import orjson

from pdproxy.proxy.errors import ProxyError, error_body

SSE_DONE = b"data: [DONE]\n\n"

# Anthropic's error types (its API's "errors" page); 408 and 504 are Anthropic's timeout.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}
# The events after which a Responses stream holds a whole answer (completed, cut short by its
# limit, or failed on the instance).
_RESPONSES_LAST = (
    b"event: response.completed\n",
    b"event: response.incomplete\n",
    b"event: response.failed\n",
)
_MESSAGES_LAST = b"event: message_stop\n"


class ErrorShape:
    """The OpenAI shape; subclasses write the other APIs'."""

    def body(self, error: ProxyError) -> bytes:
        """The whole answer's body for `error`."""
        return error.body()

    def stream_tail(self, error: ProxyError) -> bytes:
        """What ends a stream that fails after it started."""
        event = error_body(error.status, error.message, code=error.code)
        return b"data: " + event + b"\n\n" + SSE_DONE

    def completes(self, chunk: bytes) -> bool:
        """Whether the client holds a whole stream once `chunk` (relayed as the instance sent
        it) went out: a later hang-up is then no abandonment."""
        return chunk.endswith(SSE_DONE)


class ResponsesShape(ErrorShape):
    """OpenAI's Responses API: errors in OpenAI's body (as vLLM answers them); in a stream an
    `error` event (`type`, `code`, `message`, `param`). Its `sequence_number` is left out: the
    proxy relays the instance's events without counting them, and a wrong number would be
    worse than none."""

    def stream_tail(self, error: ProxyError) -> bytes:
        code = error.code if error.code is not None else str(error.status)
        event = orjson.dumps(
            {"type": "error", "code": code, "message": error.message, "param": error.param}
        )
        return b"event: error\ndata: " + event + b"\n\n"

    def completes(self, chunk: bytes) -> bool:
        return any(marker in chunk for marker in _RESPONSES_LAST)


class AnthropicShape(ErrorShape):
    """Anthropic's Messages API: `{"type": "error", "error": {"type", "message"}}`, whole or as
    an `error` event."""

    def body(self, error: ProxyError) -> bytes:
        return anthropic_error_body(error.status, error.message)

    def stream_tail(self, error: ProxyError) -> bytes:
        return b"event: error\ndata: " + self.body(error) + b"\n\n"

    def completes(self, chunk: bytes) -> bool:
        return _MESSAGES_LAST in chunk


def anthropic_error_body(status: int, message: str) -> bytes:
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


OPENAI_SHAPE = ErrorShape()
RESPONSES_SHAPE = ResponsesShape()
ANTHROPIC_SHAPE = AnthropicShape()
