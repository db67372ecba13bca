"""One client exchange at the ASGI level: read the body, watch for the client leaving, send
exactly one complete response (or, once streaming, end the stream cleanly on failure).

The completion endpoints bypass FastAPI and speak ASGI directly: this object is the small
amount of Starlette's StreamingResponse they need, plus a disconnect watch that cancels the
request's task, so an abandoned request stops its upstream legs at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

from pdproxy.http.server_protocol import ANSWER_WHOLE, BODY_RECEIVED, DISCONNECT_HOOK
from pdproxy.proxy.error_shapes import OPENAI_SHAPE, ErrorShape
from pdproxy.proxy.errors import ProxyError
from pdproxy.proxy.migration_stream import StreamLedger

Scope = dict[str, Any]
Message = dict[str, Any]
Headers = list[tuple[bytes, bytes]]

JSON = b"application/json"
# How long a failed stream's last event may wait for a client that stopped reading (its
# write buffer is full); after that the stream is left unfinished and its connection closed.
LAST_EVENT_SECONDS = 5.0


@dataclass(slots=True, init=False, unsafe_hash=True)
class ClientHeaders:
    """The few request headers the proxy reads."""

    request_id: bytes | None  # X-Request-Id, echoed back, never sent upstream
    authorization: str | None
    content_length: int | None
    traceparent: str | None
    tracestate: str | None

    # Why a hand-written __init__ (not frozen): docs/performance.md, "Dataclass constructors".
    def __init__(
        self,
        request_id: bytes | None = None,
        authorization: str | None = None,
        content_length: int | None = None,
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.authorization = authorization
        self.content_length = content_length
        self.traceparent = traceparent
        self.tracestate = tracestate


@dataclass(slots=True, init=False)
class RequestNotes:
    """What the access log says about one request, filled in as it goes."""

    model: str | None
    stream: bool | None
    prefill: str | None  # the chosen instances' names (http addresses)
    decode: str | None
    direct: bool  # conditional disaggregation: no prefill leg
    concurrent: bool  # the decode leg was sent with the prefill leg, not after it
    prefill_seconds: float | None
    decode_first_byte_seconds: float | None
    error: str | None  # the error code the client got
    attempts: int
    migrations: int  # times the stream was continued on another pair
    trace_id: str | None

    # Why a hand-written __init__ (not frozen): docs/performance.md, "Dataclass constructors".
    def __init__(self) -> None:
        self.model = None
        self.stream = None
        self.prefill = None
        self.decode = None
        self.direct = False
        self.concurrent = False
        self.prefill_seconds = None
        self.decode_first_byte_seconds = None
        self.error = None
        self.attempts = 1
        self.migrations = 0
        self.trace_id = None


class ClientGone(Exception):
    """The client disconnected before its request was read."""


class Exchange:
    def __init__(
        self,
        scope: Scope,
        receive: Any,
        send: Any,
        echo_id: bytes | None,
        task: asyncio.Task[Any],
        arrived: float,
        shape: ErrorShape = OPENAI_SHAPE,
    ) -> None:
        # The request's task, looked up once: its deadlines cancel it (see proxy.deadline).
        self.task = task
        self.arrived = arrived  # time.perf_counter() when the request came in
        self._scope = scope
        self._receive = receive
        self._send = send
        self._echo_id = echo_id
        self._shape = shape  # the API's error bodies and events (proxy/error_shapes.py)
        self.status = 0
        self.started = False
        # complete: the client holds a whole answer (a later hang-up is not an abandonment);
        # ended: the last body message went out (nothing more may be sent).
        self.complete = False
        self.ended = False
        self.client_gone = False
        self.body_read = False
        self.request_id = ""  # the tagged id, once a pair was chosen (for logs)
        self.deadline = float("inf")  # event-loop time by which the whole request must end
        self.notes = RequestNotes()
        # With migration on, a streamed answer's relay state across its decode legs.
        self.ledger: StreamLedger | None = None
        self._streaming = False
        self._watcher: asyncio.Task[None] | None = None
        self._watching = False

    # -- request -----------------------------------------------------------------------------

    async def read_body(self, limit: int, declared_length: int | None) -> bytes:
        if declared_length is not None and declared_length > limit:
            raise _too_large(limit)
        message = await self._receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        body: bytes = message.get("body", b"")
        if len(body) > limit:
            raise _too_large(limit)
        if not message.get("more_body", False):
            self.body_read = True
            return body
        parts = [body]
        size = len(body)
        while message.get("more_body", False):
            message = await self._receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            parts.append(chunk)
        self.body_read = True
        return b"".join(parts)

    def body_received(self) -> bool:
        """Whether the server had the whole body when the request began (pdproxy's own server
        says so): read_body then cannot wait."""
        extensions = self._scope.get("extensions")
        return bool(extensions and extensions.get(BODY_RECEIVED))

    def watch_disconnect(self) -> None:
        """From now on, a client disconnect cancels the request's task (call after read_body).

        pdproxy's own HTTP server calls back when the client leaves; under any other ASGI
        server a task waits in receive() for the disconnect message instead."""
        self._watching = True
        hook = self._scope.get("extensions", {}).get(DISCONNECT_HOOK)
        if hook is not None:
            hook(self._client_left)
            return
        self._watcher = self.task.get_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self._client_left()
                return

    def _client_left(self) -> None:
        # The server also reports "disconnect" once our response is complete.
        if self._watching and not self.complete:
            self.client_gone = True
            self.task.cancel()

    def stop_watching(self) -> None:
        self._watching = False
        if self._watcher is not None and not self._watcher.done():
            self._watcher.cancel()
        self._watcher = None

    @property
    def client_id(self) -> str | None:
        """The client's own X-Request-Id, if it sent one (for logs)."""
        return None if self._echo_id is None else self._echo_id.decode("latin-1")

    # -- response ----------------------------------------------------------------------------

    def _headers(self, content_type: bytes, extra: tuple[tuple[bytes, bytes], ...]) -> Headers:
        headers = [(b"content-type", content_type)]
        # The client's own id if it sent one (kept for its logs), else the tagged id.
        echo = self._echo_id or self.request_id.encode()
        if echo:
            headers.append((b"x-request-id", echo))
        headers.extend(extra)
        return headers

    async def start_stream(self, status: int, content_type: bytes) -> None:
        self.status = status
        self.started = True
        self._streaming = True
        await self._send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": self._headers(content_type, ((b"cache-control", b"no-cache"),)),
            }
        )

    async def start_body(self, status: int, content_type: bytes) -> None:
        """Start an answer whose body follows in pieces and is not an event stream: a
        failure after this can only cut it short (`fail` adds nothing to it)."""
        self.status = status
        self.started = True
        await self._send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": self._headers(content_type, ()),
            }
        )

    async def chunk(self, data: bytes) -> None:
        if self._shape.completes(data):
            # The client holds a whole stream now and may hang up before the upstream's EOF
            # reaches us: that is a completed request, not an abandoned one.
            self.complete = True
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end_stream(self, data: bytes = b"") -> None:
        self.complete = self.ended = True
        await self._send({"type": "http.response.body", "body": data, "more_body": False})

    async def whole(
        self,
        status: int,
        content_type: bytes,
        body: bytes,
        extra: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        self.status = status
        self.started = True
        headers = self._headers(content_type, extra)
        headers.append((b"content-length", str(len(body)).encode()))
        extensions = self._scope.get("extensions")
        answer = extensions.get(ANSWER_WHOLE) if extensions else None
        if answer is not None and answer(status, headers, body):  # pdproxy's own server
            self.complete = self.ended = True
            return
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        self.complete = self.ended = True
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    async def fail(self, error: ProxyError) -> None:
        """Answer with an error in the API's shape, or end a stream already under way with the
        API's error event (its status can no longer change). A stream whose last event already
        went out is just closed properly: the client has its whole answer."""
        if self.ended:
            return
        if self._streaming:
            tail = b""
            if not self.complete:
                tail = self._shape.stream_tail(error)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(LAST_EVENT_SECONDS):  # rare: no Deadline needed
                    await self.end_stream(tail)
            return
        if self.started:  # headers out, body not: nothing valid can follow
            return
        await self.whole(error.status, JSON, self._shape.body(error), error.headers)


def _too_large(limit: int) -> ProxyError:
    return ProxyError(
        413, f"request body is larger than the limit of {limit} bytes", code="body_too_large"
    )
