"""Bounds of pdproxy's HTTP/1.1 protocol against hostile clients, over real loopback sockets.

Each test is an attack that worked on the protocol before it was bounded: a request smuggled
behind an upgrade request, a header line that never ends, a body nobody reads that never ends,
trailer fields taken for headers. The application and harness are those of
test_http_protocol.py.
"""

from __future__ import annotations

import select
import socket
import threading
import time

from pdproxy.http.server_protocol import (
    DISCARD_SECONDS,
    MAX_FRAMING_BYTES,
    MAX_HEAD_BYTES,
    MAX_HEADERS,
)
from tests.integration.http_harness import Served, read_response, read_to_close
from tests.integration.support import closed_by_peer
from tests.integration.test_http_protocol import IDLE_SECONDS

H2C = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n"
SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"


def _sent_whole(sock: socket.socket, data: bytes, seconds: float) -> bool:
    """Whether the peer took all of `data` (False once it closed or reset the connection)."""
    sock.settimeout(seconds)
    try:
        sock.sendall(data)
    except (BrokenPipeError, ConnectionResetError, TimeoutError):
        return False
    return True


def _flood_cut_off(sock: socket.socket, block: bytes, seconds: float = 4.0) -> bool:
    """Whether the peer ends the connection while `block` is sent again and again for up to
    `seconds` (longer than the idle timeout: reading alone never ends such a flood)."""
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        if not _sent_whole(sock, block, 1):
            return True
    return False


def _refused_400(sock: socket.socket, piece: bytes, most: int) -> bool:
    """Whether the peer answers 400 and closes while `piece` is sent again and again (at most
    `most` bytes): sending stops once the answer is there, and what was read before a reset
    still counts."""
    sent = 0
    while sent < most and not select.select([sock], [], [], 0)[0]:
        if not _sent_whole(sock, piece, 5):
            break
        sent += len(piece)
    sock.settimeout(5)
    answer = b""
    try:
        while chunk := sock.recv(65536):
            answer += chunk
    except ConnectionResetError:
        pass
    return answer.startswith(b"HTTP/1.1 400 ")


def _echo_latency(served: Served) -> float:
    began = time.monotonic()
    with served.connect() as connection:
        connection.request("GET", "/echo")
        assert connection.getresponse().read() == b"GET /echo |"
    return time.monotonic() - began


# -- upgrade and CONNECT: one plain request, then the connection ends -------------------------


def test_h2c_upgrade_request_is_served_whole_and_nothing_after_it_is_parsed(
    served: Served,
) -> None:
    with served.raw() as sock:
        head = b"POST /echo HTTP/1.1\r\nHost: x\r\n" + H2C + b"Content-Length: 5\r\n\r\n"
        sock.sendall(head + b"hello" + SMUGGLED)  # head, body and a second request: one segment
        data = read_to_close(sock)
    assert data.count(b"HTTP/1.1 ") == 1, data
    assert data.endswith(b"POST /echo |hello")  # the body was not lost
    assert b"connection: close" in data.lower()
    assert b"smuggled" not in data


def test_upgrade_request_with_a_chunked_body_in_pieces(served: Served) -> None:
    with served.raw() as sock:
        sock.sendall(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nConnection: upgrade\r\nUpgrade: websocket\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        time.sleep(0.1)
        sock.sendall(b"3\r\nabc\r\n")
        time.sleep(0.1)
        sock.sendall(b"2\r\nde\r\n0\r\n\r\n" + SMUGGLED)
        data = read_to_close(sock)
    assert data.count(b"HTTP/1.1 ") == 1, data
    assert data.endswith(b"POST /echo |abcde")


def test_connect_is_answered_once_and_the_tunnel_bytes_are_not_requests(served: Served) -> None:
    with served.raw() as sock:
        # A target in origin form, which the application gets to answer (an authority
        # form is refused as an invalid URL).
        sock.sendall(b"CONNECT /tunnel HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
        time.sleep(0.1)
        sock.sendall(SMUGGLED)  # in a segment of its own
        data = read_to_close(sock)
    assert data.count(b"HTTP/1.1 ") == 1, data
    assert data.endswith(b"CONNECT /tunnel |")
    assert b"connection: close" in data.lower()
    assert b"smuggled" not in data


def test_authority_form_connect_is_refused(served: Served) -> None:
    with served.raw() as sock:
        sock.sendall(b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
        time.sleep(0.1)
        sock.sendall(SMUGGLED)
        data = read_to_close(sock)
    assert data.startswith(b"HTTP/1.1 400 ") and data.count(b"HTTP/1.1 ") == 1, data


def test_bytes_after_an_upgrade_request_are_bounded(served: Served) -> None:
    with served.raw() as sock:
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n" + H2C + b"\r\n")
        # The answer takes 0.2 s; meanwhile more than the bound arrives: the connection ends.
        assert _flood_cut_off(sock, SMUGGLED * 1000)


# -- the request head ---------------------------------------------------------------------


def test_header_line_that_never_ends_is_refused_at_the_bound(served: Served) -> None:
    latencies: list[float] = []
    with served.raw() as sock:
        sock.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Long: ")
        piece = b"a" * 1024
        stop = threading.Event()

        def probe() -> None:
            while not stop.is_set():
                latencies.append(_echo_latency(served))

        prober = threading.Thread(target=probe)
        prober.start()
        try:
            sent = 0
            while sent < 4 * MAX_HEAD_BYTES and _sent_whole(sock, piece, 5):
                sent += len(piece)
        finally:
            stop.set()
            prober.join(30)
        answer = read_response(sock)
    assert answer.startswith(b"HTTP/1.1 431 ")
    assert sent <= MAX_HEAD_BYTES + 2 * len(piece) + 65536 * 4  # socket buffers hold a little
    assert latencies and max(latencies) < 2.0  # the loop was never held for long


def test_many_empty_header_fields_are_refused(served: Served) -> None:
    with served.raw() as sock:
        fields = b"a:\r\n" * (MAX_HEADERS + 1)
        sock.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 431 ")
        assert closed_by_peer(sock, 5)


def test_the_most_header_fields_allowed_are_served(served: Served) -> None:
    with served.raw() as sock:
        fields = b"".join(b"x-%d: v\r\n" % i for i in range(MAX_HEADERS - 1))
        sock.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n")
        assert read_response(sock).endswith(b"GET /echo |")


# -- bodies nobody reads ------------------------------------------------------------------


def test_body_trickling_after_an_early_answer_is_cut_off(served: Served) -> None:
    bound = min(DISCARD_SECONDS, IDLE_SECONDS)
    with served.raw() as sock:
        sock.sendall(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
        assert read_response(sock).endswith(b"early")
        began = time.monotonic()
        closed = False
        while not closed and time.monotonic() - began < bound + 4:
            # One byte every 0.2 s: never idle for a whole idle period.
            closed = not _sent_whole(sock, b"x", 1) or closed_by_peer(sock, 0.2)
        assert closed
        assert time.monotonic() - began < bound + 2


def test_body_flood_after_an_early_answer_is_cut_off(served: Served) -> None:
    with served.raw() as sock:
        sock.sendall(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000\r\n\r\n")
        assert read_response(sock).endswith(b"early")
        assert _flood_cut_off(sock, b"x" * 65536)


def test_chunk_flood_after_an_early_answer_is_cut_off(served: Served) -> None:
    with served.raw() as sock:
        sock.sendall(b"POST /early HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        assert read_response(sock).endswith(b"early")
        assert _flood_cut_off(sock, b"1\r\nx\r\n" * 10000)
    assert _echo_latency(served) < 2.0


def test_short_rest_of_an_early_answered_body_keeps_the_connection(served: Served) -> None:
    with served.raw() as sock:
        sock.sendall(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n")
        assert read_response(sock).endswith(b"early")
        sock.sendall(b"0123456789GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock).endswith(b"GET /echo |")


def test_endless_chunk_extension_is_refused(served: Served) -> None:
    with served.raw() as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5;x=")
        assert _refused_400(sock, b"y" * 4096, MAX_FRAMING_BYTES * 4)


# -- trailers -----------------------------------------------------------------------------


def test_trailer_fields_are_not_request_headers(served: Served) -> None:
    with served.raw() as sock:
        sock.sendall(
            b"POST /headers HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"3\r\nabc\r\n0\r\nAuthorization: Bearer sneaked\r\nX-Trailer: 1\r\n\r\n"
        )
        answer = read_response(sock)
    assert answer.endswith(b"|abc")
    assert b"sneaked" not in answer and b"x-trailer" not in answer.lower()


def test_endless_trailer_field_is_refused(served: Served) -> None:
    with served.raw() as sock:
        sock.sendall(
            b"POST /headers HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"3\r\nabc\r\n0\r\nX-Trailer: "
        )
        assert _refused_400(sock, b"y" * 4096, MAX_FRAMING_BYTES * 4)
