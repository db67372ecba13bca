"""The pooled HTTP/1.1 client against real loopback servers that answer in every shape."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import resource
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from pdproxy.config import Settings
from pdproxy.http import upstream as upstream_module
from pdproxy.http.upstream import Upstream, UpstreamError
from pdproxy.ids import Address

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
HEADERS = {"Content-Type": "application/json", "X-Request-Id": "rid"}


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    body = await reader.readexactly(length) if length else b""
    return head, body


def answer(body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n"
        + extra
        + b"\r\n"
        + body
    )


class Server:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Server:
        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(reader, writer)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        self._address = Address("127.0.0.1", self.server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def address(self) -> Address:
        return self._address


async def with_client(test: Callable[[Upstream], Awaitable[Any]]) -> Any:
    settings = Settings(connect_timeout=2)
    client = Upstream(settings.connect_timeout, settings.upstream_max_connections, "pdproxy/test")
    await client.start()
    try:
        async with asyncio.timeout(20):
            return await test(client)
    finally:
        await client.close()


async def keep_alive_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        _, body = await read_request(reader)
        writer.write(answer(b'{"echo": ' + body + b"}"))
        await writer.drain()


def test_keep_alive_reuses_one_connection() -> None:
    async def scenario() -> None:
        async with Server(keep_alive_echo) as server:

            async def test(client: Upstream) -> None:
                for i in range(5):
                    reply = await client.post(server.address, "/x", b"%d" % i, HEADERS, 1000)
                    assert reply.status == 200
                    assert reply.body == b'{"echo": %d}' % i
                    assert reply.content_type == b"application/json"

            await with_client(test)
            assert server.connections == 1

    asyncio.run(scenario())


def test_content_type_is_kept_byte_for_byte() -> None:
    """What the upstream sent is what the client gets: bytes above 0x7F included (decoded as
    latin-1 and encoded as UTF-8 they would change)."""
    content_type = b"text/plain; charset=x-\xe9"

    async def odd_type(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: " + content_type)
        writer.write(b"\r\nContent-Length: 2\r\n\r\nhi")
        await writer.drain()
        await reader.read()

    async def scenario() -> None:
        async with Server(odd_type) as server:

            async def test(client: Upstream) -> None:
                reply = await client.post(server.address, "/x", b"{}", HEADERS, 1000)
                assert (reply.status, reply.content_type, reply.body) == (200, content_type, b"hi")

            await with_client(test)

    asyncio.run(scenario())


def recording(seen: list[bytes]) -> Handler:
    """A handler that keeps each request it reads (head and body) and answers `{}`."""

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, body = await read_request(reader)
        seen.append(head + body)
        writer.write(answer(b"{}"))
        await writer.drain()

    return record


def test_request_head_carries_headers_and_length() -> None:
    seen: list[bytes] = []
    record = recording(seen)

    async def scenario() -> None:
        async with Server(record) as server:
            await with_client(
                lambda c: c.post(server.address, "/v1/completions", b'{"a":1}', HEADERS, 100)
            )
        request = seen[0]
        assert request.startswith(b"POST /v1/completions HTTP/1.1\r\n")
        assert f"Host: {server.address}\r\n".encode() in request
        assert b"X-Request-Id: rid\r\n" in request
        assert b"Content-Length: 7\r\n" in request
        assert request.endswith(b'\r\n\r\n{"a":1}')

    asyncio.run(scenario())


def test_a_header_with_a_line_break_is_never_sent() -> None:
    """A CR or LF in a header's value would end its line early and forge a header of its
    own: the request is refused before any byte goes out, naming the header."""
    seen: list[bytes] = []
    record = recording(seen)

    async def scenario() -> None:
        async with Server(record) as server:
            for forged in (
                {**HEADERS, "X-Tag": "a\r\nX-Forged: 1"},
                {**HEADERS, "X-Tag": "a\nX-Forged: 1"},
            ):

                async def send(client: Upstream, headers: dict[str, str] = forged) -> None:
                    await client.post(server.address, "/x", b"{}", headers, 100)

                with pytest.raises(ValueError, match=r"header X-Tag contains a line break"):
                    await with_client(send)
            await with_client(lambda c: c.post(server.address, "/x", b"{}", HEADERS, 100))
        assert len(seen) == 1  # only the clean request reached the server
        assert b"X-Forged" not in seen[0]

    asyncio.run(scenario())


def test_chunked_answer_streams_piece_by_piece() -> None:
    release = asyncio.Event()

    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n6\r\nfirst\n\r\n"
        )
        await writer.drain()
        await release.wait()
        writer.write(b"7\r\nsecond\n\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()  # keep the connection until the client leaves

    async def scenario() -> None:
        async with Server(chunked) as server:

            async def test(client: Upstream) -> None:
                async with client.stream("POST", server.address, "/", b"{}", HEADERS) as stream:
                    assert stream.status == 200
                    assert stream.content_type == b"text/event-stream"
                    assert await stream.next_chunk() == b"first\n"  # before the rest exists
                    release.set()
                    assert await stream.next_chunk() == b"second\n"
                    assert await stream.next_chunk() == b""

            await with_client(test)

    asyncio.run(scenario())


def test_body_until_close() -> None:
    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        await writer.drain()

    async def scenario() -> None:
        async with Server(until_close) as server:
            reply = await with_client(lambda c: c.get(server.address, "/", {}, 100))
            assert reply.body == b"all of it"

    asyncio.run(scenario())


def test_closed_upstream_connections_leave_no_reference_cycle() -> None:
    # Each answer closes its connection (as a backend that keeps none alive does): every
    # connection must go with its reference count, not wait for the garbage collector
    # (docs/performance.md, "A reference cycle per request").
    async def one_shot(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer(b"{}", b"Connection: close\r\n"))
        await writer.drain()

    async def scenario() -> list[str]:
        async with Server(one_shot) as server:

            async def test(client: Upstream) -> None:
                for i in range(10):
                    reply = await client.post(server.address, "/x", b"%d" % i, HEADERS, 1000)
                    assert reply.status == 200
                await asyncio.sleep(0.1)  # the last connection's loss is seen

            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                await with_client(test)
                assert server.connections == 10
                gc.collect()
                mine = upstream_module.__name__
                return [type(o).__qualname__ for o in gc.garbage if type(o).__module__ == mine]
            finally:
                gc.set_debug(0)
                gc.garbage.clear()

    assert asyncio.run(scenario()) == []


def test_stale_pooled_connection_is_replaced_transparently() -> None:
    async def once_per_connection(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await read_request(reader)
        writer.write(answer(b"{}"))  # claims keep-alive, then closes anyway
        await writer.drain()

    async def scenario() -> None:
        async with Server(once_per_connection) as server:

            async def test(client: Upstream) -> None:
                for _ in range(3):
                    reply = await client.post(server.address, "/", b"{}", HEADERS, 100)
                    assert reply.status == 200
                    await asyncio.sleep(0.05)  # let the close arrive

            await with_client(test)
            assert server.connections == 3

    asyncio.run(scenario())


def test_reset_mid_body_is_an_error() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
        await writer.drain()

    async def scenario() -> None:
        async with Server(cut) as server:
            with pytest.raises(UpstreamError) as caught:
                await with_client(lambda c: c.post(server.address, "/", b"{}", HEADERS, 1000))
            assert caught.value.kind == "reset"

    asyncio.run(scenario())


def test_refused_connection() -> None:
    async def scenario() -> None:
        async with Server(keep_alive_echo) as server:
            address = server.address
        with pytest.raises(UpstreamError) as caught:
            await with_client(lambda c: c.post(address, "/", b"{}", HEADERS, 100))
        assert caught.value.kind == "connect"

    asyncio.run(scenario())


def test_running_out_of_descriptors_is_the_proxys_saturation_not_the_instances() -> None:
    """EMFILE while connecting: kind `saturated` (no retry, no ejection), not `connect`."""

    async def scenario() -> None:
        async with Server(keep_alive_echo) as server:
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            hoard: list[socket.socket] = []
            try:
                resource.setrlimit(
                    resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard)
                )
                with contextlib.suppress(OSError):
                    while True:
                        hoard.append(socket.socket())
                with pytest.raises(UpstreamError) as caught:
                    await with_client(lambda c: c.post(server.address, "/", b"{}", HEADERS, 100))
            finally:
                for held in hoard:
                    held.close()
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert caught.value.kind == "saturated", caught.value.detail
        assert "pdproxy cannot open a connection" in caught.value.detail

    asyncio.run(scenario())


def test_malformed_answer_is_a_protocol_error() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"THIS IS NOT HTTP\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def scenario() -> None:
        async with Server(garbage) as server:
            with pytest.raises(UpstreamError) as caught:
                await with_client(lambda c: c.post(server.address, "/", b"{}", HEADERS, 100))
            assert caught.value.kind == "protocol"

    asyncio.run(scenario())


def test_a_failure_in_the_same_read_as_the_head_fails_the_head() -> None:
    # Before anything relies on the status (a decode leg's answer counts as given once its
    # head is in, and is then never retried), however TCP splits the bytes.
    async def junk_behind(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer(b"hello") + b"THIS IS NOT HTTP\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def scenario() -> None:
        async with Server(junk_behind) as server:

            async def head(client: Upstream) -> None:
                async with client.stream("POST", server.address, "/", b"{}", HEADERS):
                    pass

            with pytest.raises(UpstreamError) as caught:
                await with_client(head)
            assert caught.value.kind == "protocol"

    asyncio.run(scenario())


def test_answer_over_limit() -> None:
    async def scenario() -> None:
        async with Server(keep_alive_echo) as server:
            with pytest.raises(UpstreamError) as caught:
                await with_client(lambda c: c.post(server.address, "/", b"1" * 500, HEADERS, 100))
            assert caught.value.kind == "too_large"

    asyncio.run(scenario())


# One read on top of the high-water mark: at most what the socket's receive buffer holds (the
# kernel doubles the size asked for).
HELD_BOUND = upstream_module.HIGH_WATER + 2 * upstream_module.RECEIVE_BUFFER


def test_a_whole_answer_past_the_high_water_mark_is_read_whole() -> None:
    """Reading pauses at HIGH_WATER for a stream; a whole answer is bounded by its caller's
    limit instead, so reading goes on until it ends, and the connection is pooled again."""
    pieces = 64  # 4 MiB in 64 KiB writes: many pauses' worth

    async def large(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            _, body = await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (pieces * 65536))
            for index in range(pieces):
                writer.write(body[:1] * 65535 + b"%d" % (index % 10))
                await writer.drain()

    async def scenario() -> None:
        async with Server(large) as server:

            async def test(client: Upstream) -> None:
                for marker in (b"a", b"b"):
                    reply = await client.post(server.address, "/", marker, HEADERS, 8 << 20)
                    assert reply.status == 200
                    assert len(reply.body) == pieces * 65536
                    expected = b"".join(
                        marker * 65535 + b"%d" % (index % 10) for index in range(pieces)
                    )
                    assert reply.body == expected

            await with_client(test)
            assert server.connections == 1  # the second answer came on the pooled connection

    asyncio.run(scenario())


def test_slow_reader_applies_back_pressure() -> None:
    total = 16 * 1024 * 1024

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        piece = b"x" * 65536
        for _ in range(total // len(piece)):
            writer.write(piece)
            await writer.drain()

    async def scenario() -> None:
        async with Server(flood) as server:

            async def test(client: Upstream) -> None:
                async with client.stream("GET", server.address, "/", None, {}) as stream:
                    received = peak = 0
                    while chunk := await stream.next_chunk():
                        received += len(chunk)
                        await asyncio.sleep(0.001)  # a slow client
                        peak = max(peak, stream.held)
                    assert received == total
                    # Reading paused at the high-water mark: held bytes stay bounded.
                    assert peak <= HELD_BOUND

            await with_client(test)

    asyncio.run(scenario())


def test_reading_stays_paused_while_the_caller_holds_a_piece() -> None:
    """A relay whose client does not read holds its last piece: the instance's writes stop
    once a bounded amount is buffered, kernel buffers included, until the next piece is asked
    for; then the whole answer arrives intact, in pieces of bounded size."""
    event = b"data: " + b"y" * 90 + b"\n\n"  # many small SSE events, as vLLM streams them
    events = 100_000  # 9.8 MiB, far more than every buffer on the way together
    written = 0

    async def sse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal written
        # A small send buffer, so that what the test sees is the proxy's buffering.
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(events):
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            written += len(event)
            if writer.transport.get_write_buffer_size() > 65536:
                await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def scenario() -> None:
        async with Server(sse) as server:

            async def test(client: Upstream) -> None:
                async with client.stream("POST", server.address, "/", b"{}", HEADERS) as stream:
                    received = len(await stream.next_chunk())
                    before = -1
                    while before != written:  # until the instance's writes are blocked
                        before = written
                        await asyncio.sleep(0.3)
                    # Beyond what the caller took: the server's own write buffer (64 KiB
                    # before it drains) and socket buffers, and what this client holds.
                    assert written - received <= HELD_BOUND + 512 * 1024
                    assert stream.held <= HELD_BOUND
                    body = [b"x" * received]
                    while chunk := await stream.next_chunk():
                        assert len(chunk) <= upstream_module.HANDED_PIECE
                        body.append(chunk)
                    assert b"".join(body)[received:] == (event * events)[received:]

            await with_client(test)

    asyncio.run(scenario())


def test_leaving_a_stream_early_closes_the_connection() -> None:
    closed = asyncio.Event()

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            while True:
                writer.write(b"2\r\nok\r\n")
                await writer.drain()
                await asyncio.sleep(0.01)
        except ConnectionError:
            closed.set()
            raise

    async def scenario() -> None:
        async with Server(endless) as server:

            async def test(client: Upstream) -> None:
                async with client.stream("POST", server.address, "/", b"{}", HEADERS) as stream:
                    assert await stream.next_chunk()
                async with asyncio.timeout(2):
                    await closed.wait()  # the instance saw us go
                assert not client._pools  # and the connection was not pooled for reuse

            await with_client(test)

    asyncio.run(scenario())


def test_unsolicited_bytes_on_an_idle_connection_are_never_an_answer() -> None:
    async def chatty(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer(b'{"first": true}'))
        await writer.drain()
        await asyncio.sleep(0.05)
        # Then, unasked, what some servers send on idle keep-alive connections.
        writer.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def scenario() -> None:
        async with Server(chatty) as server:

            async def test(client: Upstream) -> None:
                first = await client.post(server.address, "/", b"{}", HEADERS, 100)
                assert first.status == 200
                await asyncio.sleep(0.2)  # the 408 arrives while the connection is idle
                second = await client.post(server.address, "/", b"{}", HEADERS, 100)
                assert second.status == 200 and second.body == b'{"first": true}'

            await with_client(test)
            assert server.connections == 2

    asyncio.run(scenario())


def test_reset_ends_a_body_without_length_as_an_error() -> None:
    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\npart of")
        await writer.drain()
        await asyncio.sleep(0.05)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # RST, not a clean end of the body

    async def scenario() -> None:
        async with Server(reset) as server:
            with pytest.raises(UpstreamError) as caught:
                await with_client(lambda c: c.get(server.address, "/", {}, 100))
            assert caught.value.kind == "reset"

    asyncio.run(scenario())


def test_a_failure_after_the_request_was_read_is_not_replayed() -> None:
    bodies: list[bytes] = []

    async def slow_then_die(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            _, body = await read_request(reader)
            bodies.append(body)
            if len(bodies) == 1:
                writer.write(answer(b"{}"))
                await writer.drain()
                continue
            await asyncio.sleep(0.5)  # works on it a while, then the process dies
            writer.transport.abort()
            return

    async def scenario() -> None:
        async with Server(slow_then_die) as server:

            async def test(client: Upstream) -> None:
                await client.post(server.address, "/", b"1", HEADERS, 100)
                with pytest.raises(UpstreamError):
                    await client.post(server.address, "/", b"2", HEADERS, 100)

            await with_client(test)
            assert bodies == [b"1", b"2"]  # "2" was sent once, never replayed

    asyncio.run(scenario())
