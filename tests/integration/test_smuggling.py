"""Request smuggling corpus: raw bytes sent to a real `pdproxy serve`, in front of a recording
upstream that keeps the exact bytes each of its connections receives.

For every case two things are asserted:
(a) what the client got back: the status of each response, their count (never an extra
    response for a smuggled request), and whether the connection stayed open (a last request,
    GET /health with Connection: close, must then be the next thing answered);
(b) the exact bytes the upstream got: nothing at all, or exactly the one legitimate request,
    re-framed by pdproxy: its own request line and Host, its own Content-Length, no
    Transfer-Encoding, and the body (the decode leg's is the client's bytes unchanged). No
    byte of a smuggled request, trailer or client framing header ever reaches the upstream.

Some cases pin behaviour being changed in pdproxy/http/server_protocol.py at the time of
writing (upgrades and CONNECT served as plain requests and closed, the 431 head bound, chunked
trailers dropped, several Authorization headers refused) and fail until it lands.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass, field

import pytest

from pdproxy.demo.fleet import LocalFleet
from tests.integration.http_harness import Response, ResponseReader
from tests.integration.support import LoopbackServer

LOOPBACK = "127.0.0.1"
MODEL = "fake-model"
MAX_BODY_BYTES = 4096
PATH = b"/v1/completions"
BODY = b'{"model":"fake-model","prompt":"the smuggling corpus","max_tokens":3}'
# A complete second request: if any of it reaches the upstream, it was smuggled.
SMUGGLED_BODY = b'{"model":"fake-model","prompt":"SMUGGLED","max_tokens":3}'
SMUGGLED = (
    b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(SMUGGLED_BODY), SMUGGLED_BODY)
)
MARKER = b"SMUGGLED"
LAST = b"GET /health HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n\r\n"
PREFILL_ANSWER = b'{"id":"cmpl-prefill","object":"text_completion","choices":[]}'
DECODE_ANSWER = (
    b'{"id":"cmpl-decode","object":"text_completion","model":"fake-model",'
    b'"choices":[{"index":0,"text":"ok","finish_reason":"length"}]}'
)
# The headers pdproxy puts on a leg, in order, when the client sent no Authorization.
LEG_HEADERS = [b"host", b"content-type", b"x-request-id", b"traceparent", b"user-agent"]


# -- the recording upstream --------------------------------------------------------------------


@dataclass
class Received:
    """One request as an upstream connection received it."""

    connection: int
    head: bytes  # the request line and header lines, through the empty line
    body: bytes

    @property
    def request_line(self) -> bytes:
        return self.head.split(b"\r\n", 1)[0]

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        lines = self.head.split(b"\r\n")[1:-2]
        pairs = [line.split(b":", 1) for line in lines]
        return [(name.lower(), value.strip()) for name, value in pairs]

    def header(self, name: bytes) -> list[bytes]:
        return [value for key, value in self.headers if key == name]


@dataclass
class Recording:
    raw: dict[int, bytearray] = field(default_factory=dict)  # connection -> all it received
    requests: list[Received] = field(default_factory=list)


class RecordingUpstream(LoopbackServer):
    """An HTTP/1.1 server on a thread of its own that parses no more than it must: a head up
    to its empty line, a Content-Length body, and keep-alive. It records every byte each
    connection sends; anything else (no length, chunked, bytes it cannot frame) stays in
    `raw` unparsed and ends the connection, for the test to see."""

    stream_limit = 1 << 20

    def __init__(self, answer: bytes) -> None:
        super().__init__()
        self._answer = (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (len(answer), answer)
        )
        self._lock = threading.Lock()
        self._recording = Recording()
        self._connections = 0

    @property
    def spec(self) -> str:
        return f"http={LOOPBACK}:{self.port}"

    def take(self) -> Recording:
        """What was received since the last take."""
        with self._lock:
            recording, self._recording = self._recording, Recording()
        return recording

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with self._lock:
            self._connections += 1
            connection = self._connections
        try:
            while True:
                head = await self._read(reader, connection, reader.readuntil(b"\r\n\r\n"))
                if head is None:
                    return
                length = _content_length(head)
                if length is None:  # not framed the one way pdproxy frames: keep the rest raw
                    self._note(connection, await reader.read(1 << 20))
                    return
                body = await self._read(reader, connection, reader.readexactly(length))
                if body is None:
                    return
                with self._lock:
                    self._recording.requests.append(Received(connection, head, body))
                writer.write(self._answer)
                await writer.drain()
        except (ConnectionError, asyncio.LimitOverrunError):
            self._note(connection, await reader.read(1 << 20))
        finally:
            writer.close()

    async def _read(
        self, reader: asyncio.StreamReader, connection: int, reading: Awaitable[bytes]
    ) -> bytes | None:
        """What `reading` read, recorded; None (the partial read recorded) at EOF."""
        try:
            data = await reading
        except asyncio.IncompleteReadError as exc:
            self._note(connection, exc.partial)
            return None
        self._note(connection, data)
        return data

    def _note(self, connection: int, data: bytes) -> None:
        with self._lock:
            self._recording.raw.setdefault(connection, bytearray()).extend(data)


def _content_length(head: bytes) -> int | None:
    """The one Content-Length of a head without Transfer-Encoding, else None."""
    lengths = []
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.lower() == b"transfer-encoding":
            return None
        if name.lower() == b"content-length":
            lengths.append(value.strip())
    if len(lengths) != 1 or not lengths[0].isdigit():
        return None
    return int(lengths[0])


# -- the proxy ---------------------------------------------------------------------------------


@dataclass
class Stand:
    proxy_port: int
    prefill: RecordingUpstream
    decode: RecordingUpstream


@pytest.fixture(scope="module")
def stand(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stand]:
    """One proxy for the whole corpus, its static prefill and decode the recording upstreams;
    the proxy is stopped by its PID at the end, whatever happened."""
    with (
        RecordingUpstream(PREFILL_ANSWER) as prefill,
        RecordingUpstream(DECODE_ANSWER) as decode,
        contextlib.ExitStack() as stack,
    ):
        fleet = LocalFleet(
            tmp_path_factory.mktemp("smuggling"),
            [],
            proxy_args=[
                "--prefill",
                f"{prefill.spec},zmq={LOOPBACK}:1",
                "--decode",
                f"{decode.spec},zmq={LOOPBACK}:2",
                "--max-body-bytes",
                str(MAX_BODY_BYTES),
                "--max-attempts",
                "1",
                "--log-level",
                "warning",
            ],
        )
        stack.callback(fleet.stop)
        fleet.start()
        assert fleet.proxy_port is not None
        yield Stand(fleet.proxy_port, prefill, decode)


@pytest.fixture
def proxy(stand: Stand) -> Iterator[Stand]:
    """The stand with the upstreams' records emptied before and after the test."""
    stand.prefill.take()
    stand.decode.take()
    yield stand
    stand.prefill.take()
    stand.decode.take()


# -- speaking to the proxy ---------------------------------------------------------------------


@dataclass
class Outcome:
    statuses: list[int]
    responses: list[Response]
    kept_alive: bool  # the last request (GET /health) was answered on the same connection


def converse(
    stand: Stand,
    *parts: bytes,
    count: int,
    timeout: float = 5.0,
    after_answer: bytes = b"",
    gap: float = 0.0,
) -> Outcome:
    """Send `parts` (in separate writes, `gap` seconds apart), read `count` responses (sending
    `after_answer` after the first), then find out whether the connection is still open: if
    the last response did not announce a close, the last request is sent and must be the next
    (and last) thing answered."""
    with socket.create_connection((LOOPBACK, stand.proxy_port), timeout=timeout) as sock:
        reader = ResponseReader(sock, timeout)
        for index, part in enumerate(parts):
            if index and gap:
                time.sleep(gap)  # lets the proxy read the parts apart (one segment each)
            with contextlib.suppress(OSError):  # the proxy may close before all is sent
                sock.sendall(part)
        responses: list[Response] = []
        for _ in range(count):
            response = reader.next()
            assert response is not None, f"closed after {[r.status for r in responses]}"
            responses.append(response)
            if after_answer:
                with contextlib.suppress(OSError):
                    sock.sendall(after_answer)
                after_answer = b""
        kept_alive = False
        if not (responses and responses[-1].closes):
            with contextlib.suppress(OSError):
                sock.sendall(LAST)
            last = reader.next()
            if last is not None:
                assert (last.status, json.loads(last.body)) == (200, {"status": "ok"}), last.raw
                kept_alive = True
        assert reader.after() == b"", "bytes after the last response"
    return Outcome([r.status for r in responses], responses, kept_alive)


def completion(*framing: bytes, body: bytes = BODY, version: bytes = b"1.1") -> bytes:
    """A completion request with the given framing header lines, then `body` as is."""
    lines = [
        b"POST /v1/completions HTTP/%s" % version,
        b"Host: proxy",
        b"Content-Type: application/json",
        *framing,
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def length(body: bytes = BODY) -> bytes:
    return b"Content-Length: %d" % len(body)


def chunked(body: bytes = BODY, size_format: bytes = b"%x", extension: bytes = b"") -> bytes:
    """`body` in two chunks, then the last chunk and the empty line."""
    half = len(body) // 2
    framed = b""
    for part in (body[:half], body[half:]):
        framed += size_format % len(part) + extension + b"\r\n" + part + b"\r\n"
    return framed + b"0\r\n\r\n"


# -- what the upstream got ---------------------------------------------------------------------


def assert_upstream_got_nothing(stand: Stand) -> None:
    for upstream in (stand.prefill, stand.decode):
        recording = upstream.take()
        received = b"".join(recording.raw.values())
        assert received == b"", f"the upstream received {received[:500]!r}"


def assert_upstream_got(
    stand: Stand, bodies: list[bytes], authorization: bytes | None = None
) -> None:
    """Exactly one prefill leg and one decode leg per body, re-framed, and nothing else."""
    prefill, decode = stand.prefill.take(), stand.decode.take()
    for recording in (prefill, decode):
        # Every byte received was part of a request recorded whole: none left over unframed.
        for connection, raw in recording.raw.items():
            framed = b"".join(
                r.head + r.body for r in recording.requests if r.connection == connection
            )
            assert bytes(raw) == framed, f"bytes outside the requests: {bytes(raw)[:500]!r}"
        assert MARKER not in b"".join(recording.raw.values())
        assert len(recording.requests) == len(bodies), recording.requests
    for got, sent in zip(decode.requests, bodies, strict=True):
        assert_leg(got, stand.decode, authorization)
        assert got.body == sent  # the decode leg carries the client's bytes unchanged
    for got, sent in zip(prefill.requests, bodies, strict=True):
        assert_leg(got, stand.prefill, authorization)
        # The prefill leg is the client's request made into one token, not streamed.
        assert json.loads(got.body) == {**json.loads(sent), "max_tokens": 1, "stream": False}


def assert_leg(got: Received, upstream: RecordingUpstream, authorization: bytes | None) -> None:
    assert got.request_line == b"POST /v1/completions HTTP/1.1"
    names = [name for name, _ in got.headers]
    expected = list(LEG_HEADERS)
    if authorization is not None:
        expected.insert(3, b"authorization")
    assert names == [*expected, b"content-length"], got.head
    assert got.header(b"host") == [f"{LOOPBACK}:{upstream.port}".encode()]
    assert got.header(b"content-type") == [b"application/json"]
    assert got.header(b"content-length") == [b"%d" % len(got.body)]
    if authorization is not None:
        assert got.header(b"authorization") == [authorization]


def assert_refused(outcome: Outcome, status: int = 400) -> None:
    """One response, the protocol's refusal, and the connection closed after it."""
    assert outcome.statuses == [status], outcome.responses
    assert outcome.responses[0].closes
    assert not outcome.kept_alive


def assert_served_once(outcome: Outcome, kept_alive: bool = True) -> None:
    assert outcome.statuses == [200], outcome.responses
    assert outcome.responses[0].body == DECODE_ANSWER
    assert outcome.kept_alive is kept_alive


def assert_served_exactly_or_refused(stand: Stand, outcome: Outcome) -> None:
    """For a case the RFC lets a server either accept or refuse: one or the other, whole."""
    if outcome.statuses == [400]:
        assert_refused(outcome)
        assert_upstream_got_nothing(stand)
    else:
        assert_served_once(outcome)
        assert_upstream_got(stand, [BODY])


# -- the corpus: framing the proxy must refuse -------------------------------------------------

REFUSED = {
    "length-and-chunked": completion(
        length(chunked()), b"Transfer-Encoding: chunked", body=chunked()
    ),
    "chunked-and-length": completion(
        b"Transfer-Encoding: chunked", length(chunked()), body=chunked()
    ),
    "length-and-chunked-smuggling": completion(
        b"Content-Length: 4", b"Transfer-Encoding: chunked", body=b"0\r\n\r\n" + SMUGGLED
    ),
    "chunked-by-obs-fold": completion(b"Transfer-Encoding:\r\n chunked", body=chunked()),
    "chunked-then-identity": completion(b"Transfer-Encoding: chunked, identity", body=chunked()),
    "space-before-colon": completion(
        length(), b"Transfer-Encoding : chunked", body=BODY + SMUGGLED
    ),
    "chunked-twice": completion(
        b"Transfer-Encoding: chunked", b"Transfer-Encoding: chunked", body=chunked()
    ),
    "xchunked-with-length": completion(length(), b"Transfer-Encoding: xchunked", body=BODY),
    "lengths-differing": completion(length(), b"Content-Length: 4", body=BODY + SMUGGLED),
    "lengths-equal": completion(length(), length(), body=BODY),
    "length-list": completion(b"Content-Length: %d, %d" % (len(BODY), len(BODY)), body=BODY),
    "length-plus-sign": completion(b"Content-Length: +%d" % len(BODY), body=BODY),
    "length-minus-sign": completion(b"Content-Length: -%d" % len(BODY), body=BODY),
    "length-inner-space": completion(b"Content-Length: 1 %d" % len(BODY), body=BODY),
    "length-hex": completion(b"Content-Length: 0x%x" % len(BODY), body=BODY),
    "bare-lf-everywhere": completion(length(), body=BODY).replace(b"\r\n", b"\n"),
    "bare-lf-one-line": completion(b"X-A: 1\nContent-Length: 4", length(), body=BODY),
    "bare-cr": completion(b"X-A: 1\rContent-Length: 4", length(), body=BODY),
    "obs-fold-any-header": completion(b"X-Folded: a", b" b", length(), body=BODY),
    "obs-fold-tab": completion(b"X-Folded: a", b"\tContent-Length: 4", length(), body=BODY),
    "nul-in-value": completion(b"X-A: a\x00b", length(), body=BODY),
    "invalid-request-line": b"POST /v1/completions HTTP/1.1 x\r\nHost: p\r\n\r\n" + SMUGGLED,
}


@pytest.mark.parametrize("raw", list(REFUSED.values()), ids=list(REFUSED))
def test_ambiguous_or_malformed_framing_is_refused(proxy: Stand, raw: bytes) -> None:
    assert_refused(converse(proxy, raw + SMUGGLED, count=1))
    assert_upstream_got_nothing(proxy)


# After the head was accepted, the body's framing breaks: still one refusal, and nothing of
# the request reaches the upstream (its body never completed).
BROKEN_BODY = {
    "chunk-size-overflow": b"ffffffffffffffff1\r\n" + BODY + b"\r\n0\r\n\r\n",
    "chunk-size-negative": b"-1\r\n" + BODY + b"\r\n0\r\n\r\n",
    "chunk-size-0x": b"0x%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY),
    "chunk-size-not-hex": b"zz\r\n" + BODY + b"\r\n0\r\n\r\n",
    "chunk-longer-than-size": b"4\r\n" + BODY + b"\r\n0\r\n\r\n",
    "chunk-bare-lf": chunked().replace(b"\r\n", b"\n"),
}


@pytest.mark.parametrize("framed", list(BROKEN_BODY.values()), ids=list(BROKEN_BODY))
def test_broken_chunked_body_is_refused(proxy: Stand, framed: bytes) -> None:
    raw = completion(b"Transfer-Encoding: chunked", body=framed)
    assert_refused(converse(proxy, raw + SMUGGLED, count=1))
    assert_upstream_got_nothing(proxy)


@pytest.mark.parametrize("coding", [b"gzip", b"chunked, gzip", b"identity"])
def test_transfer_coding_not_ending_in_chunked_is_refused(proxy: Stand, coding: bytes) -> None:
    # RFC 9112 6.3: the length cannot be known, so the server answers 400 and closes.
    raw = completion(b"Transfer-Encoding: " + coding, body=BODY)
    assert_refused(converse(proxy, raw + SMUGGLED, count=1))
    assert_upstream_got_nothing(proxy)


# -- the corpus: framing the proxy accepts, re-framed upstream ---------------------------------

ACCEPTED = {
    "length": completion(length(), body=BODY),
    "length-leading-zeros": completion(b"Content-Length: 000%d" % len(BODY), body=BODY),
    "length-whitespace": completion(b"Content-Length: \t %d \t" % len(BODY), body=BODY),
    "chunked": completion(b"Transfer-Encoding: chunked", body=chunked()),
    # (Leading whitespace and a trailing space; a trailing tab: see the test after this.)
    "chunked-odd-whitespace": completion(b"Transfer-Encoding: \t chunked ", body=chunked()),
    "chunked-upper-case": completion(b"Transfer-Encoding: CHUNKED", body=chunked()),
    "chunk-size-upper-hex": completion(
        b"Transfer-Encoding: chunked", body=chunked(size_format=b"%X")
    ),
    "chunk-size-leading-zeros": completion(
        b"Transfer-Encoding: chunked", body=chunked(size_format=b"000%x")
    ),
    "chunk-extension": completion(
        b"Transfer-Encoding: chunked", body=chunked(extension=b';ext="0\\r\\n\\r\\n";x=1')
    ),
    "absolute-form-elsewhere": completion(length(), body=BODY).replace(
        b"POST /v1/completions", b"POST http://elsewhere.example/v1/completions"
    ),
    "two-hosts": completion(b"Host: elsewhere.example", length(), body=BODY),
    "client-framing-headers": completion(
        length(),
        b"Connection: keep-alive",
        b"Keep-Alive: timeout=600",
        b"TE: trailers",
        b"Expect: nothing-known",
        body=BODY,
    ),
}


@pytest.mark.parametrize("raw", list(ACCEPTED.values()), ids=list(ACCEPTED))
def test_accepted_framing_reaches_the_upstream_re_framed(proxy: Stand, raw: bytes) -> None:
    assert_served_once(converse(proxy, raw, count=1))
    assert_upstream_got(proxy, [BODY])


def test_chunked_with_a_trailing_tab_is_served_or_refused(proxy: Stand) -> None:
    # A trailing tab is whitespace around the value (RFC 9110 5.5), so this is chunked; a
    # parser that takes the tab for part of the coding must then refuse it (400). Either is
    # safe; no answer at all, or anything reaching the upstream but the request, is not.
    raw = completion(b"Transfer-Encoding: chunked\t", body=chunked())
    assert_served_exactly_or_refused(proxy, converse(proxy, raw, count=1))


def test_http_1_0_chunked_body_is_read_and_the_connection_closed(proxy: Stand) -> None:
    # RFC 9112 6.1: an HTTP/1.0 message with Transfer-Encoding has faulty framing; the
    # connection closes after it, so nothing after it on the connection is read.
    raw = completion(b"Transfer-Encoding: chunked", body=chunked(), version=b"1.0")
    assert_served_once(converse(proxy, raw + SMUGGLED, count=1), kept_alive=False)
    assert_upstream_got(proxy, [BODY])


def test_chunked_trailers_never_reach_the_upstream(proxy: Stand) -> None:
    framed = chunked()[: -len(b"\r\n")] + (
        b"Authorization: Bearer from-a-trailer\r\nX-Smuggled: 1\r\n\r\n"
    )
    raw = completion(b"Transfer-Encoding: chunked", body=framed)
    assert_served_once(converse(proxy, raw, count=1))
    assert_upstream_got(proxy, [BODY])  # no Authorization: the client sent none in its head


def test_framing_field_in_the_trailers_is_dropped_or_refused(proxy: Stand) -> None:
    # A trailer may not frame the message (RFC 9110 6.5.1): dropped like any trailer, or the
    # request refused; never an answer missing, never the field upstream.
    framed = chunked()[: -len(b"\r\n")] + b"Content-Length: 4\r\n\r\n"
    raw = completion(b"Transfer-Encoding: chunked", body=framed)
    assert_served_exactly_or_refused(proxy, converse(proxy, raw, count=1))


def test_client_authorization_is_passed_on_once(proxy: Stand) -> None:
    raw = completion(b"Authorization: Bearer client-key", length(), body=BODY)
    assert_served_once(converse(proxy, raw, count=1))
    assert_upstream_got(proxy, [BODY], authorization=b"Bearer client-key")


def test_several_authorization_headers_are_refused(proxy: Stand) -> None:
    # Which one would count? The check and the forwarding could each pick another.
    raw = completion(
        b"Authorization: Bearer first", b"Authorization: Bearer second", length(), body=BODY
    )
    outcome = converse(proxy, raw, count=1)
    assert outcome.statuses == [400], outcome.responses
    assert_upstream_got_nothing(proxy)


# -- the corpus: requests hidden in bodies -----------------------------------------------------


def test_request_as_a_body_is_only_a_body(proxy: Stand) -> None:
    # The whole of SMUGGLED is the body: not JSON, refused by the endpoint (the connection is
    # fine: the request was framed right), never parsed as a request.
    outcome = converse(proxy, completion(length(SMUGGLED), body=SMUGGLED), count=1)
    assert outcome.statuses == [400]
    assert json.loads(outcome.responses[0].body)["error"]["code"] == "invalid_json"
    assert outcome.kept_alive
    assert_upstream_got_nothing(proxy)


def test_last_chunk_inside_chunk_data_is_data(proxy: Stand) -> None:
    hidden = b"0\r\n\r\n" + SMUGGLED
    framed = b"%x\r\n%s\r\n0\r\n\r\n" % (len(hidden), hidden)
    outcome = converse(proxy, completion(b"Transfer-Encoding: chunked", body=framed), count=1)
    assert outcome.statuses == [400]
    assert outcome.kept_alive
    assert_upstream_got_nothing(proxy)


def test_request_text_inside_a_prompt_is_passed_as_text(proxy: Stand) -> None:
    body = json.dumps(
        {"model": MODEL, "prompt": "x\r\n\r\nPOST /v1/completions HTTP/1.1\r\n", "max_tokens": 3}
    ).encode()
    assert_served_once(converse(proxy, completion(length(body), body=body), count=1))
    assert_upstream_got(proxy, [body])


# -- the corpus: pipelining --------------------------------------------------------------------


def test_pipelined_requests_are_each_served_once(proxy: Stand) -> None:
    second = BODY.replace(b"corpus", b"corpus, again")
    raw = completion(length(), body=BODY) + completion(
        b"Transfer-Encoding: chunked", body=chunked(second)
    )
    outcome = converse(proxy, raw, count=2)
    assert outcome.statuses == [200, 200]
    assert outcome.kept_alive
    assert_upstream_got(proxy, [BODY, second])


def test_requests_after_a_malformed_one_are_never_read(proxy: Stand) -> None:
    bad = b"POST /v1/completions HTTP/1.1\r\nHost: p\r\nBad Header\r\n\r\n"
    assert_refused(converse(proxy, bad + completion(length(), body=BODY) + SMUGGLED, count=1))
    assert_upstream_got_nothing(proxy)


def test_malformed_request_after_a_served_one_is_refused_alone(proxy: Stand) -> None:
    bad = completion(b"Content-Length: 1", b"Content-Length: 2", body=b"xy")
    outcome = converse(proxy, completion(length(), body=BODY), count=2, after_answer=bad + SMUGGLED)
    assert outcome.statuses == [200, 400]
    assert outcome.responses[1].closes and not outcome.kept_alive
    assert_upstream_got(proxy, [BODY])


# -- the corpus: upgrades, CONNECT, 100-continue -----------------------------------------------


def test_h2c_upgrade_is_served_as_http_1_1_then_closed(proxy: Stand) -> None:
    raw = completion(
        b"Connection: Upgrade, HTTP2-Settings",
        b"Upgrade: h2c",
        b"HTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA",
        length(),
        body=BODY,
    )
    outcome = converse(proxy, raw + SMUGGLED, count=1, timeout=3)
    assert_served_once(outcome, kept_alive=False)
    assert outcome.responses[0].closes
    assert_upstream_got(proxy, [BODY])


def test_websocket_upgrade_with_chunked_body_is_served_then_closed(proxy: Stand) -> None:
    raw = completion(
        b"Connection: upgrade",
        b"Upgrade: websocket",
        b"Sec-WebSocket-Version: 13",
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
        b"Transfer-Encoding: chunked",
        body=chunked(),
    )
    outcome = converse(proxy, raw + SMUGGLED, count=1, timeout=3)
    assert_served_once(outcome, kept_alive=False)
    assert outcome.responses[0].closes
    assert_upstream_got(proxy, [BODY])


def test_upgrade_body_sent_apart_is_read_as_the_body(proxy: Stand) -> None:
    # The body arrives after the head, on its own: it is the body (here not JSON, so refused
    # by the endpoint), never the start of a request of its own.
    head = completion(b"Connection: Upgrade", b"Upgrade: h2c", length(SMUGGLED), body=b"")
    outcome = converse(proxy, head, SMUGGLED, count=1, timeout=3, gap=0.2)
    assert outcome.statuses == [400]
    assert json.loads(outcome.responses[0].body)["error"]["code"] == "invalid_json"
    assert outcome.responses[0].closes and not outcome.kept_alive
    assert_upstream_got_nothing(proxy)


def test_connect_is_an_ordinary_request_then_closed(proxy: Stand) -> None:
    raw = completion(length(), body=BODY).replace(b"POST ", b"CONNECT ", 1)
    outcome = converse(proxy, raw + SMUGGLED, count=1, timeout=3)
    assert outcome.statuses == [405]  # the completion endpoint takes POST only
    assert outcome.responses[0].closes and not outcome.kept_alive
    assert_upstream_got_nothing(proxy)


def test_connect_to_an_authority_is_refused_and_closed(proxy: Stand) -> None:
    raw = b"CONNECT 127.0.0.1:1 HTTP/1.1\r\nHost: 127.0.0.1:1\r\n\r\n" + SMUGGLED
    outcome = converse(proxy, raw, count=1, timeout=3)
    [status] = outcome.statuses
    assert status in (400, 404, 405)  # no tunnel: refused, whichever way
    assert outcome.responses[0].closes and not outcome.kept_alive
    assert_upstream_got_nothing(proxy)


def test_early_answer_to_100_continue_closes_before_the_body(proxy: Stand) -> None:
    # Refused on its declared length before the body was asked for: no 100 Continue, and the
    # body the client sends anyway (a request within it) is never read.
    large = b"x" * (MAX_BODY_BYTES + 1 - len(SMUGGLED)) + SMUGGLED
    raw = completion(b"Expect: 100-continue", length(large), body=b"")
    outcome = converse(proxy, raw, count=1, after_answer=large)
    assert outcome.statuses == [413]
    assert outcome.responses[0].closes and not outcome.kept_alive
    assert_upstream_got_nothing(proxy)


def test_early_answer_without_100_continue_drops_the_body(proxy: Stand) -> None:
    # The same refusal for a client that sent its body at once: the body is read to its end
    # and dropped (well within the discard bounds), so the connection stays usable.
    large = b"x" * (MAX_BODY_BYTES + 1 - len(SMUGGLED)) + SMUGGLED
    outcome = converse(proxy, completion(length(large), body=large), count=1)
    assert outcome.statuses == [413]
    assert outcome.kept_alive
    assert_upstream_got_nothing(proxy)


# -- the corpus: the head's bounds -------------------------------------------------------------


def test_more_than_100_header_fields_are_431(proxy: Stand) -> None:
    fields = [b"X-Field-%d: 1" % index for index in range(100)]
    assert_refused(converse(proxy, completion(*fields, length(), body=BODY), count=1), 431)
    assert_upstream_got_nothing(proxy)


def test_head_over_64_kib_is_431(proxy: Stand) -> None:
    fields = [b"X-Field-%d: %s" % (index, b"v" * 1000) for index in range(70)]
    assert_refused(converse(proxy, completion(*fields, length(), body=BODY), count=1), 431)
    assert_upstream_got_nothing(proxy)
