"""Failures and delays a test injects into every later completion request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pdproxy.fake_vllm.http_json import ApiError, error_body, json_response


@dataclass(frozen=True, slots=True)
class Behaviour:
    """Injected by POST /_fake/behaviour; applies to every later completion request."""

    status: int | None = None
    error_body: Any = None
    delay_s: float | None = None
    # Cut the connection (no clean end) after this many SSE chunks of a stream. A whole answer
    # is one chunk: 0 cuts it before any byte, a larger count lets it through.
    drop_after_chunks: int | None = None
    # Send a whole answer's headers and half its body, then cut the connection.
    truncate_whole: bool = False
    # A stream answers 200, then (after a chat answer's role-only events) this error as vLLM
    # sends a failure after its status: {"code": int, "message": str}, then [DONE].
    stream_error: dict[str, Any] | None = None

    def response(self) -> web.Response:
        """The injected answer: `error_body` verbatim (a string as raw text), else vLLM-shaped."""
        assert self.status is not None
        if isinstance(self.error_body, str):
            return web.Response(status=self.status, text=self.error_body)
        body = self.error_body
        if body is None:
            body = error_body(self.status, f"fake worker: injected HTTP {self.status}")
        return json_response(body, self.status)

    def as_json(self) -> dict[str, Any]:
        delay_ms = None if self.delay_s is None else self.delay_s * 1000.0
        return {
            "status": self.status,
            "error_body": self.error_body,
            "delay_ms": delay_ms,
            "drop_after_chunks": self.drop_after_chunks,
            "truncate_whole": self.truncate_whole,
            "stream_error": self.stream_error,
        }


def parse_behaviour(body: dict[str, Any]) -> Behaviour:
    """The whole behaviour is replaced: an absent or null field means "normal"."""
    status = body.get("status")
    if status is not None and (
        not isinstance(status, int) or isinstance(status, bool) or not 200 <= status <= 599
    ):
        # 2xx too: a well-formed answer that lacks something (e.g. kv_transfer_params).
        raise ApiError(400, "status must be an integer in 200..599 or null", "status")
    delay_ms = body.get("delay_ms")
    if delay_ms is not None and (
        not isinstance(delay_ms, int | float) or isinstance(delay_ms, bool) or delay_ms < 0
    ):
        raise ApiError(400, "delay_ms must be a non-negative number or null", "delay_ms")
    delay_s = None if delay_ms is None else float(delay_ms) / 1000.0
    drop = body.get("drop_after_chunks")
    if drop is not None and (not isinstance(drop, int) or isinstance(drop, bool) or drop < 0):
        raise ApiError(400, "drop_after_chunks must be a non-negative integer or null", "drop")
    truncate = body.get("truncate_whole", False)
    if not isinstance(truncate, bool):
        raise ApiError(400, "truncate_whole must be a boolean", "truncate_whole")
    stream_error = body.get("stream_error")
    if stream_error is not None and not (
        isinstance(stream_error, dict)
        and isinstance(stream_error.get("code"), int)
        and not isinstance(stream_error.get("code"), bool)
        and isinstance(stream_error.get("message"), str)
    ):
        raise ApiError(
            400, "stream_error must be {code: integer, message: string} or null", "stream_error"
        )
    return Behaviour(status, body.get("error_body"), delay_s, drop, truncate, stream_error)
