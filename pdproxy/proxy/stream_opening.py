"""How a streamed answer opens, read before the client is sent any of it. Pure.

vLLM answers a stream with 200 before it generates anything; a request that then fails (a KV
transfer that broke, an engine error) gets vLLM's error as an event of the stream,
`data: {"error": {...}}`, the first one after a chat answer's role-only events. Relayed, it
would end the client's stream with an error that no token preceded, where the same failure of a
whole answer (an HTTP 500) is retried on another pair. So the proxy reads on until the first
event that is neither, and treats a server error there as a failed leg: nothing has reached the
client yet. An error the instance blames on the request (a 4xx code) is its own answer, relayed.
"""

from __future__ import annotations

from enum import Enum

import orjson

# Read ahead looking for the first token event, at most: past it the stream is relayed as it is.
MAX_OPENING_BYTES = 65536
_EVENT_END = b"\n\n"
_CRLF_EVENT_END = b"\r\n\r\n"
_ERROR_EVENT = b'data: {"error"'
# The role-only delta vLLM opens each chat choice with (compact JSON, as vLLM writes it).
_ROLE_ONLY = b'"delta":{"role":"assistant","content":""}'
_MAX_DETAIL = 200


class Opening(Enum):
    MORE = "more"  # no verdict yet: read on
    RELAY = "relay"  # an answer under way (or one to relay as it is): relay what was read
    FAILED = "failed"  # the instance failed the request before its first token


def read_opening(held: bytes) -> tuple[Opening, str]:
    """The verdict on a stream's first bytes `held`, and for FAILED the instance's message."""
    start = 0
    while True:
        end, size = held.find(_EVENT_END, start), len(_EVENT_END)
        # SSE allows CRLF line ends too; such an event's end can only come before `end`.
        crlf = held.find(_CRLF_EVENT_END, start, end if end >= 0 else len(held))
        if crlf >= 0:
            end, size = crlf, len(_CRLF_EVENT_END)
        if end < 0:
            # An event not ended yet: read on, up to the bound; past it (role events and no
            # verdict, an endless event) the bytes are relayed as they are.
            return (Opening.MORE if len(held) < MAX_OPENING_BYTES else Opening.RELAY), ""
        event = held[start:end]
        if event.startswith(_ERROR_EVENT):
            return _error_verdict(event)
        if _ROLE_ONLY not in event:
            return Opening.RELAY, ""
        start = end + size


def _error_verdict(event: bytes) -> tuple[Opening, str]:
    try:
        error = orjson.loads(event[len(b"data: ") :])["error"]
    except (orjson.JSONDecodeError, TypeError, KeyError):
        return Opening.FAILED, "an unreadable error event"
    if not isinstance(error, dict):
        return Opening.FAILED, str(error)[:_MAX_DETAIL]
    code = error.get("code")
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 500:
        return Opening.RELAY, ""  # the request's own fault: another instance would say the same
    message = error.get("message")
    return Opening.FAILED, (message if isinstance(message, str) else str(message))[:_MAX_DETAIL]
