"""pdproxy's HTTP/1.1 protocol (pdproxy/http/server_protocol.py) over real loopback sockets.

A small ASGI application is served by the protocol on an event loop in a thread (the harness
is http_harness.py); the tests speak HTTP to it with http.client and with raw sockets where the
byte layout matters (pipelining, 100-continue, malformed requests, one write per answer). The
conformance suite (test_http_conformance.py) covers the rest of HTTP/1.1's ground.
"""

from __future__ import annotations

import asyncio
import gc
import http.client
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pdproxy.demo.processes import wait_until
from pdproxy.http.server_protocol import (
    ANSWER_WHOLE,
    BODY_RECEIVED,
    DISCONNECT_HOOK,
    MAX_HEAD_BYTES,
    MAX_PIPELINED,
)
from tests.integration.http_harness import (
    Recorder,
    Served,
    read_response,
    read_to_close,
    serving,
)
from tests.integration.support import closed_by_peer, read_until

IDLE_SECONDS = 1
BIG = 8 * 1024 * 1024


class Fatal(BaseException):
    """Not an Exception: what a task may still end with (GeneratorExit, exception groups)."""


async def _read_all(receive: Any) -> bytes:
    parts = []
    while True:
        message = await receive()
        assert message["type"] == "http.request"
        parts.append(message["body"])
        if not message["more_body"]:
            return b"".join(parts)


def _app(recorder: Recorder) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return
        path = scope["path"]
        if path == "/slow":
            await asyncio.sleep(0.2)
        if path == "/longer-than-idle":
            await asyncio.sleep(IDLE_SECONDS * 1.5)
        if path == "/boom":
            raise ValueError("the application failed before answering")
        if path == "/fatal":
            raise Fatal("not an Exception")
        if path == "/exit":
            raise SystemExit(3)  # must not end the server's loop
        if path == "/early":  # answers without reading the body the client announced
            headers = [(b"content-length", b"5")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b"early"})
            return
        if path == "/headers":  # the request's header fields, one "name: value" a line
            body = await _read_all(receive)
            answer = b"".join(b"%s: %s\n" % pair for pair in scope["headers"]) + b"|" + body
            headers = [(b"content-length", b"%d" % len(answer))]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": answer})
            return
        if path == "/body-received":  # what the server said of the body when the app began
            said = scope["extensions"].get(BODY_RECEIVED)
            body = await _read_all(receive)
            answer = b"%r|%s" % (said, body)
            headers = [(b"content-length", b"%d" % len(answer))]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": answer})
            return
        if path == "/huge-whole":  # one send past the write buffer's high-water mark
            headers = [(b"content-length", str(BIG).encode())]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b"h" * BIG})
            return
        if path == "/whole":  # as pdproxy's endpoint answers: in one call when it can
            body = await _read_all(receive)
            answer = b"whole|" + body
            headers = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(answer))]
            done = scope["extensions"][ANSWER_WHOLE](200, headers, answer)
            recorder.note(f"answered whole: {done}")
            if not done:
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                await send({"type": "http.response.body", "body": answer})
            return
        if path == "/start-then-fail":
            headers = [(b"content-length", b"5")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            raise ValueError("failed after the start, before any byte went out")
        if path == "/not-modified":
            headers = [(b"content-length", b"10"), (b"etag", b'"v1"')]
            await send({"type": "http.response.start", "status": 304, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return
        if path == "/start-then-read":
            headers = [(b"content-length", b"7")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            body = await _read_all(receive)
            await send({"type": "http.response.body", "body": b"got " + body[:3]})
            return
        body = await _read_all(receive)
        if path == "/stuck-send":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            block = b"x" * 65536
            try:
                async with asyncio.timeout(0.5):
                    while True:  # the client does not read: some send must wait, then time out
                        await send({"type": "http.response.body", "body": block, "more_body": True})
            except TimeoutError:
                recorder.note("send timed out")
            await send({"type": "http.response.body", "body": b"end", "more_body": False})
            recorder.note("ended")
            return
        if path == "/two-listeners":
            first, second = await asyncio.wait_for(asyncio.gather(receive(), receive()), 5)
            recorder.note(f"{first['type']} {second['type']}")
            return
        if path in ("/control-header", "/signed-length"):
            name, value = (
                (b"x-bad", b"a\x0bb") if path == "/control-header" else (b"content-length", b"+2")
            )
            await send({"type": "http.response.start", "status": 200, "headers": [(name, value)]})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        if path == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for index in range(5):
                chunk = b"data: %d\n\n" % index
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if path == "/late-boom":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"partial", "more_body": True})
            raise ValueError("the application failed while answering")
        if path == "/forged-header":
            headers = [(b"x-forged", b"a\r\nset-cookie: stolen=1")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            return
        if path == "/short":
            headers = [(b"content-length", b"10")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b"abc"})
            return
        if path == "/hook-only":  # as pdproxy's endpoint: the hook, and no receive() waiting
            gone = asyncio.Event()

            def hung_up() -> None:
                recorder.note("hook only")
                gone.set()

            scope["extensions"][DISCONNECT_HOOK](hung_up)
            await asyncio.wait_for(gone.wait(), 5)
            return
        if path == "/hang-up":
            left = asyncio.Event()

            def client_left() -> None:
                recorder.note("hook")
                left.set()

            scope["extensions"][DISCONNECT_HOOK](client_left)
            watched = await receive()  # waits for the client to leave
            recorder.note(watched["type"])
            await asyncio.wait_for(left.wait(), 5)
            return
        if path == "/big":
            headers = [(b"content-length", str(BIG).encode())]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            block = b"x" * 65536
            for _ in range(BIG // len(block)):
                began = time.monotonic()
                await send({"type": "http.response.body", "body": block, "more_body": True})
                recorder.send_waits.append(time.monotonic() - began)
            await send({"type": "http.response.body", "body": b""})
            return
        answer = b"%s %s %s|%s" % (
            scope["method"].encode(),
            scope["path"].encode(),
            scope["query_string"],
            body,
        )
        headers = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(answer))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": answer})

    return app


@pytest.fixture(params=["asyncio", "uvloop"])
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    recorder = Recorder()
    with serving(_app(recorder), recorder, request.param, IDLE_SECONDS) as served:
        yield served


def test_keep_alive_serves_many_requests_on_one_connection(served: Served) -> None:
    with served.connect() as connection:
        for index in range(5):
            body = b"payload %d" % index
            connection.request("POST", f"/echo?n={index}", body=body)
            response = connection.getresponse()
            assert response.status == 200
            assert response.getheader("date") == "Wed, 25 Nov 2026 12:00:00 GMT"
            assert response.read() == b"POST /echo n=%d|%s" % (index, body)
    # Counted on the server's thread just after the last write: the client may be quicker.
    deadline = time.monotonic() + 5
    while served.state.total_requests < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert served.state.total_requests == 5


def test_answer_with_known_length_leaves_in_one_segment(served: Served) -> None:
    with served.raw() as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
        answer = read_response(sock)
        assert answer.endswith(b"\r\n\r\nPOST /echo |hi")
        assert served.writes == [answer]  # head and body in one write: one system call


def test_a_body_that_came_with_its_head_is_reported_received(served: Served) -> None:
    head = b"POST /body-received HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\n"
    with served.raw() as sock:
        sock.sendall(head + b"abcd")
        assert read_response(sock).endswith(b"\r\n\r\nTrue|abcd")
        # The head alone first: the application begins before its body is in, and is told
        # nothing (it must bound its wait for the body itself).
        sock.sendall(head)
        time.sleep(0.3)
        sock.sendall(b"efgh")
        assert read_response(sock).endswith(b"\r\n\r\nNone|efgh")


def test_a_whole_answer_in_one_call_leaves_in_one_write(served: Served) -> None:
    with served.raw() as sock:
        for body in (b"ab", b"cd"):
            sock.sendall(b"POST /whole HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n" + body)
            answer = read_response(sock)
            assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
            assert b"\r\ncontent-type: text/plain\r\n" in answer
            assert answer.endswith(b"\r\n\r\nwhole|" + body)
            # Noted once the call returned, which may be after the client read the answer.
            assert served.recorder.wait_for("answered whole: True")
            served.recorder.events.remove("answered whole: True")
        assert served.recorder.events == []
        assert len(served.writes) == 2  # head and body together, one write per answer


def test_a_whole_answer_waits_while_the_client_is_not_reading(served: Served) -> None:
    """Behind an answer the client has not read yet, the one-call answer declines (nothing
    sent), and the ASGI way waits for the client: both answers arrive whole, in order."""
    with served.raw() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        sock.sendall(
            b"GET /huge-whole HTTP/1.1\r\nHost: x\r\n\r\n"
            b"POST /whole HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nef"
        )
        time.sleep(0.5)  # not reading: the first answer fills the server's write buffer
        data = read_until(sock, b"whole|ef", 20)
        first, _, second = data.partition(b"\r\n\r\n" + b"h" * BIG)
        assert first.startswith(b"HTTP/1.1 200 OK\r\n")
        assert second.startswith(b"HTTP/1.1 200 OK\r\n") and second.endswith(b"whole|ef")
        assert served.recorder.events == ["answered whole: False"]


def test_percent_encoded_path_is_decoded(served: Served) -> None:
    with served.connect() as connection:
        connection.request("GET", "/a%20b")
        assert connection.getresponse().read() == b"GET /a b |"


def test_chunked_request_body_is_reassembled(served: Served) -> None:
    with served.connect() as connection:
        connection.request("POST", "/echo", body=iter([b"ab", b"cd", b"ef"]))
        response = connection.getresponse()
        assert response.read() == b"POST /echo |abcdef"


def test_large_request_body_arrives_intact(served: Served) -> None:
    body = bytes(range(256)) * 8192  # 2 MiB: reading pauses and resumes on the way
    with served.connect() as connection:
        connection.request("POST", "/echo", body=body)
        answer = connection.getresponse().read()
        assert answer == b"POST /echo |" + body


def test_streamed_answer_is_chunked(served: Served) -> None:
    with served.connect() as connection:
        connection.request("GET", "/stream")
        response = connection.getresponse()
        assert response.getheader("transfer-encoding") == "chunked"
        assert response.read() == b"".join(b"data: %d\n\n" % index for index in range(5))
        connection.request("GET", "/echo")  # the connection is still usable
        assert connection.getresponse().read() == b"GET /echo |"


def test_head_gets_headers_without_body(served: Served) -> None:
    with served.raw() as sock:
        sock.sendall(b"HEAD /echo HTTP/1.1\r\nHost: x\r\n\r\nGET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(5)
        data = b""
        while data.count(b"HTTP/1.1 200") < 2 or not data.endswith(b"GET /echo |"):
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
        head_answer, _, second = data.partition(b"HTTP/1.1 200 OK\r\n")[2].partition(b"HTTP/1.1")
        assert b"content-length: 12" in head_answer
        assert head_answer.endswith(b"\r\n\r\n")  # no body after the HEAD's headers
        assert second.endswith(b"GET /echo |")


def test_pipelined_requests_are_answered_in_order(served: Served) -> None:
    with served.raw() as sock:
        sock.sendall(
            b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
        )
        data = read_until(sock, b"|abc", 5)
        # The slow first request is answered first, the second right after it.
        assert data.count(b"HTTP/1.1 200 OK") == 2
        assert data.index(b"GET /slow |") < data.index(b"POST /echo |abc")


def test_expect_100_continue(served: Served) -> None:
    with served.raw() as sock:
        sock.sendall(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n"
        )
        assert read_until(sock, b"\r\n\r\n", 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(b"body")
        assert read_response(sock).endswith(b"POST /echo |body")


def test_http_1_0_connection_is_closed_after_the_answer(served: Served) -> None:
    with served.raw() as sock:
        sock.sendall(b"GET /echo HTTP/1.0\r\n\r\n")
        answer = read_response(sock)
        assert b"connection: close" in answer.lower()
        assert closed_by_peer(sock, 5)


def test_malformed_request_gets_400_and_close(served: Served) -> None:
    with served.raw() as sock:
        sock.sendall(b"GET /echo HTTP/1.1\r\nBad Header Without Colon\r\n\r\n")
        answer = read_response(sock)
        assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n")
        assert answer.endswith(b"Invalid HTTP request received.")
        assert closed_by_peer(sock, 5)


def test_idle_connection_is_closed_after_the_keep_alive_timeout(served: Served) -> None:
    with served.raw() as sock:
        sock.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock).endswith(b"GET /echo |")
        assert not closed_by_peer(sock, IDLE_SECONDS / 5)  # still open right after
        assert closed_by_peer(sock, IDLE_SECONDS * 6)


def test_an_answer_longer_than_the_idle_period_keeps_its_connection(served: Served) -> None:
    # The idle timer armed when the connection opened fires during the answer: it must find
    # no bound then, and the bound must start again when the answer ends.
    with served.raw() as sock:
        sock.sendall(b"GET /longer-than-idle HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock, timeout=IDLE_SECONDS * 5).endswith(b"GET /longer-than-idle |")
        assert not closed_by_peer(sock, IDLE_SECONDS / 2)
        sock.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock).endswith(b"GET /echo |")
        assert closed_by_peer(sock, IDLE_SECONDS * 6)


def test_requests_closer_than_the_idle_period_keep_the_connection(served: Served) -> None:
    # Three idle periods in all, never one without a request: the armed timer fires, finds the
    # bound moved later, and waits again.
    with served.raw() as sock:
        for _ in range(9):
            sock.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(sock).endswith(b"GET /echo |")
            time.sleep(IDLE_SECONDS / 3)
        assert closed_by_peer(sock, IDLE_SECONDS * 6)


def _accepted(served: Served, count: int) -> None:
    """Wait until the server has taken `count` connections (its idle bounds run from then)."""
    wait_until(
        lambda: len(served.state.connections) >= count, 5, "the server to take it", interval=0.01
    )


class _Stall:
    """The serving loop stops running for `seconds`, as when its host stops the process; the
    constructor returns once it has stopped, `woke()` once it runs again (and when)."""

    def __init__(self, served: Served, seconds: float) -> None:
        stopped, self._woke = threading.Event(), threading.Event()
        self._woke_at = 0.0

        def stall() -> None:
            stopped.set()
            time.sleep(seconds)
            # A stopped process's loop reads the clock on waking; uvloop's would otherwise go on
            # with the time it read before this callback.
            served.loop.time()
            self._woke_at = time.monotonic()
            self._woke.set()

        served.loop.call_soon_threadsafe(stall)
        assert stopped.wait(5)

    def woke(self) -> float:
        assert self._woke.wait(30)
        return self._woke_at


def _closed_after(sock: socket.socket, since: float) -> float:
    """Seconds from `since` until the server closed `sock` (which it must, within 6 idle
    periods)."""
    assert closed_by_peer(sock, IDLE_SECONDS * 6)
    return time.monotonic() - since


def test_a_request_sent_as_a_stall_ends_is_served_not_closed_as_idle(served: Served) -> None:
    # A stalled host stops the proxy and its client together, past the connection's idle
    # bound. On waking, the late idle timer must not close the connection before the client,
    # waking too, sends its request: the client was never idle by its own clock.
    with served.raw() as sock:
        _accepted(served, 1)
        _Stall(served, IDLE_SECONDS * 2).woke()
        time.sleep(0.05)  # the client runs again a moment after the server
        sock.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock).endswith(b"GET /echo |")


def test_a_connection_silent_after_a_stall_is_closed_one_idle_period_later(
    served: Served,
) -> None:
    with served.raw() as sock:
        _accepted(served, 1)
        woke = _Stall(served, IDLE_SECONDS * 2).woke()
        # Not at the wake, which would close under a request on its way: one period later.
        assert _closed_after(sock, woke) >= IDLE_SECONDS / 2


def test_a_stall_is_excused_once_until_a_request_comes(served: Served) -> None:
    with served.raw() as sock:
        _accepted(served, 1)
        for _ in range(2):  # a request after each excused stall makes the next one excusable
            _Stall(served, IDLE_SECONDS * 2).woke()
            time.sleep(0.05)
            sock.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(sock).endswith(b"GET /echo |")
        _Stall(served, IDLE_SECONDS * 2).woke()
        time.sleep(0.2)  # the late timer runs and excuses this stall
        # Excused, silent, and stopped again past the extra period: closed on this wake.
        woke = _Stall(served, IDLE_SECONDS * 2).woke()
        assert _closed_after(sock, woke) < IDLE_SECONDS / 2


def test_empty_lines_do_not_keep_a_connection_open(served: Served) -> None:
    # The parser skips empty lines before a request line: they begin no request, so they
    # must not move the idle bound either.
    with served.raw() as sock:
        _accepted(served, 1)
        began = time.monotonic()
        closed = False
        while not closed and time.monotonic() - began < IDLE_SECONDS * 6:
            try:
                sock.sendall(b"\r\n")
            except OSError:
                closed = True
                break
            closed = closed_by_peer(sock, IDLE_SECONDS / 3)
        assert closed
        assert time.monotonic() - began < IDLE_SECONDS * 3


def test_application_error_before_answer_is_500(served: Served) -> None:
    with served.connect() as connection:
        connection.request("GET", "/boom")
        response = connection.getresponse()
        assert response.status == 500
        assert response.read() == b"Internal Server Error"
        assert response.getheader("connection") == "close"


def test_application_error_mid_answer_closes_the_connection(served: Served) -> None:
    with served.connect() as connection:
        connection.request("GET", "/late-boom")
        response = connection.getresponse()
        assert response.status == 200
        with pytest.raises(http.client.IncompleteRead):
            response.read()  # no final chunk: the client can tell the answer is cut


def test_forged_header_value_is_refused(served: Served) -> None:
    with served.raw() as sock:
        sock.sendall(b"GET /forged-header HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = read_response(sock)
        assert answer.startswith(b"HTTP/1.1 500 ")
        assert b"stolen" not in answer


def test_body_shorter_than_its_length_closes_the_connection(served: Served) -> None:
    with served.raw() as sock:
        sock.sendall(b"GET /short HTTP/1.1\r\nHost: x\r\n\r\n")
        data = read_to_close(sock)
        # Never a complete 10-byte body: the client cannot mistake it for a whole answer.
        assert len(data.partition(b"\r\n\r\n")[2]) < 10


def test_finished_requests_and_closed_connections_leave_no_reference_cycle(
    served: Served,
) -> None:
    """A request's objects, and a connection's once it is closed, go with their reference
    counts. Cycles among them (the scope's disconnect hook is the request's own bound method;
    the parser holds the connection's) left every request and connection to the garbage
    collector, whose passes stalled the serving loop for milliseconds at a time
    (docs/performance.md, "A reference cycle per request")."""
    connections, requests = 3, 10

    def ours(thing: object) -> bool:
        # This server's protocol objects (other tests' servers may be winding down meanwhile).
        conn = getattr(thing, "_conn", thing)
        return getattr(conn, "_server_state", None) is served.state

    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds unreachable is kept in gc.garbage
    try:
        for _ in range(connections):
            with served.connect() as connection:
                for _ in range(requests):
                    connection.request("POST", "/echo", body=b"payload")
                    response = connection.getresponse()
                    assert response.status == 200
                    response.read()
        deadline = time.monotonic() + 5
        while (
            served.state.total_requests < connections * requests or served.state.connections
        ) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert served.state.total_requests == connections * requests
        assert not served.state.connections  # every connection closed on the server's side
        gc.collect()
        left = [type(o).__qualname__ for o in gc.garbage if ours(o)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert left == []


def test_client_leaving_calls_the_hook_and_ends_receive(served: Served) -> None:
    sock = served.raw()
    sock.sendall(b"GET /hang-up HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.2)
    sock.close()
    assert served.recorder.wait_for("hook")
    assert served.recorder.wait_for("http.disconnect")


def test_slow_reader_holds_the_writer_back(served: Served) -> None:
    with served.raw() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        sock.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.5)  # not reading: the server's buffers fill and send() must wait
        answer = read_response(sock, timeout=20)
        assert len(answer.partition(b"\r\n\r\n")[2]) == BIG
        assert max(served.recorder.send_waits) >= 0.2


def test_hang_up_after_a_large_body_is_seen(served: Served) -> None:
    # Reading pauses behind a large body; it must resume once the body is taken, or the
    # client's hang-up would go unseen (and its upstream work would go on).
    body = b"y" * 300_000
    sock = served.raw()
    sock.sendall(b"POST /hook-only HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body))
    sock.sendall(body)
    time.sleep(0.3)
    sock.close()
    assert served.recorder.wait_for("hook only")


def test_a_send_cancelled_by_a_timeout_does_not_break_the_next_one(served: Served) -> None:
    with served.raw() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        sock.sendall(b"GET /stuck-send HTTP/1.1\r\nHost: x\r\n\r\n")
        assert served.recorder.wait_for("send timed out", timeout=10)
        data = read_until(sock, b"3\r\nend\r\n0\r\n\r\n", 20)
        assert data.endswith(b"3\r\nend\r\n0\r\n\r\n"), "the stream was cut before its end"
        assert served.recorder.wait_for("ended")


def test_every_receive_waiting_sees_the_disconnect(served: Served) -> None:
    sock = served.raw()
    sock.sendall(b"GET /two-listeners HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.2)
    sock.close()
    assert served.recorder.wait_for("http.disconnect http.disconnect")


def test_base_exception_from_the_application_still_answers(served: Served) -> None:
    with served.raw() as sock:
        sock.sendall(b"GET /fatal HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = read_response(sock)
        assert answer.startswith(b"HTTP/1.1 500 ")
        assert closed_by_peer(sock, 5)


def test_head_sent_before_the_body_is_read_reaches_a_100_continue_client(served: Served) -> None:
    with served.raw() as sock:
        sock.sendall(
            b"POST /start-then-read HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
            b"Expect: 100-continue\r\n\r\n"
        )
        head = read_until(sock, b"\r\n\r\n", 3)
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")  # at once, not after the body
        assert head.endswith(b"\r\n\r\n")
        sock.sendall(b"hello")
        assert read_until(sock, b"got hel", 5) == b"got hel"


def test_connection_without_a_whole_request_is_closed_when_idle(served: Served) -> None:
    silent, partial = served.raw(), served.raw()
    try:
        partial.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        assert closed_by_peer(silent, IDLE_SECONDS * 6)
        assert closed_by_peer(partial, IDLE_SECONDS * 6)
    finally:
        silent.close()
        partial.close()


def test_http_1_0_stream_ends_with_the_connection(served: Served) -> None:
    with served.raw() as sock:
        sock.sendall(b"GET /stream HTTP/1.0\r\n\r\n")
        data = read_to_close(sock)
        head, _, body = data.partition(b"\r\n\r\n")
        assert b"transfer-encoding" not in head.lower()  # HTTP/1.0 has no chunked encoding
        assert b"connection: close" in head.lower()
        assert body == b"".join(b"data: %d\n\n" % index for index in range(5))


@pytest.mark.parametrize("path", ["/control-header", "/signed-length"])
def test_header_with_a_control_character_or_a_signed_length_is_refused(
    served: Served, path: str
) -> None:
    with served.raw() as sock:
        sock.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path.encode())
        answer = read_response(sock)
        assert answer.startswith(b"HTTP/1.1 500 ")
        assert b"x-bad" not in answer and b"+2" not in answer


def test_ten_pipelined_requests_are_all_answered(served: Served) -> None:
    with served.raw() as sock:
        sock.sendall(b"".join(b"GET /echo?n=%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(10)))
        data = read_until(sock, b"GET /echo n=9|", 5)
        assert [int(n) for n in re.findall(rb"GET /echo n=(\d+)\|", data)] == list(range(10))


def test_pipelining_past_the_cap_is_cut_off(served: Served) -> None:
    with served.raw() as sock:
        count = MAX_PIPELINED * 4
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n" * count)
        data = read_to_close(sock)  # closed, not answered to the end
        assert data.count(b"HTTP/1.1 200") < count


def test_system_exit_in_a_request_does_not_end_the_server(served: Served) -> None:
    with served.raw() as sock:
        sock.sendall(b"GET /exit HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 500 ")
    with served.connect() as connection:
        connection.request("GET", "/echo")
        assert connection.getresponse().read() == b"GET /echo |"


def test_answer_before_an_announced_body_closes_the_connection(served: Served) -> None:
    with served.raw() as sock:
        sock.sendall(
            b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"
        )
        answer = read_response(sock)
        assert answer.endswith(b"\r\n\r\nearly")
        assert b"connection: close" in answer.lower()  # the body may or may not follow
        assert closed_by_peer(sock, 5)


def test_failure_after_a_held_back_start_still_answers_500(served: Served) -> None:
    with served.raw() as sock:
        sock.sendall(b"GET /start-then-fail HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = read_response(sock)
        assert answer.startswith(b"HTTP/1.1 500 ")
        assert answer.endswith(b"Internal Server Error")


def test_304_keeps_its_length_header_and_sends_no_body(served: Served) -> None:
    with served.raw() as sock:
        sock.sendall(
            b"GET /not-modified HTTP/1.1\r\nHost: x\r\n\r\nGET /echo HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        data = read_until(sock, b"GET /echo |", 5)
        first, _, second = data.partition(b"\r\n\r\n")
        assert first.startswith(b"HTTP/1.1 304 ") and b"content-length: 10" in first
        assert second.startswith(b"HTTP/1.1 200 OK")  # nothing in between: no body after a 304


def test_oversized_request_head_is_refused(served: Served) -> None:
    with served.raw() as sock:
        big = b"X-Filler: " + b"f" * (MAX_HEAD_BYTES + 1) + b"\r\n"
        sock.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\n" + big + b"\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 431 ")
        assert closed_by_peer(sock, 5)


def test_trickled_request_head_is_bounded_by_one_idle_timeout(served: Served) -> None:
    with served.raw() as sock:
        sock.sendall(b"GET /echo HTTP/1.1\r\n")
        began = time.monotonic()
        closed = False
        while time.monotonic() - began < IDLE_SECONDS * 6 and not closed:
            try:
                sock.sendall(b"X-Slow: 1\r\n")  # a line every 0.2 s: never idle for long
            except OSError:
                closed = True
                break
            closed = closed_by_peer(sock, 0.2)
        assert closed
