"""Clients that stop reading a fast stream, through a live proxy: what the proxy holds for them
is bounded, the instance's writes are held back instead, and the stream arrives intact once the
client reads again; a client that never does is ended by the request timeout.

The decode instance is scripted (tests/integration/support.py) so it can stream far faster
than any fake worker and count what it managed to write; the proxy is a real process.
"""

from __future__ import annotations

import asyncio
import functools
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pdproxy.demo.fleet import LocalFleet
from pdproxy.demo.processes import http_get, wait_until
from pdproxy.proxy.exchange import LAST_EVENT_SECONDS
from tests.conftest import FleetFactory
from tests.harness.stream_crowd import rss_kib
from tests.integration.support import ScriptedUpstream, json_answer, metric_value

COMPLETIONS = "/v1/completions"
STREAM_REQUEST = {"model": "fake-model", "prompt": "hi", "max_tokens": 10, "stream": True}
EVENTS_PER_FRAME = 16  # SSE events per HTTP chunk the instance writes
SSE_DONE = b"data: [DONE]\n\n"
# Each stalled stream is longer than every buffer on its way together (kernel ones included:
# the proxy's send buffer to its client alone may grow to 4 MiB), so the instance's writes do
# block, and long enough for the proxy to buffer megabytes of it without back-pressure.
LONG_EVENTS = 60_000  # 12 MiB
SHORT_EVENTS = 200
STALLED = 8
# What the proxy may grow by while the streams stall: 512 KiB each, above the most it may
# hold for one (queued up to 64 KiB plus one read of at most 128 KiB, and 64 KiB past the
# client's 64 KiB write buffer mark) plus the request's own state. Measured on the 2-core test
# machine: about 250 KiB each; 1.3 MiB each before the bound, when up to 1 MiB was queued.
MAX_GROWTH_KIB = STALLED * 512
SETTLE_S = 0.5  # the instance wrote nothing for this long: its writes are blocked
SETTLE_TIMEOUT_S = 30.0
EVENT_BYTES = 200
# Valid JSON (no zero-padded numbers): with migration on the relay reads every event.
_EVENT = b'data: {"n": %8d, "text": "%s"}\n\n'
_PADDING = b"x" * (EVENT_BYTES - len(_EVENT % (0, b"")))


def event(n: int) -> bytes:
    """The n-th event of a stream, numbered (a lost or repeated one shows): EVENT_BYTES long."""
    return _EVENT % (n, _PADDING)


@functools.cache
def expected_stream(events: int) -> bytes:
    return b"".join(event(n) for n in range(events)) + SSE_DONE


@dataclass
class FloodingDecode:
    """A decode instance streaming as fast as its client (the proxy) takes it.

    Each answer streams `events` events (as set when its request arrives). `written` counts,
    per answer, the bytes written (its transport buffers up to 64 KiB of them before they reach
    the socket); `aborted` the answers whose connection the proxy closed.
    """

    events: int = SHORT_EVENTS
    written: list[int] = field(default_factory=list)
    aborted: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    async def __call__(self, writer: asyncio.StreamWriter) -> None:
        # A small send buffer here, so that what piles up is on the proxy's side.
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
        with self._lock:
            index = len(self.written)
            self.written.append(0)
        events = expected_stream(self.events)[: self.events * EVENT_BYTES]
        frame_bytes = EVENTS_PER_FRAME * EVENT_BYTES
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        try:
            for start in range(0, len(events), frame_bytes):
                frame = events[start : start + frame_bytes]
                writer.write(b"%x\r\n%s\r\n" % (len(frame), frame))
                await writer.drain()
                self.written[index] += len(frame)
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(SSE_DONE), SSE_DONE))
            await writer.drain()
        except ConnectionError:
            with self._lock:
                self.aborted += 1

    def total_written(self) -> int:
        return sum(self.written)


async def prefill_answer(writer: asyncio.StreamWriter) -> None:
    writer.write(json_answer(b'{"id": "cmpl-x", "choices": []}'))
    await writer.drain()


@contextmanager
def proxy_before(
    decode: FloodingDecode, fleet_factory: FleetFactory, *args: str
) -> Iterator[LocalFleet]:
    with ScriptedUpstream(prefill_answer) as p, ScriptedUpstream(decode) as d:
        yield fleet_factory(
            [],
            proxy_args=[
                "--prefill",
                f"http=127.0.0.1:{p.port},zmq=127.0.0.1:1",
                "--decode",
                f"http=127.0.0.1:{d.port},zmq=127.0.0.1:2",
                *args,
            ],
        )


def open_stream(proxy_url: str) -> http.client.HTTPResponse:
    """A streaming request whose answer has begun (status and headers read), and nothing more
    of it: the caller reads when it wants to. Its receive buffer is small, as a stalled
    client's would stay."""
    port = int(proxy_url.rsplit(":", 1)[1])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    sock.settimeout(60)
    sock.connect(("127.0.0.1", port))
    body = json.dumps(STREAM_REQUEST).encode()
    sock.sendall(
        b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (COMPLETIONS.encode(), len(body), body)
    )
    response = http.client.HTTPResponse(sock)
    try:
        response.begin()
    finally:
        sock.close()  # the response keeps its own reference to the socket's file
    assert response.status == 200
    return response


def queued_to_clients(proxy_port: int) -> int:
    """Bytes the kernel holds to send from the proxy's listening port to its clients (the
    send queues of its accepted IPv4 sockets, from /proc/net/tcp)."""
    total = 0
    lines = Path("/proc/net/tcp").read_text(encoding="ascii").splitlines()[1:]
    for line in lines:
        fields = line.split()
        local_port = int(fields[1].rsplit(":", 1)[1], 16)
        listening = fields[3] == "0A"
        if local_port == proxy_port and not listening:
            total += int(fields[4].split(":")[0], 16)
    return total


def wait_until_blocked(decode: FloodingDecode, streams: int) -> None:
    """Until the instance has `streams` answers under way and wrote nothing for SETTLE_S."""
    wait_until(lambda: len(decode.written) >= streams, SETTLE_TIMEOUT_S, "the streams to begin")
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    before = -1
    while decode.total_written() != before:
        assert time.monotonic() < deadline, "the instance never stopped writing"
        before = decode.total_written()
        time.sleep(SETTLE_S)


def short_stream(proxy_url: str) -> bytes:
    response = open_stream(proxy_url)
    with response:
        return response.read()


def test_a_stalled_client_holds_a_bounded_amount_and_gets_its_stream_whole(
    fleet_factory: FleetFactory,
) -> None:
    """Clients stop reading long streams the instance writes as fast as it can: the proxy
    stops reading them too and grows by a bounded amount (measured as its resident memory),
    serves other clients meanwhile, and relays each stream whole once its client reads."""
    decode = FloodingDecode()
    with proxy_before(decode, fleet_factory) as fleet, ExitStack() as streams:
        assert short_stream(fleet.proxy_url) == expected_stream(SHORT_EVENTS)  # warm-up
        assert fleet.proxy is not None
        pid = fleet.proxy.pid
        rss_before = rss_kib(pid)

        decode.events = LONG_EVENTS
        stalled = [streams.enter_context(open_stream(fleet.proxy_url)) for _ in range(STALLED)]
        wait_until_blocked(decode, 1 + STALLED)
        growth = rss_kib(pid) - rss_before
        written = decode.written[1:]

        # The instance's writes wait (nothing was lost: they are incomplete, not failed) ...
        assert all(0 < count < len(expected_stream(LONG_EVENTS)) for count in written), written
        assert decode.aborted == 0
        # ... and the proxy holds little for the clients that do not read.
        assert growth <= MAX_GROWTH_KIB, f"proxy grew {growth} KiB for {STALLED} stalled streams"

        # Meanwhile other clients are served.
        decode.events = SHORT_EVENTS
        for _ in range(3):
            assert short_stream(fleet.proxy_url) == expected_stream(SHORT_EVENTS)
        assert http_get(fleet.proxy_url + "/health")[0] == 200
        assert decode.written[1 : 1 + STALLED] == written  # and the stalled ones still wait

        # Once the clients read, every stream arrives whole, in order, byte for byte.
        for response in stalled:
            assert response.read() == expected_stream(LONG_EVENTS)
        assert decode.aborted == 0
        wait_until(
            lambda: metric_value(fleet.proxy_url, "pdproxy_admitted_requests") == 0,
            5.0,
            "every request to end",
        )


REQUEST_TIMEOUT_S = 4.0


def test_the_request_timeout_ends_a_stream_whose_client_never_reads(
    fleet_factory: FleetFactory,
) -> None:
    """While the relay waits for its client, the instance is off the clock (the stream idle
    timeout bounds only the instance's silences), but the request timeout still runs: it frees
    the decode, and ending the stream does not wait without bound for the client either."""
    decode = FloodingDecode(events=LONG_EVENTS)
    timeout = str(REQUEST_TIMEOUT_S)
    args = ("--request-timeout", timeout, "--connect-timeout", "1")
    with proxy_before(decode, fleet_factory, *args) as fleet:
        # The stream's status line went out (200) before the timeout: it is counted as such.
        answered = {"endpoint": COMPLETIONS, "status": "200"}
        with open_stream(fleet.proxy_url) as stalled:
            wait_until_blocked(decode, 1)
            # The decode leg is closed (the instance aborts the request) ...
            wait_until(lambda: decode.aborted == 1, REQUEST_TIMEOUT_S + 10, "the decode to end")
            # ... and the request ends, though its client still does not read: the error event
            # cannot reach it, and waiting for that is bounded too.
            wait_until(
                lambda: metric_value(fleet.proxy_url, "pdproxy_requests_total", answered) == 1,
                LAST_EVENT_SECONDS + 10,
                "the request to end",
            )
            assert metric_value(fleet.proxy_url, "pdproxy_admitted_requests") == 0
            # The proxy keeps nothing queued for that client: the truncated rest is dropped
            # with its connection, not held until the client reads.
            proxy_port = int(fleet.proxy_url.rsplit(":", 1)[1])
            wait_until(
                lambda: queued_to_clients(proxy_port) == 0, 5, "the client's connection to go"
            )
            # Reading now, the client finds its stream cut short, not ended as if complete.
            with pytest.raises((http.client.IncompleteRead, ConnectionResetError)):
                stalled.read()
        decode.events = SHORT_EVENTS
        assert short_stream(fleet.proxy_url) == expected_stream(SHORT_EVENTS)
