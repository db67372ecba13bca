"""The one pooled HTTP/1.1 client on the data path: asyncio protocols plus httptools' parser.

A proxy needs little of HTTP's client side (POST/GET, keep-alive, Content-Length or chunked
answers, a streamed body with back-pressure), so that is all this module does, behind three
calls: `post`, `get`, `stream`. Why not a library: docs/performance.md, "The upstream client".

Every wait here is bounded by the caller's asyncio.timeout, except connecting, which only the
pool can see and bounds itself. Errors come out as UpstreamError with one of a small, fixed
set of kinds (`Transport`); what each means to the caller is the caller's business.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
from collections import deque
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from enum import StrEnum
from typing import Protocol, cast

import httptools

from pdproxy.http.closed_parsers import CLOSED_RESPONSE_PARSER
from pdproxy.http.slots import Slots

# Idle connections are dropped before uvicorn's default keep-alive (5 s, what vLLM runs with)
# would close them under us.
KEEPALIVE_SECONDS = 4.0
# Back-pressure for a client slower than its instance, bounded per stream. Reading from the
# instance stops while more than HIGH_WATER bytes of its answer are held (queued by the parser,
# plus the piece last handed out until the caller asks for the next one: a relay waiting for
# its client still holds it) and starts again below LOW_WATER. The read that crosses the mark
# is parsed whole, so one read comes on top: the socket's receive buffer, capped at
# RECEIVE_BUFFER (the kernel doubles it), bounds that read, and keeps the kernel from holding
# megabytes for the stalled stream (net.ipv4.tcp_rmem autotuning) while reading pauses.
HIGH_WATER = 64 * 1024
LOW_WATER = 16 * 1024
RECEIVE_BUFFER = 64 * 1024
# Queued pieces are handed out joined up to this size (or one larger parsed piece): a client's
# write buffer takes one piece past its own high-water mark.
HANDED_PIECE = 64 * 1024
# A pooled connection the instance had already closed fails at once; a failure later than this
# after sending may mean the instance read the request, so it is not replayed.
_STALE_WINDOW = 0.25
_OWN_EXHAUSTION = frozenset(
    (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL)
)


class Transport(StrEnum):
    """How an exchange failed below HTTP."""

    CONNECT = "connect"  # refused, unreachable
    CONNECT_TIMEOUT = "connect_timeout"
    RESET = "reset"  # the connection ended before the answer did
    PROTOCOL = "protocol"  # not HTTP/1.1 as httptools reads it
    TOO_LARGE = "too_large"  # the answer exceeds the caller's limit
    # This client's own limits: no free exchange slot, no descriptor or port left.
    SATURATED = "saturated"


class UpstreamError(Exception):
    """An exchange failed below HTTP."""

    def __init__(self, kind: Transport, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


class Reply:
    __slots__ = ("body", "content_type", "status")

    def __init__(self, status: int, content_type: bytes, body: bytes) -> None:
        self.status = status
        self.content_type = content_type
        self.body = body


class _Connection(asyncio.Protocol):
    """One keep-alive connection; carries one exchange at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.sent_at = 0.0
        self._in_exchange = False
        # One parser for the connection's life: a pooled connection is only reused after a
        # whole keep-alive answer, where the parser is ready for the next one.
        self._parser = httptools.HttpResponseParser(self)
        # Kept across exchanges: a connection is only reused once its answer was read whole.
        self._chunks: deque[bytes] = deque()
        self._reset_exchange()

    def _reset_exchange(self) -> None:
        self.status = 0
        # Raw bytes, relayed to the client as they came (a decode and re-encode could change
        # bytes above 0x7F).
        self.content_type = b"application/json"
        self._headers_done = False
        self._complete = False
        self._until_close = True  # neither Content-Length nor chunked: body ends at EOF
        self._keep_alive = True
        self._error: UpstreamError | None = None
        self.held = 0  # bytes queued in _chunks plus the piece last handed out
        self._handed = 0  # the size of that piece: held until the next call for a piece
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._news = False  # the parser found something in the read under way: wake after it
        self.received_any = False

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:  # see RECEIVE_BUFFER; past it the instance's own writes wait
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)

    def data_received(self, data: bytes) -> None:
        if not self._in_exchange:
            # Bytes nobody asked for (a 408 on an idle connection...): never hand them to the
            # next request.
            self.close()
            return
        self.received_any = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(Transport.PROTOCOL, f"malformed HTTP answer: {exc}"))
            self.close()
            return
        if self._news:
            # One wake per read, whatever the parser found in it (a head, body and end often
            # come in one): docs/performance.md, "Calls on the request path".
            self._news = False
            self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        # Frees the connection by its reference count (closed_parsers.py says why).
        self._parser = CLOSED_RESPONSE_PARSER
        if self._headers_done and self._until_close and not self._complete and exc is None:
            self._complete = True  # a clean EOF ends a body without length; a reset does not
            self._wake()
        elif not self._complete:
            detail = f"connection lost: {exc}" if exc else "connection closed by the instance"
            self._fail(UpstreamError(Transport.RESET, detail))

    # -- httptools callbacks -----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"content-type":
            self.content_type = value
        elif lowered in (b"content-length", b"transfer-encoding"):
            self._until_close = False

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self._keep_alive = self._parser.should_keep_alive()
        if self.status in (204, 304) or 100 <= self.status < 200:
            self._until_close = False
        self._headers_done = self._news = True

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self.held += len(body)
        if self.held > HIGH_WATER and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._news = True

    def on_message_complete(self) -> None:
        self._complete = self._news = True

    # -- the exchange ------------------------------------------------------------------------

    async def request(self, head: bytes, body: bytes | None) -> None:
        """Send a request and wait for its answer's status and headers; on any failure (a
        cancellation too) the connection is closed."""
        assert self._transport is not None
        try:
            self._in_exchange = True
            self.sent_at = self._loop.time()
            if body:
                self._transport.writelines((head, body))
            else:
                self._transport.write(head)
            while not self._headers_done:
                await self._wait()
                if self._error is not None:
                    raise self._error  # also when the head came in the same read as the failure
        except BaseException:
            self.close()
            raise

    async def next_chunk(self) -> bytes:
        """The next piece of body as it arrives; b"" at the end."""
        # The caller is done with the piece it had (a relay wrote it to its client, whose own
        # buffer bound applies from there): only now may more of the answer be read.
        self.held -= self._handed
        self._handed = 0
        if self._paused and self.held < LOW_WATER and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        while True:
            if self._chunks:
                chunk = self._chunks.popleft() if len(self._chunks) == 1 else self._drain()
                self._handed = len(chunk)
                return chunk
            if self._complete:
                return b""
            await self._wait()
            if self._error is not None:
                raise self._error  # buffered bytes of a failed answer are not relayed

    async def read_all(self, limit: int) -> bytes:
        """The rest of the body, whole; at most `limit` bytes. (Its own loop, not next_chunk's:
        docs/performance.md, "Calls on the request path".)"""
        self._handed = 0  # a piece handed out before is the caller's now (`held` is reset below)
        chunks = self._chunks
        parts: list[bytes] = []
        size = 0
        while True:
            while chunks:
                chunk = chunks.popleft()
                size += len(chunk)
                if size > limit:
                    raise UpstreamError(Transport.TOO_LARGE, f"answer exceeds {limit} bytes")
                parts.append(chunk)
            self.held = 0
            if self._complete:
                break
            if self._paused and self._transport is not None:
                self._paused = False  # the caller's limit bounds a whole answer, not HIGH_WATER
                self._transport.resume_reading()
            await self._wait()
            if self._error is not None:
                raise self._error
        if len(parts) == 1:
            return parts[0]
        return b"".join(parts)

    def _drain(self) -> bytes:
        """The queued pieces joined (one write for the client instead of many), at most about
        HANDED_PIECE bytes of them: a client's write buffer takes a piece past its own bound."""
        chunks = self._chunks
        if self.held <= HANDED_PIECE:  # nothing is handed out when this runs: all is queued
            chunk = b"".join(chunks)
            chunks.clear()
            return chunk
        parts = [chunks.popleft()]
        size = len(parts[0])
        while chunks and size + len(chunks[0]) <= HANDED_PIECE:
            part = chunks.popleft()
            parts.append(part)
            size += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    @property
    def usable(self) -> bool:
        return not self.closed and self._transport is not None and not self._transport.is_closing()

    @property
    def reusable(self) -> bool:
        return self._complete and self._keep_alive and not self.closed and not self._chunks

    def recycle(self, now: float) -> None:
        self.idle_since = now
        self._in_exchange = False
        self._reset_exchange()

    def _wait(self) -> asyncio.Future[None]:
        """A future for the next event (headers, body, end, failure); raises the failure, if
        there is one. Not a coroutine: the waiting loops await the future itself (one frame
        less to resume per event) and look for a failure when it is done."""
        if self._error is not None:
            raise self._error
        waiter = self._waiter = self._loop.create_future()
        return waiter

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if self._error is None:
            self._error = error
        self._wake()

    def close(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.close()


class _Pool:
    """Idle keep-alive connections to one instance, most recently used first."""

    def __init__(self) -> None:
        self.idle: list[_Connection] = []

    def take(self, now: float) -> _Connection | None:
        while self.idle:
            connection = self.idle.pop()
            if connection.usable and now - connection.idle_since < KEEPALIVE_SECONDS:
                return connection
            connection.close()
        return None

    def prune(self, now: float) -> None:
        fresh = []
        for connection in self.idle:
            if not connection.usable or now - connection.idle_since >= KEEPALIVE_SECONDS:
                connection.close()
            else:
                fresh.append(connection)
        self.idle = fresh


class HostPort(Protocol):
    """Where a request goes: `str()` gives its Host header ("host:port"); equal ones share
    connections."""

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...

    def __hash__(self) -> int: ...


class AnswerStream(Protocol):
    """An answer whose status and headers arrived (an upstream connection, or a test's scripted
    one)."""

    status: int
    content_type: bytes

    async def next_chunk(self) -> bytes: ...

    async def read_all(self, limit: int) -> bytes: ...


class UpstreamClient(Protocol):
    """What the request path asks of the upstream client: `Upstream`, or a test's scripted
    transport (a protocol, so that the compiled build does not insist on the class)."""

    async def post(
        self, address: HostPort, path: str, body: bytes, headers: Mapping[str, str], limit: int
    ) -> Reply: ...

    def stream(
        self,
        method: str,
        address: HostPort,
        path: str,
        body: bytes | None,
        headers: Mapping[str, str],
    ) -> AbstractAsyncContextManager[AnswerStream]: ...


class Upstream:
    def __init__(self, connect_timeout: float, max_connections: int, user_agent: str) -> None:
        """Built inside the event loop it serves: it holds that loop rather than looking it up
        per exchange (docs/performance.md, "Loop and task lookups")."""
        self._loop = asyncio.get_running_loop()
        self._connect_timeout = connect_timeout
        self._slot_count = max_connections
        self._user_agent_line = f"User-Agent: {user_agent}\r\n"
        self._slots = Slots(self._loop, self._slot_count)
        self._pools: dict[HostPort, _Pool] = {}
        self._pruner: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._pruner = asyncio.create_task(self._prune_forever(), name="upstream-prune")

    async def close(self) -> None:
        if self._pruner is not None:
            self._pruner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pruner
            self._pruner = None
        for pool in self._pools.values():
            for connection in pool.idle:
                connection.close()
        self._pools.clear()

    @property
    def congested(self) -> bool:
        """Every upstream slot is taken: a new exchange would wait for one."""
        return self._slots.all_taken()

    async def post(
        self, address: HostPort, path: str, body: bytes, headers: Mapping[str, str], limit: int
    ) -> Reply:
        """POST and read the whole answer (bounded by `limit` bytes)."""
        async with self.stream("POST", address, path, body, headers) as stream:
            return Reply(stream.status, stream.content_type, await stream.read_all(limit))

    async def get(
        self, address: HostPort, path: str, headers: Mapping[str, str], limit: int
    ) -> Reply:
        async with self.stream("GET", address, path, None, headers) as stream:
            return Reply(stream.status, stream.content_type, await stream.read_all(limit))

    def stream(
        self,
        method: str,
        address: HostPort,
        path: str,
        body: bytes | None,
        headers: Mapping[str, str],
    ) -> _StreamCall:
        """`async with upstream.stream(...) as stream:` sends a request and enters once its
        status and headers arrived.

        Leaving the block before the answer was read to its end (error, cancel, client gone)
        closes the connection instead of pooling it, so the instance sees the disconnect and
        aborts the request.
        """
        head = _request_head(method, address, path, body, headers, self._user_agent_line)
        return _StreamCall(self, address, head, body)

    async def _wait_for_slot(self) -> None:
        # Waiting for a free slot is this client's own congestion, not the instance's: it gets
        # its own bound and its own kind, so the caller can tell the two apart.
        try:
            async with asyncio.timeout(self._connect_timeout):
                await self._slots.take()
        except TimeoutError:
            raise UpstreamError(
                Transport.SATURATED,
                f"all {self._slot_count} upstream exchanges stayed busy for "
                f"{self._connect_timeout:g}s",
            ) from None

    async def _connect(self, address: HostPort, loop: asyncio.AbstractEventLoop) -> _Connection:
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, protocol = await loop.create_connection(
                    lambda: _Connection(loop), address.host, address.port
                )
        except TimeoutError:
            raise UpstreamError(
                Transport.CONNECT_TIMEOUT, f"no connection within {self._connect_timeout:g}s"
            ) from None
        except OSError as exc:
            if exc.errno in _OWN_EXHAUSTION:
                # Out of descriptors, buffers or ports: this process's own limit, not the
                # instance's fault.
                raise UpstreamError(
                    Transport.SATURATED, f"pdproxy cannot open a connection: {exc.strerror or exc}"
                ) from None
            raise UpstreamError(
                Transport.CONNECT, f"connection failed: {exc.strerror or exc}"
            ) from None
        return protocol

    async def _prune_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(KEEPALIVE_SECONDS)
            now = loop.time()
            for address in list(self._pools):
                pool = self._pools[address]
                pool.prune(now)
                if not pool.idle:
                    del self._pools[address]


class _StreamCall:
    """Upstream.stream's context manager. (A class, not an async generator: docs/performance.md,
    "Context managers as classes".)"""

    __slots__ = ("_address", "_body", "_connection", "_head", "_upstream")

    def __init__(self, upstream: Upstream, address: HostPort, head: bytes, body: bytes | None):
        self._upstream = upstream
        self._address = address
        self._head = head
        self._body = body
        self._connection: _Connection | None = None

    async def __aenter__(self) -> _Connection:
        upstream = self._upstream
        if not upstream._slots.try_take():
            await upstream._wait_for_slot()
        # Opening here, not in a coroutine of Upstream's: one frame less between the request's
        # task and the socket (docs/performance.md, "Calls on the request path").
        address, head, body = self._address, self._head, self._body
        loop = upstream._loop
        try:
            pool = upstream._pools.get(address)
            pooled = None if pool is None else pool.take(loop.time())
            stale: UpstreamError | None = None
            if pooled is not None:
                try:
                    await pooled.request(head, body)
                    self._connection = pooled
                    return pooled
                except UpstreamError as exc:
                    # A pooled connection the instance closed meanwhile fails at once, before
                    # any byte of answer: the request was never seen, so a fresh connection
                    # may carry it.
                    if pooled.received_any or loop.time() - pooled.sent_at > _STALE_WINDOW:
                        raise
                    stale = exc
            connection = await upstream._connect(address, loop)
            try:
                await connection.request(head, body)
            except UpstreamError as exc:
                if stale is None:
                    raise
                raise UpstreamError(
                    exc.kind, f"{exc.detail} (retried after a pooled connection failed: {stale})"
                ) from None
        except BaseException:
            upstream._slots.give_back()
            raise
        self._connection = connection
        return connection

    async def __aexit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        upstream, connection = self._upstream, self._connection
        assert connection is not None
        try:
            if exc_type is not None or not connection.reusable:
                connection.close()
            else:
                connection.recycle(upstream._loop.time())
                pool = upstream._pools.get(self._address)
                if pool is None:  # not setdefault: that would make a pool per exchange
                    pool = upstream._pools[self._address] = _Pool()
                pool.idle.append(connection)
        finally:
            upstream._slots.give_back()


def _request_head(
    method: str,
    address: HostPort,
    path: str,
    body: bytes | None,
    headers: Mapping[str, str],
    user_agent_line: str,
) -> bytes:
    # One text, encoded once: this runs twice per request.
    parts = [method, " ", path, " HTTP/1.1\r\nHost: ", str(address), "\r\n"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value:
            raise ValueError(f"header {name} contains a line break")
        parts.append(name)
        parts.append(": ")
        parts.append(value)
        parts.append("\r\n")
    parts.append(user_agent_line)
    if body is not None:
        parts.append("Content-Length: ")
        parts.append(str(len(body)))
        parts.append("\r\n")
    parts.append("\r\n")
    return "".join(parts).encode("latin-1")
