"""get_within against a real loopback HTTP server: the whole exchange fits the deadline, however
the server spreads its answer out; what it answers otherwise comes back as the named error."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from pdproxy.demo.processes import LOOPBACK, free_port
from pdproxy.vllm_side.bounded_get import HttpStatusError, MalformedAnswer, get_within

PAGE = b"".join(b"vllm:num_requests_running %d\n" % n for n in range(200))
PIECES = 20


@dataclass
class Behaviour:
    status: int = 200
    gap_s: float = 0.0  # between the answer's PIECES pieces
    chunked: bool = False


@dataclass
class PageServer:
    url: str
    behaviour: Behaviour
    server: ThreadingHTTPServer
    thread: threading.Thread


@pytest.fixture
def page_server() -> Iterator[PageServer]:
    behaviour = Behaviour()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self.send_response(behaviour.status)
            if behaviour.chunked:
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.send_header("Content-Length", str(len(PAGE)))
            self.send_header("Connection", "close")
            self.end_headers()
            step = len(PAGE) // PIECES + 1
            try:
                for start in range(0, len(PAGE), step):
                    piece = PAGE[start : start + step]
                    if behaviour.chunked:
                        piece = b"%x\r\n%s\r\n" % (len(piece), piece)
                    self.wfile.write(piece)
                    self.wfile.flush()
                    time.sleep(behaviour.gap_s)
                if behaviour.chunked:
                    self.wfile.write(b"0\r\n\r\n")
            except OSError:
                pass  # the client gave up on a slow answer

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((LOOPBACK, free_port()), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        url = f"http://{LOOPBACK}:{server.server_port}/metrics"
        yield PageServer(url, behaviour, server, thread)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_whole_answer_in_time_comes_back(page_server: PageServer, chunked: bool) -> None:
    page_server.behaviour.chunked = chunked
    page_server.behaviour.gap_s = 0.01
    assert get_within(page_server.url, 5.0, 1 << 20) == PAGE


def test_only_the_first_limit_bytes_are_read(page_server: PageServer) -> None:
    assert get_within(page_server.url, 5.0, 100) == PAGE[:100]


@pytest.mark.parametrize("chunked", [False, True])
def test_an_answer_that_trickles_past_the_deadline_times_out(
    page_server: PageServer, chunked: bool
) -> None:
    """Every piece comes well within the deadline (what a per-read timeout checks), the whole
    takes ten times it: the exchange ends at the deadline."""
    page_server.behaviour.chunked = chunked
    page_server.behaviour.gap_s = 0.15  # 20 pieces: 3 s in all, against 0.3 s
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no whole answer within 0\.3s"):
        get_within(page_server.url, 0.3, 1 << 20)
    assert time.monotonic() - started < 2.0  # long before the whole page


def test_a_server_that_never_answers_times_out() -> None:
    with socket.socket() as listener:
        listener.bind((LOOPBACK, 0))
        listener.listen(1)  # the connection is queued, never read nor answered
        with pytest.raises(TimeoutError):
            get_within(f"http://{LOOPBACK}:{listener.getsockname()[1]}/metrics", 0.3, 1024)


@pytest.mark.parametrize(
    "answer", [b"not http at all\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\nshort"]
)
def test_what_is_not_a_whole_http_answer_is_malformed(answer: bytes) -> None:
    with socket.socket() as listener:
        listener.bind((LOOPBACK, 0))
        listener.listen(1)

        def answer_once() -> None:
            connection, _ = listener.accept()
            with connection:
                connection.recv(65536)
                connection.sendall(answer)

        thread = threading.Thread(target=answer_once)
        thread.start()
        try:
            with pytest.raises(MalformedAnswer):
                get_within(f"http://{LOOPBACK}:{listener.getsockname()[1]}/metrics", 5.0, 1024)
        finally:
            thread.join(5)


def test_another_status_is_an_error_naming_it(page_server: PageServer) -> None:
    page_server.behaviour.status = 503
    with pytest.raises(HttpStatusError, match="HTTP 503"):
        get_within(page_server.url, 5.0, 1 << 20)


def test_a_refused_connection_is_refused() -> None:
    with pytest.raises(ConnectionRefusedError):
        get_within(f"http://{LOOPBACK}:{free_port()}/metrics", 1.0, 1024)


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/metrics", "http:///metrics", "metrics"])
def test_a_url_that_is_not_http_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="not an http"):
        get_within(url, 1.0, 1024)
