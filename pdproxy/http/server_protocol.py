"""pdproxy's HTTP/1.1 connection protocol, plugged into uvicorn's server.

uvicorn keeps what a server needs around connections: binding, the lifespan, signals, the
date header, graceful shutdown (it calls `shutdown()` on every connection, then waits for the
request tasks). This module replaces its per-connection protocol, which is on every request's
path (why, and what it saved: docs/performance.md, "The HTTP protocol"):

- an answer whose length is known goes out in one write (status line, headers and body), not
  one for the head and one for the body;
- a request waits for its body or for the client leaving on one future made on the serving
  loop (an asyncio.Event looks the loop up: docs/performance.md, "Loop and task lookups");
- the response headers are checked in one pass, not with two regular expressions each;
- a request can ask to be told when its client leaves (`on_disconnect`, see DISCONNECT_HOOK)
  instead of keeping a task blocked in receive() for it.

The ASGI behaviour is uvicorn's: keep-alive with its idle timeout, pipelined requests served in
order, `Expect: 100-continue`, chunked bodies both ways, HEAD, back-pressure both ways, a
malformed request answered 400 and closed, an application error answered 500 (or the
connection closed once the answer has started). Upgrades (WebSocket) are not served: the
request is handled as plain HTTP, as uvicorn does without a WebSocket library.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import socket
import struct
import urllib.parse
from collections import deque
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, cast

import httptools
from uvicorn.config import Config
from uvicorn.server import ServerState

from pdproxy.http.closed_parsers import CLOSED_REQUEST_PARSER

log = logging.getLogger("pdproxy.http")

Scope = dict[str, Any]
Message = dict[str, Any]

# scope["extensions"][DISCONNECT_HOOK](callback): callback() runs once if the client leaves
# before the response is complete (never after). Lets the hot path skip a watcher task.
DISCONNECT_HOOK = "pdproxy.on_disconnect"
# scope["extensions"][BODY_RECEIVED] is True if the whole body had arrived when the application
# was called: reading it cannot wait, so it needs no bound (docs/performance.md, "Calls on the
# request path").
BODY_RECEIVED = "pdproxy.body_received"
# scope["extensions"][ANSWER_WHOLE](status, headers, body) -> bool sends a whole answer (its
# headers carry its content-length) in one call instead of two ASGI messages; False, with
# nothing sent, while the client's connection takes no writes (the ASGI way then waits).
ANSWER_WHOLE = "pdproxy.answer_whole"

# Past this much unread request body, reading pauses until the application takes it.
READ_HIGH_WATER = 65536
# Requests parsed ahead while an earlier one is answered; a client pipelining more is cut off
# (one read can carry thousands of small requests).
MAX_PIPELINED = 16
# A request head (request line and header fields) is refused (431) past this many bytes
# received, line ends and empty fields included, or past MAX_HEADERS fields; a head still
# incomplete one idle timeout after it began is closed.
MAX_HEAD_BYTES = 65536
MAX_HEADERS = 100
# Bytes of a request body received without the parser delivering any of it (chunk-size lines,
# chunk extensions, trailer fields): refused (400) past this many.
MAX_FRAMING_BYTES = 65536
# After an answer given before its request's body had arrived, at most this much more of the
# body is read and dropped, within DISCARD_SECONDS in all; past either the connection closes.
MAX_DISCARD_BYTES = 65536
DISCARD_SECONDS = 5.0
# An idle timer that fires this much after its time means the process did not run meanwhile
# (its host stopped or starved it): see HttpProtocol._idle_check.
LATE_WAKE_SECONDS = 0.5

# The checks of a response head map each byte to 1 if allowed, 0 if not (bytes.translate
# with a table made once, one C pass) and refuse a head with a 0 in the result: see
# docs/performance.md, "The HTTP protocol". A header name is a token (RFC 9110); checked on
# all names at once.
_TOKEN = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_TOKEN_MAP = bytes(1 if b in _TOKEN else 0 for b in range(256))
# Anything but control characters; the CR LF that end each line are counted apart and tab is
# allowed in values.
_NOT_CONTROL_MAP = bytes(
    1 if b in b"\t\n\r" or 0x20 <= b < 0x7F or b > 0x7F else 0 for b in range(256)
)
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_LAST_CHUNK = b"0\r\n\r\n"
# SO_LINGER on with a zero timeout: close() resets the connection and drops its send queue.
_LINGER_OFF = struct.pack("ii", 1, 0)


def _status_lines() -> Mapping[int, bytes]:
    lines = {}
    for code in range(100, 600):
        try:
            phrase = http.HTTPStatus(code).phrase.encode()
        except ValueError:
            phrase = b""
        lines[code] = b"HTTP/1.1 %d %s\r\n" % (code, phrase)
    return MappingProxyType(lines)


_STATUS_LINES = _status_lines()


class HttpProtocol(asyncio.Protocol):
    """One client connection. uvicorn builds one per accepted socket (`Config(http=...)`)."""

    # Slots: a fixed set of attributes, each read in one step, whatever their number (a plain
    # instance dict shares its keys only while fewer than 30: docs/performance.md, "The HTTP
    # protocol").
    __slots__ = (
        "_app",
        "_app_state",
        "_body_parser",
        "_client",
        "_cycle",
        "_discard_left",
        "_expect_continue",
        "_framing_bytes",
        "_head_began",
        "_head_bytes",
        "_head_received",
        "_headers",
        "_idle_seconds",
        "_idle_timer",
        "_idle_timer_at",
        "_idle_until",
        "_in_head",
        "_loop",
        "_parser",
        "_parsing",
        "_pipeline",
        "_read_paused",
        "_server",
        "_server_state",
        "_stall_excused",
        "_upgraded",
        "_url",
        "_write_waiters",
        "transport",
        "write_paused",
    )

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if not config.loaded:
            config.load()
        # What uvicorn's own protocol would honour and this one does not: refuse, not ignore.
        if config.is_ssl or config.root_path or config.limit_concurrency is not None:
            raise ValueError(
                "pdproxy's HTTP protocol serves plain HTTP without root_path or limit_concurrency"
            )
        self._app = config.loaded_app
        self._loop = _loop or asyncio.get_event_loop()
        self._server_state = server_state
        self._app_state = app_state
        # float(): uvicorn types it int, and the compiled build would refuse a float setting.
        self._idle_seconds = float(config.timeout_keep_alive)
        self._parser = httptools.HttpRequestParser(self)
        # Lets the first of several pipelined requests be answered even if the client closes.
        self._parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.transport: asyncio.Transport | None = None
        self._server: tuple[str, int] | None = None
        self._client: tuple[str, int] | None = None
        # The idle bound moves with every request; the timer does not. It stays armed for the
        # earliest bound and, when it fires, looks at the bound as it is by then: one timer
        # per idle period instead of a cancel and a new timer for every request.
        self._idle_until: float | None = None  # loop time to close by; None while answering
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_timer_at = 0.0  # when the armed timer fires (meaningful while it is set)
        self._stall_excused = False  # this idle period was extended once after a late wake
        self._read_paused = False
        self.write_paused = False
        self._write_waiters: list[asyncio.Future[None]] = []
        self._cycle: _Cycle | None = None  # the request being answered
        self._pipeline: deque[_Cycle] = deque()  # requests parsed while it is
        # The request being parsed.
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._expect_continue = False
        self._head_bytes = 0  # the head's bytes as the parser delivers them (see _count_head)
        self._head_began: float | None = None  # loop time a head began; None once complete
        self._parsing: _Cycle | None = None
        # Bytes received while a head is due (a request line or header fields): the parser
        # keeps a partial line to itself, so the bound is applied to what it is fed.
        self._in_head = True
        self._head_received = 0
        # Body bytes received since the parser last delivered any body (see MAX_FRAMING_BYTES).
        self._framing_bytes = 0
        # While an answered request's body is still arriving: how much more may be dropped.
        self._discard_left: int | None = None
        # An upgrade request (Upgrade or CONNECT) was parsed: this connection ends with its
        # answer, the parser is not fed again, and `_body_parser` reads the request's body.
        self._upgraded = False
        self._body_parser: httptools.HttpRequestParser | None = None

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._server_state.connections.add(self)  # type: ignore[arg-type]
        # uvloop's TCP transports are not asyncio.Transport subclasses, but behave as one.
        self.transport = cast(asyncio.Transport, transport)
        self._server = _address(transport.get_extra_info("sockname"))
        self._client = _address(transport.get_extra_info("peername"))
        self._idle_from_now()  # a connection that never sends a request is not kept forever

    def connection_lost(self, exc: Exception | None) -> None:
        self._server_state.connections.discard(self)
        self._cancel_idle_timer()
        self.write_paused = False
        self._wake_writers()
        cycle = self._cycle
        if cycle is not None:
            cycle.client_left()
        self._parsing = None
        self._pipeline.clear()
        # Frees the connection by its reference count (closed_parsers.py says why).
        self._parser = CLOSED_REQUEST_PARSER
        if exc is None and self.transport is not None:
            self.transport.close()

    def eof_received(self) -> bool | None:
        # A client that half-closes is taken as gone (as uvicorn does): the transport closes,
        # and an answer in flight is dropped.
        return None

    def data_received(self, data: bytes) -> None:
        if self._upgraded:
            self._receive_after_upgrade(data)
            return
        if self._in_head:
            room = MAX_HEAD_BYTES - self._head_received
            if len(data) < room:
                self._head_received += len(data)
                if not self._feed(data):
                    return
                self._after_read()
                return
            # Fed only up to the bound: the head ends within it or is refused, and the parser
            # never holds more of a partial line than that.
            if not self._feed(data[:room]):
                return
            if self._in_head:
                self._refuse(431, b"Request header fields too large.")
                return
            data = data[room:]
        self._framing_bytes += len(data)
        if self._discard_left is not None:
            self._discard_left -= len(data)
            if self._discard_left < 0:
                self._close()  # an answered request's body that does not end
                return
        if not self._feed(data):
            return
        self._after_read()

    def _after_read(self) -> None:
        if self._framing_bytes > MAX_FRAMING_BYTES and not self._in_head:
            self._refuse(400, b"Invalid HTTP request received.")
            return
        if self._cycle is None and self._discard_left is None:
            # Between requests (a partial request): a head is bounded by one timeout in all,
            # from its first byte. Empty lines before a request line (which the parser skips)
            # begin nothing and leave the idle bound as it is: they cannot keep a connection
            # open. A body dropped after an early answer keeps its bound.
            began = self._head_began
            if began is not None:
                self._idle_by(began + self._idle_seconds)

    def _feed(self, data: bytes) -> bool:
        """Parse `data`; False if the connection was refused or is now past its requests."""
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            self._upgraded = True
            self._receive_after_upgrade(data[upgrade.args[0] :])
            return False
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, _HeadTooLarge):
                log.warning("request head refused: %s", exc.__context__)
                self._refuse(431, b"Request header fields too large.")
            else:
                log.warning("invalid HTTP request received: %s", exc)
                self._refuse(400, b"Invalid HTTP request received.")
            return False
        return True

    def _receive_after_upgrade(self, data: bytes) -> None:
        """The upgrade request's body, if it has one; anything after it is dropped (bounded),
        never parsed as a request: the connection closes with the answer."""
        if not data:
            return
        body_parser = self._body_parser
        if body_parser is None:
            self._drop_after_upgrade(len(data))
            return
        self._framing_bytes += len(data)
        try:
            body_parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self._body_parser is None:
                # The body ended and bytes follow it (its parser is told the connection
                # closes there): dropped, all of `data` counted, as its offset is not told.
                self._drop_after_upgrade(len(data))
            else:
                log.warning("invalid HTTP request body received: %s", exc)
                self._refuse(400, b"Invalid HTTP request received.")
            return
        if self._framing_bytes > MAX_FRAMING_BYTES:
            self._refuse(400, b"Invalid HTTP request received.")

    def _drop_after_upgrade(self, size: int) -> None:
        left = MAX_DISCARD_BYTES if self._discard_left is None else self._discard_left
        self._discard_left = left - size
        if self._discard_left < 0:
            self._close()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_writers()

    # -- httptools callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._discard_left = None  # a new request: the one before it ended whole
        self._url = b""
        self._headers = []
        self._expect_continue = False
        self._head_bytes = 0
        self._head_began = self._loop.time()

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:
            return  # a chunked body's trailer field: not a header of the request, dropped
        # ": " and the line end count too, so that empty fields are not free. (_count_head's
        # work inline: a call less per header field.)
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > MAX_HEAD_BYTES:
            raise _head_too_large()
        if len(self._headers) >= MAX_HEADERS:
            raise _HeadTooLarge(f"more than {MAX_HEADERS} header fields")
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect_continue = True
        self._headers.append((name, value))

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > MAX_HEAD_BYTES:
            raise _head_too_large()

    def on_headers_complete(self) -> None:
        self._head_began = None
        parser = self._parser
        version = parser.get_http_version()
        # Any: httptools' stub types `query` as bytes, and it is None when there is none.
        url: Any = httptools.parse_url(self._url)
        raw_path: bytes = url.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        scope: Scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": version,
            "server": self._server,
            "client": self._client,
            "scheme": "http",
            "method": parser.get_method().decode("ascii"),
            "root_path": "",
            "path": path,
            "raw_path": raw_path,
            "query_string": url.query or b"",
            "headers": self._headers,
            "state": self._app_state.copy(),
        }
        old_client = version == "1.0"
        keep_alive = not old_client and parser.should_keep_alive()
        # HTTP/1.0 knows neither 100 Continue nor chunked bodies (RFC 9110 10.1.1, 9112 6.1).
        # The head is whole and valid (an invalid target raised above, and is a head's fault).
        self._in_head = False
        self._head_received = 0
        self._framing_bytes = 0
        cycle = _Cycle(self, scope, keep_alive, self._expect_continue and not old_client)
        scope["extensions"] = {
            DISCONNECT_HOOK: cycle.on_disconnect,
            ANSWER_WHOLE: cycle.answer_whole,
        }
        self._parsing = cycle
        if parser.should_upgrade():
            # Upgrade (h2c, WebSocket) or CONNECT: served as a plain request and the last on
            # this connection. httptools skips such a request's body and would parse whatever
            # follows as new requests; a parser of its own reads the body instead.
            cycle.keep_alive = False
            self._body_parser = _body_parser(self._headers, _BodyOnly(self))
        if self._cycle is None:
            self._start(cycle)
        else:  # pipelined: answered in order, and no more is read until it is its turn
            if len(self._pipeline) >= MAX_PIPELINED:
                raise ValueError(f"more than {MAX_PIPELINED} requests pipelined")
            self._pause_reading()
            self._pipeline.append(cycle)

    def on_body(self, body: bytes) -> None:
        self._framing_bytes = 0
        cycle = self._parsing
        if cycle is None or cycle.complete:
            return
        cycle.body += body
        if len(cycle.body) > READ_HIGH_WATER:
            self._pause_reading()
        cycle.wake()

    def on_message_complete(self) -> None:
        if self._body_parser is not None and not self._upgraded:
            return  # the upgrade request's body is still to come, through its own parser
        self._in_head = True
        self._framing_bytes = 0
        cycle = self._parsing
        if self._discard_left is not None and cycle is not None and cycle.complete:
            # The body of a request answered early ended within its bounds: the connection
            # idles again until the next request.
            self._discard_left = None
            if self._cycle is None:
                self._idle_from_now()
        if cycle is None or cycle.complete:
            return
        cycle.more_body = False
        cycle.wake()

    # -- uvicorn's server --------------------------------------------------------------------

    def shutdown(self) -> None:
        """Graceful shutdown: idle connections close now, busy ones after their answer."""
        cycle = self._cycle
        if cycle is None or cycle.complete:
            if self.transport is not None:
                self.transport.close()
        else:
            cycle.keep_alive = False

    # -- for the request cycle ---------------------------------------------------------------

    def status_line(self, status: int) -> bytes:
        line = _STATUS_LINES.get(status)
        if line is None:
            raise RuntimeError(f"invalid HTTP status {status!r}")
        return line

    @property
    def default_headers(self) -> list[tuple[bytes, bytes]]:
        return self._server_state.default_headers

    async def writable(self) -> None:
        """Until the transport takes writes again (or the connection is gone)."""
        transport = self.transport
        if not self.write_paused or transport is None or transport.is_closing():
            return
        # One future per waiter: cancelling one waiter must not cancel the others' wait.
        waiter = self._loop.create_future()
        self._write_waiters.append(waiter)
        try:
            await waiter
        finally:
            if waiter in self._write_waiters:
                self._write_waiters.remove(waiter)

    def resume_reading(self) -> None:
        """Read again, unless requests are queued behind the one answered: then reading
        waits for the queue to empty, which bounds it."""
        if self._read_paused and not self._pipeline and self.transport is not None:
            self._read_paused = False
            self.transport.resume_reading()

    def new_future(self) -> asyncio.Future[None]:
        return self._loop.create_future()

    def call_soon(self, callback: Callable[..., None], *args: Any) -> None:
        self._loop.call_soon(callback, *args)

    def answered(self, cycle: _Cycle) -> None:
        """The response of `cycle` is complete: serve the next pipelined request, or idle."""
        self._server_state.total_requests += 1
        if self._cycle is cycle:
            self._cycle = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self._pipeline:
            self._start(self._pipeline.popleft())
        self.resume_reading()  # after taking from the queue: reading waits for it to empty
        if self._cycle is None:
            if cycle.more_body and not self._upgraded:
                # Answered before its body arrived: the rest is dropped, within bounds.
                self._discard_left = MAX_DISCARD_BYTES
                self._idle_by(self._loop.time() + min(DISCARD_SECONDS, self._idle_seconds))
            else:
                self._idle_from_now()

    # -- internals ---------------------------------------------------------------------------

    def _start(self, cycle: _Cycle) -> None:
        self._cycle = cycle
        self._idle_until = None  # an armed idle timer finds no bound when it fires
        self._stall_excused = False  # a request came: a later idle period may be excused again
        tasks = self._server_state.tasks
        task = self._loop.create_task(cycle.run(self._app))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def _pause_reading(self) -> None:
        if not self._read_paused and self.transport is not None:
            self._read_paused = True
            self.transport.pause_reading()

    def _wake_writers(self) -> None:
        waiters, self._write_waiters = self._write_waiters, []
        _release(waiters)

    def _idle_from_now(self) -> None:
        self._idle_by(self._loop.time() + self._idle_seconds)

    def _idle_by(self, when: float) -> None:
        """Close the connection at loop time `when` unless a request starts before."""
        self._idle_until = when
        if self._idle_timer is None or when < self._idle_timer_at:
            self._arm_idle_timer(when)
        # else the armed timer fires first and re-arms for `when`

    def _arm_idle_timer(self, when: float) -> None:
        self._cancel_idle_timer()
        # When it can fire at the earliest: a bound already past (a head that began long ago)
        # fires at once, and is not late for that.
        now = self._loop.time()
        self._idle_timer_at = when if when > now else now
        self._idle_timer = self._loop.call_at(when, self._idle_check)

    def _cancel_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _idle_check(self) -> None:
        self._idle_timer = None
        when = self._idle_until
        if when is None:
            return  # a request is being answered; its end sets a new bound
        now = self._loop.time()
        if when > now:
            self._arm_idle_timer(when)  # the bound moved since this timer was armed
            return
        if (
            now - self._idle_timer_at > LATE_WAKE_SECONDS
            and not self._stall_excused
            and self._discard_left is None  # a body nobody reads is not a request on its way
        ):
            # Woken late: the process did not run (its host stopped it, or its loop was
            # blocked), and a client stopped with it may send its request just after this
            # wake, before the next read. So the connection gets one more idle period (a head
            # under way too) instead of closing under that request; once until a request
            # comes, so that a proxy that never wakes on time still closes.
            self._stall_excused = True
            if self._head_began is not None:
                self._head_began = now
            self._idle_by(now + self._idle_seconds)
            return
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _refuse(self, status: int, message: bytes) -> None:
        """Answer `status` with `message` and close: nothing more is read from a client whose
        request could not be parsed or is out of bounds."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        cycle = self._cycle
        if not self._in_head:
            # The body of the request being parsed is at fault: answered only if that request
            # is the one served now and nothing was answered to it yet; its application then
            # sees the client gone, and cannot answer too.
            parsing = self._parsing
            if parsing is None or parsing is not cycle or parsing.started:
                transport.close()
                return
            parsing.client_left()
        elif cycle is not None and not cycle.complete:
            # An answer is being written on this connection: it cannot be interleaved.
            transport.close()
            return
        head = [self.status_line(status)]
        head.extend(b"%s: %s\r\n" % pair for pair in self.default_headers)
        head.append(
            b"content-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % len(message)
        )
        transport.write(b"".join(head) + message)
        transport.close()


class _HeadTooLarge(ValueError):
    """A request head out of bounds: answered 431, not 400."""


def _head_too_large() -> _HeadTooLarge:
    # Raised inside a parser callback: the parser fails, and the request gets a 431.
    return _HeadTooLarge(f"request head larger than {MAX_HEAD_BYTES} bytes")


class _BodyOnly:
    """The callbacks of an upgrade request's body parser: the body goes to the request."""

    __slots__ = ("_conn",)

    def __init__(self, conn: HttpProtocol) -> None:
        self._conn = conn

    def on_body(self, body: bytes) -> None:
        self._conn.on_body(body)

    def on_message_complete(self) -> None:
        conn = self._conn
        conn._body_parser = None  # the body is whole; the rest of the stream is dropped
        conn.on_message_complete()


def _body_parser(
    headers: list[tuple[bytes, bytes]], callbacks: _BodyOnly
) -> httptools.HttpRequestParser | None:
    """A parser primed with a head that carries only the request's framing headers, so that
    it reads the body exactly as the request declared it and refuses anything after it; None
    if the request declared no body."""
    framing = [(n, v) for n, v in headers if n in (b"content-length", b"transfer-encoding")]
    if all(name == b"content-length" and value.strip() == b"0" for name, value in framing):
        return None
    parser = httptools.HttpRequestParser(callbacks)
    lines = b"".join(b"%s: %s\r\n" % pair for pair in framing)
    parser.feed_data(b"POST / HTTP/1.1\r\nconnection: close\r\n" + lines + b"\r\n")
    return parser


class _Cycle:
    """One request and its response, as the ASGI application sees them."""

    __slots__ = (
        "_body_given",
        "_chunked",
        "_conn",
        "_continue",
        "_head",
        "_head_only",
        "_on_disconnect",
        "_remaining",
        "_transport",
        "_until_close",
        "_waiters",
        "body",
        "complete",
        "disconnected",
        "keep_alive",
        "more_body",
        "scope",
        "started",
    )

    def __init__(
        self, conn: HttpProtocol, scope: Scope, keep_alive: bool, expect_continue: bool
    ) -> None:
        self._conn = conn
        assert conn.transport is not None
        self._transport = conn.transport
        self.scope = scope
        self.keep_alive = keep_alive
        self._continue = expect_continue
        self.body = bytearray()
        self.more_body = True
        self._body_given = False  # the last body message went to the application
        self._waiters: list[asyncio.Future[None]] = []
        self.disconnected = False
        self._on_disconnect: Callable[[], None] | None = None
        self.started = False
        self.complete = False
        self._chunked = False
        self._until_close = False  # an HTTP/1.0 stream: the body ends when the connection does
        self._remaining = 0  # body bytes still due by the declared content-length
        self._head: bytes | None = None  # status line and headers, not yet written
        self._head_only = scope["method"] == "HEAD"

    async def run(self, app: Any) -> None:
        if not self.more_body:
            self.scope["extensions"][BODY_RECEIVED] = True
        try:
            await app(self.scope, self.receive, self.send)
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):  # the server's shutdown gave up
                log.error("unhandled error in the ASGI application", exc_info=exc)
            if not self.complete:
                self._abort()
            if isinstance(exc, asyncio.CancelledError):
                raise
            # Anything else stops here, as in uvicorn: one request must not end the server.
        else:
            if not self.started and not self.disconnected:
                log.error("the ASGI application returned without starting a response")
                self._abort()
            elif not self.complete and not self.disconnected:
                # An application may give up on a client that stopped reading: what it left in
                # the write buffer is a truncated answer, so it is dropped with the connection
                # rather than kept until that client reads it.
                log.warning("the ASGI application returned without completing its response")
                _close_cut_short(self._transport)
        finally:
            self._on_disconnect = None
            # The scope's disconnect hook is this cycle's bound method: a reference cycle,
            # which left every request to the collector (docs/performance.md, "The garbage
            # collector"). The application is done with the hook, so the cycle is cut.
            extensions = self.scope.get("extensions")
            if extensions:
                extensions.pop(DISCONNECT_HOOK, None)
                extensions.pop(ANSWER_WHOLE, None)

    # -- the client side ---------------------------------------------------------------------

    def wake(self) -> None:
        if self._waiters:  # nearly always empty: the body came with the head
            waiters, self._waiters = self._waiters, []
            _release(waiters)

    def client_left(self) -> None:
        if self.complete:
            self.wake()
            return
        self.disconnected = True
        self.wake()
        callback, self._on_disconnect = self._on_disconnect, None
        if callback is not None:
            self._call(callback)

    def on_disconnect(self, callback: Callable[[], None]) -> None:
        """DISCONNECT_HOOK: `callback()` once if the client leaves before the answer is
        complete; soon, if it already has."""
        if self.complete:
            return
        if self.disconnected:
            self._conn.call_soon(self._call, callback)
            return
        self._on_disconnect = callback
        # Reading must go on for the hang-up to be seen (it pauses behind a large body).
        self._conn.resume_reading()

    @staticmethod
    def _call(callback: Callable[[], None]) -> None:
        try:
            callback()
        except Exception:
            log.exception("a disconnect callback failed")

    async def receive(self) -> Message:
        if self._continue:
            self._continue = False
            if not self._transport.is_closing():
                self._transport.write(_CONTINUE)
        while not (self.disconnected or self.complete) and (
            self._body_given or (self.more_body and not self.body)
        ):
            self._conn.resume_reading()
            waiter = self._conn.new_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:  # cancelled before it was woken
                    self._waiters.remove(waiter)
        if self.disconnected or self.complete:
            return {"type": "http.disconnect"}
        body = bytes(self.body)
        self.body.clear()
        if not self.more_body:
            self._body_given = True
            # The whole body is taken: go on reading, so that a hang-up is seen.
            self._conn.resume_reading()
        return {"type": "http.request", "body": body, "more_body": self.more_body}

    # -- the response ------------------------------------------------------------------------

    async def send(self, message: Message) -> None:
        if self._conn.write_paused and not self.disconnected:
            await self._conn.writable()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.started:
            if kind != "http.response.start":
                raise RuntimeError(f"expected 'http.response.start', got {kind!r}")
            self._start(message["status"], message.get("headers", ()))
            return
        if self.complete:
            raise RuntimeError(f"{kind!r} sent after the response was complete")
        if kind != "http.response.body":
            raise RuntimeError(f"expected 'http.response.body', got {kind!r}")
        self._body(message.get("body", b""), message.get("more_body", False))

    def answer_whole(self, status: int, headers: Any, body: bytes) -> bool:
        """ANSWER_WHOLE: what sending the start and the last body message does, in one call
        (docs/performance.md, "Calls on the request path")."""
        if self.disconnected:
            return True  # dropped, as send drops it
        if self._conn.write_paused:
            return False
        if self.started:
            raise RuntimeError("a whole answer after the response started")
        self._start(status, headers)
        self._body(body, False)
        return True

    def _start(self, status: int, headers: Any) -> None:
        conn = self._conn
        if self._continue and self.more_body:
            # Answered before the client sent the body it announced: it may still send it, or
            # not; either way the connection cannot be read reliably after this answer.
            self.keep_alive = False
        if status in (204, 304):
            self._head_only = True  # no body, whatever the application sends
        lines = [conn.status_line(status)]
        names = []
        length: int | None = None
        chunked = has_close = False
        for name, value in conn.default_headers:
            lines.append(name + b": " + value + b"\r\n")
        for raw_name, value in headers:
            name = raw_name.lower()
            if not name:
                raise RuntimeError("empty HTTP header name")
            names.append(name)
            if name == b"content-length":
                if not value.isdigit():
                    raise RuntimeError(f"invalid content-length {value!r}")
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"connection":
                if b"close" not in value.lower():
                    continue  # keeping the connection is the server's call, not a header's
                has_close = True
                self.keep_alive = False
            lines.append(name + b": " + value + b"\r\n")
        if 0 in b"".join(names).translate(_TOKEN_MAP):
            raise RuntimeError("invalid HTTP header name")
        if chunked and length is not None:
            raise RuntimeError("a response cannot have both content-length and chunked encoding")
        if length is None and not chunked and not self._head_only:
            if self.scope["http_version"] == "1.0":
                self._until_close = True  # no chunked encoding before HTTP/1.1
                self.keep_alive = False
            else:
                chunked = True
                lines.append(b"transfer-encoding: chunked\r\n")
        if not self.keep_alive and not has_close:
            lines.append(b"connection: close\r\n")
        lines.append(b"\r\n")
        head = b"".join(lines)
        # Each line ends in the one CRLF put there, and nothing else is a control character:
        # a value with CR, LF or NUL could forge headers of its own.
        lines_ended = head.count(b"\n") == len(lines) == head.count(b"\r")
        if not lines_ended or 0 in head.translate(_NOT_CONTROL_MAP):
            raise RuntimeError("invalid HTTP header value")
        self.started = True
        self._chunked = chunked
        self._remaining = length or 0
        if chunked or self._until_close or self._continue:
            # A stream: its head goes out now, the client may wait long for the first chunk.
            # So does any head while the client waits for 100 Continue before its body.
            self._transport.write(head)
        else:
            self._head = head  # goes out with the body, in the same write
        self._continue = False

    def _body(self, body: bytes, more_body: bool) -> None:
        if self._head_only:
            out = self._head or b""
            self._head = None
        elif self._chunked:
            out = b"%x\r\n%s\r\n" % (len(body), body) if body else b""
            if not more_body:
                out += _LAST_CHUNK
        elif self._until_close:
            out = body
        else:
            if len(body) > self._remaining:
                raise RuntimeError("response body longer than its content-length")
            self._remaining -= len(body)
            head, self._head = self._head, None
            out = head + body if head is not None else body
        if out:
            self._transport.write(out)
        if more_body:
            return
        if self._remaining and not self._head_only:
            raise RuntimeError("response body shorter than its content-length")
        self.complete = True
        self._on_disconnect = None
        self.wake()
        if not self.keep_alive:
            self._transport.close()
        self._conn.answered(self)

    def _abort(self) -> None:
        """Answer 500 if nothing was sent yet; otherwise only closing can end the answer."""
        if self.disconnected:
            return
        if self.started and self._head is None:
            _close_cut_short(self._transport)
            return
        self._head = None  # a head held back was never sent: the 500 replaces it
        self._head_only = self.scope["method"] == "HEAD"
        self.keep_alive = False
        self._continue = False
        headers = ((b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"21"))
        self._start(500, headers)
        self._body(b"Internal Server Error", more_body=False)


def _close_cut_short(transport: asyncio.Transport) -> None:
    """End a connection whose answer was cut short. While the client is not taking what was
    sent (bytes wait in the proxy's buffer), the rest is dropped in the kernel too: a closed
    socket's send queue (megabytes) would otherwise wait for that client to read or leave.
    Otherwise a plain close lets the client read up to the cut."""
    if not transport.get_write_buffer_size():
        transport.close()
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_OFF)
    transport.abort()


def _release(waiters: list[asyncio.Future[None]]) -> None:
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(None)


def _address(info: Any) -> tuple[str, int] | None:
    if isinstance(info, tuple) and len(info) >= 2:
        return str(info[0]), int(info[1])
    return None
