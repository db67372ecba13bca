"""Serving pdproxy's HTTP protocol (pdproxy/http/server_protocol.py) to raw sockets, for the
tests that check it byte by byte (test_http_protocol.py, test_http_conformance.py).

An ASGI application is served by the protocol on an event loop in a thread of the test
process (asyncio's or uvloop's: uvloop's transports are not asyncio's classes, and the proxy
serves on uvloop). The tests speak to it over loopback; every read has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import uvloop
from uvicorn.config import Config
from uvicorn.server import ServerState

from pdproxy.http.server_protocol import HttpProtocol

HOST = "127.0.0.1"
DATE = b"Wed, 25 Nov 2026 12:00:00 GMT"
LoopKind = Literal["asyncio", "uvloop"]


class Recorder:
    """What the application saw, for the tests to assert on (written on the server's
    thread, read on the test's)."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.send_waits: list[float] = []
        self.changed = threading.Event()

    def note(self, event: str) -> None:
        self.events.append(event)
        self.changed.set()

    def wait_for(self, event: str, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while event not in self.events:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.changed.wait(left)
            self.changed.clear()
        return True


class CountedWrites:
    """Passes everything to the real transport and counts the writes (system calls)."""

    def __init__(self, transport: asyncio.BaseTransport, writes: list[bytes]) -> None:
        self._transport = transport
        self._writes = writes

    def write(self, data: bytes) -> None:
        self._writes.append(bytes(data))
        self._transport.write(data)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CountingProtocol(asyncio.Protocol):
    """The server's protocol with its transport's writes counted. A wrapper, not a subclass:
    the compiled build's HttpProtocol cannot be subclassed by interpreted code."""

    def __init__(self, inner: HttpProtocol, writes: list[bytes]) -> None:
        self._inner = inner
        self._writes = writes

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(CountedWrites(transport, self._writes))  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class Served:
    def __init__(
        self,
        port: int,
        recorder: Recorder,
        state: ServerState,
        loop: asyncio.AbstractEventLoop,
        writes: list[bytes],
    ) -> None:
        self.port = port
        self.recorder = recorder
        self.state = state
        self.loop = loop
        self.writes = writes

    def connect(self) -> contextlib.closing[http.client.HTTPConnection]:
        return contextlib.closing(http.client.HTTPConnection(HOST, self.port, timeout=10))

    def raw(self) -> socket.socket:
        return socket.create_connection((HOST, self.port), timeout=10)

    def shutdown_connections(self) -> None:
        """What uvicorn's server does on a graceful shutdown: `shutdown()` on each
        connection (run on the serving loop, waited for)."""

        async def shutdown() -> None:
            for connection in list(self.state.connections):
                connection.shutdown()

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(5)


@contextlib.contextmanager
def serving(
    app: Any, recorder: Recorder, loop_kind: LoopKind, idle_seconds: int
) -> Iterator[Served]:
    """Serve `app` with pdproxy's protocol on 127.0.0.1 until the block ends; the loop, its
    thread, the connections and the request tasks are all stopped then, even on failure."""
    config = Config(app, lifespan="off", timeout_keep_alive=idle_seconds)
    config.load()
    state = ServerState()
    state.default_headers = [(b"date", DATE)]
    loop = uvloop.new_event_loop() if loop_kind == "uvloop" else asyncio.new_event_loop()
    writes: list[bytes] = []
    holder: dict[str, Any] = {}

    def protocol() -> CountingProtocol:
        return CountingProtocol(HttpProtocol(config, state, {"shared": "state"}, loop), writes)

    async def start() -> None:
        server = await loop.create_server(protocol, HOST, 0, reuse_address=True)
        holder["server"] = server
        holder["port"] = server.sockets[0].getsockname()[1]

    async def stop() -> None:
        holder["server"].close()
        for connection in list(state.connections):
            connection.shutdown()
        for task in list(state.tasks):
            task.cancel()
        await asyncio.sleep(0)

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(start(), loop).result(10)
        yield Served(holder["port"], recorder, state, loop, writes)
    finally:
        if "server" in holder:
            asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


# -- reading what the server sends ----------------------------------------------------------


def read_response(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """One response with a content-length (or none: no body), as raw bytes."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            length = int(value)
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return head + b"\r\n\r\n" + rest


def read_to_close(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything until the server closes; a reset ends it too (what came before is kept)."""
    deadline = time.monotonic() + timeout
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"not closed within {timeout:g}s; got {data[:300]!r}")
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


@dataclass
class Response:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    raw: bytes  # the response's bytes as they came, head and framed body
    trailers: list[tuple[bytes, bytes]] = field(default_factory=list)

    def header(self, name: bytes) -> bytes | None:
        values = self.headers_named(name)
        return values[0] if values else None

    def headers_named(self, name: bytes) -> list[bytes]:
        return [value for key, value in self.headers if key == name.lower()]

    @property
    def closes(self) -> bool:
        return b"close" in (self.header(b"connection") or b"").lower()


class ResponseReader:
    """Reads responses one by one from a raw socket, by their own framing (content-length,
    chunked, or until the connection closes); strict about the layout, so that a response
    out of shape fails the test instead of being skipped over."""

    def __init__(self, sock: socket.socket, timeout: float = 5.0) -> None:
        self._sock = sock
        self._timeout = timeout
        self._buffer = b""
        self.closed = False

    def next(self, head_only: bool = False) -> Response | None:
        """The next response; None if the connection closed cleanly before one began."""
        deadline = time.monotonic() + self._timeout
        if not self._fill(deadline, marker=b"\r\n\r\n"):
            if self._buffer:
                raise AssertionError(f"connection closed inside a response head: {self._buffer!r}")
            return None
        head, _, self._buffer = self._buffer.partition(b"\r\n\r\n")
        status, headers = _parse_head(head)
        raw = head + b"\r\n\r\n"
        if head_only or status < 200 or status in (204, 304):
            return Response(status, headers, b"", raw)
        names = dict(headers)
        if b"content-length" in names:
            length = int(names[b"content-length"])
            if not self._fill(deadline, size=length):
                raise AssertionError(f"body cut short: {self._buffer!r}")
            body, self._buffer = self._buffer[:length], self._buffer[length:]
            return Response(status, headers, body, raw + body)
        if b"chunked" in names.get(b"transfer-encoding", b"").lower():
            return self._chunked(status, headers, raw, deadline)
        self._fill(deadline)  # no length: the body ends with the connection
        body, self._buffer = self._buffer, b""
        return Response(status, headers, body, raw + body)

    def after(self) -> bytes:
        """What follows the responses read, until the server closes (within the timeout)."""
        deadline = time.monotonic() + self._timeout
        self._fill(deadline)
        rest, self._buffer = self._buffer, b""
        return rest

    def _chunked(
        self, status: int, headers: list[tuple[bytes, bytes]], raw: bytes, deadline: float
    ) -> Response:
        body = b""
        while True:
            if not self._fill(deadline, marker=b"\r\n"):
                raise AssertionError(f"chunked body cut short: {raw + body!r}")
            line, _, self._buffer = self._buffer.partition(b"\r\n")
            raw += line + b"\r\n"
            size = int(line, 16)
            if size == 0:
                break
            if not self._fill(deadline, size=size + 2):
                raise AssertionError(f"chunk cut short: {self._buffer!r}")
            chunk, ending = self._buffer[:size], self._buffer[size : size + 2]
            assert ending == b"\r\n", ending
            self._buffer = self._buffer[size + 2 :]
            raw += chunk + ending
            body += chunk
        trailers: list[tuple[bytes, bytes]] = []
        while True:
            if not self._fill(deadline, marker=b"\r\n"):
                raise AssertionError(f"chunked body without its last line: {raw!r}")
            line, _, self._buffer = self._buffer.partition(b"\r\n")
            raw += line + b"\r\n"
            if not line:
                return Response(status, headers, body, raw, trailers)
            name, _, value = line.partition(b":")
            trailers.append((name.lower(), value.strip()))

    def _fill(self, deadline: float, marker: bytes | None = None, size: int | None = None) -> bool:
        """Receive until the buffer holds `marker` or `size` bytes (neither: until the
        connection closes); False if it closed first. A timeout fails the test."""

        def done() -> bool:
            if marker is not None:
                return marker in self._buffer
            return size is not None and len(self._buffer) >= size

        while not done():
            if self.closed:
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"nothing more within {self._timeout:g}s: {self._buffer[:300]!r}"
                )
            self._sock.settimeout(left)
            try:
                chunk = self._sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                self.closed = True
                continue
            self._buffer += chunk
        return True


def _parse_head(head: bytes) -> tuple[int, list[tuple[bytes, bytes]]]:
    lines = head.split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    assert version == b"HTTP/1.1", lines[0]
    status = int(rest[:3])
    headers = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        assert colon and name and name == name.strip(), f"malformed header line {line!r}"
        headers.append((name.lower(), value.strip()))
    return status, headers
