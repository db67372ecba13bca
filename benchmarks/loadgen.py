"""Closed-loop HTTP/1.1 load generator on raw asyncio protocols (uvloop).

``concurrency`` keep-alive connections each send the same POST request, wait for the whole
response (parsed with ``httptools``: Content-Length, chunked and read-until-close framing), and
immediately send the next one. The first ``warmup_s`` seconds are not measured; then for
``duration_s`` seconds (or until ``max_requests`` measured requests, whichever comes first)
every request that *starts and finishes* inside the window is recorded.

* req/s    = successful (2xx) responses in the window / window length
* p50, p99 = latency percentiles (nearest rank) of those successful requests, send to last byte
* errors   = non-2xx responses + broken/refused connections + malformed responses + timeouts

With ``sse=True`` (CLI ``--sse``) it also measures streamed answers: the time to the first body
byte (TTFB: for an SSE answer, its first event) of every measured 2xx response, and the SSE
events (``data: ...`` blocks, ``[DONE]`` not counted) each one carried; ``expect_events=N``
counts a 2xx answer with another number of events as an error (``sse_events``).

* events/s       = SSE events of the measured 2xx responses / window length
* ttfb p50, p99  = percentiles of send -> first body byte of those responses

Importable::

    result = await run_load("127.0.0.1", 8000, "/v1/completions", body, 64, 10.0, 2.0)

or as a CLI::

    python benchmarks/loadgen.py --port 8000 --concurrency 64 --duration 10 --warmup 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import httptools
import uvloop

DEFAULT_PATH = "/v1/completions"
DEFAULT_BODY = b'{"model": "bench", "prompt": "hello world", "max_tokens": 16}'
DEFAULT_REQUEST_TIMEOUT_S = 30.0
DEFAULT_CONNECT_TIMEOUT_S = 5.0
STOP_GRACE_S = 2.0
_WATCHDOG_PERIOD_S = 0.25
_RECONNECT_BACKOFF_S = 0.05

_clock = time.perf_counter


@dataclass
class LoadResult:
    """Outcome of one closed-loop run. Latencies are in milliseconds."""

    target: str
    concurrency: int
    duration_s: float  # length of the measured window actually used
    requests: int  # responses + failures whose request started and ended in the window
    ok: int  # 2xx responses in the window
    errors: int
    rps: float  # ok / duration_s
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float
    bytes_received: int
    status_counts: dict[str, int] = field(default_factory=dict)
    error_kinds: dict[str, int] = field(default_factory=dict)
    unmeasured_errors: int = 0  # failures during warm-up or the stop grace (not in `errors`)
    total_ok: int = 0  # every 2xx response of the run, warm-up and stop grace included
    client_cpu_s: float | None = None  # this process's CPU (user + system) for the whole run
    # Only with sse=True (None / 0 otherwise):
    ttfb_p50_ms: float | None = None  # send -> first body byte, measured 2xx responses
    ttfb_p90_ms: float | None = None
    ttfb_p99_ms: float | None = None
    sse_events: int = 0  # SSE data events in the measured 2xx responses ([DONE] excluded)
    events_per_s: float = 0.0  # sse_events / duration_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        text = (
            f"{self.target} c={self.concurrency}: {self.rps:,.0f} req/s, "
            f"p50 {self.p50_ms:.3f} ms, p99 {self.p99_ms:.3f} ms, "
            f"errors {self.errors} ({self.ok} ok in {self.duration_s:.2f} s)"
        )
        if self.ttfb_p50_ms is not None and self.ttfb_p99_ms is not None:
            text += (
                f"; {self.events_per_s:,.0f} SSE events/s, TTFB p50 {self.ttfb_p50_ms:.3f} ms,"
                f" p99 {self.ttfb_p99_ms:.3f} ms"
            )
        return text


def build_request(
    host: str, port: int, path: str, body: bytes, extra_headers: dict[str, str] | None = None
) -> bytes:
    """The raw bytes of the keep-alive POST request every connection repeats."""
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {host}:{port}",
        "User-Agent: pdproxy-loadgen",
        "Accept: */*",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
    ]
    for name, value in (extra_headers or {}).items():
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (0 for an empty list)."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


class _Run:
    """State shared by every connection of one run."""

    def __init__(
        self,
        measure_start: float,
        measure_end: float,
        max_requests: int | None,
        expect_events: int | None = None,
    ):
        self.measure_start = measure_start
        self.measure_end = measure_end
        self.max_requests = max_requests
        self.stopping = False
        self.stop_event = asyncio.Event()
        self.latencies: list[float] = []
        self.failures = 0
        self.status_counts: Counter[int] = Counter()
        self.error_kinds: Counter[str] = Counter()
        self.unmeasured_errors = 0
        self.total_ok = 0
        self.bytes_received = 0
        self.conns: set[_Conn] = set()
        self.expect_events = expect_events
        self.ttfbs: list[float] = []
        self.sse_events = 0

    def in_window(self, t_start: float, t_end: float) -> bool:
        return t_start >= self.measure_start and t_end <= self.measure_end

    def record_response(self, t_start: float, t_end: float, status: int) -> None:
        if 200 <= status < 300:
            self.total_ok += 1
        if not self.in_window(t_start, t_end):
            if not 200 <= status < 300:
                self.unmeasured_errors += 1
            return
        self.status_counts[status] += 1
        if 200 <= status < 300:
            self.latencies.append(t_end - t_start)
        else:
            self.failures += 1
            self.error_kinds[f"http_{status}"] += 1
        self._check_stop(t_end)

    def record_stream(
        self, t_start: float, t_first: float | None, t_end: float, status: int, events: int
    ) -> None:
        """A complete response with SSE accounting (``sse=True`` runs)."""
        ok = 200 <= status < 300
        if ok and self.expect_events is not None and events != self.expect_events:
            if self.in_window(t_start, t_end):
                self.status_counts[status] += 1
                self.failures += 1
                self.error_kinds["sse_events"] += 1
                self._check_stop(t_end)
            else:
                self.unmeasured_errors += 1
            return
        if ok and self.in_window(t_start, t_end):
            self.ttfbs.append((t_first if t_first is not None else t_end) - t_start)
            self.sse_events += events
        self.record_response(t_start, t_end, status)

    def _check_stop(self, t_end: float) -> None:
        if (
            self.max_requests is not None
            and len(self.latencies) + self.failures >= self.max_requests
        ):
            self.stop(t_end)

    def record_failure(self, t_start: float, t_end: float, kind: str) -> None:
        if self.in_window(t_start, t_end):
            self.failures += 1
            self.error_kinds[kind] += 1
        else:
            self.unmeasured_errors += 1

    def stop(self, at: float) -> None:
        """End the measured window at `at`: nothing that finishes later is counted."""
        if not self.stopping:
            self.stopping = True
            self.measure_end = max(self.measure_start, min(self.measure_end, at))
            self.stop_event.set()


class _Conn(asyncio.Protocol):
    """One keep-alive client connection driving its own closed loop from parser callbacks."""

    def __init__(self, run: _Run, request: bytes, done: asyncio.Future[str]) -> None:
        self._run = run
        self._request = request
        self._done = done
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.t_send = 0.0
        self.in_flight = False
        self._headers_done = False
        self._framed = False  # Content-Length or chunked seen on the current response
        self._failed = False

    # asyncio callbacks ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, so cast instead of asserting.
        self._transport = cast(asyncio.Transport, transport)
        self._run.conns.add(self)
        self._send()

    def data_received(self, data: bytes) -> None:
        self._run.bytes_received += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self.fail("bad_response")

    def connection_lost(self, exc: Exception | None) -> None:
        self._run.conns.discard(self)
        if self.in_flight and not self._failed:
            self.in_flight = False
            if self._headers_done and not self._framed and exc is None:
                # Read-until-close body: EOF is the end of the message.
                self._complete(_clock(), keep_alive=False)
            else:
                self._run.record_failure(self.t_send, _clock(), "broken_connection")
        self._transport = None
        self._finish("closed")

    # httptools callbacks ----------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._headers_done = False
        self._framed = False

    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered in (b"content-length", b"transfer-encoding"):
            self._framed = True

    def on_headers_complete(self) -> None:
        self._headers_done = True
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            # Interim response (e.g. 100 Continue): llhttp parses the real one next.
            self._headers_done = False

    def on_message_complete(self) -> None:
        if not self.in_flight:
            return  # an interim 1xx message or a response nobody asked for
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            return
        self._complete(_clock(), keep_alive=self._parser.should_keep_alive())

    # closed loop ------------------------------------------------------------------------
    def _record(self, now: float) -> None:
        self._run.record_response(self.t_send, now, self._parser.get_status_code())

    def _complete(self, now: float, keep_alive: bool) -> None:
        self.in_flight = False
        run = self._run
        self._record(now)
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if not keep_alive:
            transport.close()
            return
        if run.stopping or now >= run.measure_end:
            self._finish("done")
            transport.close()
            return
        self._send()

    def _send(self) -> None:
        transport = self._transport
        if transport is None:
            return
        run = self._run
        now = _clock()
        if run.stopping or now >= run.measure_end:
            self._finish("done")
            transport.close()
            return
        self.in_flight = True
        self.t_send = now
        transport.write(self._request)

    def fail(self, kind: str) -> None:
        """Give up on the in-flight request (timeout, bad response) and drop the connection."""
        if self.in_flight and not self._failed:
            self._failed = True
            self.in_flight = False
            self._run.record_failure(self.t_send, _clock(), kind)
        if self._transport is not None:
            self._transport.abort()

    def force_close(self) -> None:
        """End of run: drop the connection; an unfinished request is not counted anywhere."""
        self.in_flight = False
        self._finish("done")
        if self._transport is not None:
            self._transport.abort()

    def _finish(self, reason: str) -> None:
        if not self._done.done():
            self._done.set_result(reason)


_SSE_END = b"\n\n"
_SSE_DONE = b"[DONE]"
_TAIL = 8  # bytes kept from the previous body piece: an event end or [DONE] may span two


class _SseConn(_Conn):
    """A connection that also times the first body byte and counts SSE events per response."""

    def __init__(self, run: _Run, request: bytes, done: asyncio.Future[str]) -> None:
        super().__init__(run, request, done)
        self._t_first: float | None = None
        self._events = 0
        self._tail = b""

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._t_first = None
        self._events = 0
        self._tail = b""

    def on_body(self, body: bytes) -> None:
        if self._t_first is None:
            self._t_first = _clock()
        tail = self._tail
        data = tail + body
        ends = data.count(_SSE_END) - tail.count(_SSE_END)
        dones = data.count(_SSE_DONE) - tail.count(_SSE_DONE)
        self._events += ends - dones
        self._tail = data[-_TAIL:]

    def _record(self, now: float) -> None:
        status = self._parser.get_status_code()
        self._run.record_stream(self.t_send, self._t_first, now, status, self._events)


async def _worker(
    run: _Run,
    host: str,
    port: int,
    request: bytes,
    connect_timeout_s: float,
    conn_class: type[_Conn] = _Conn,
) -> None:
    loop = asyncio.get_running_loop()
    while not run.stopping and _clock() < run.measure_end:
        done: asyncio.Future[str] = loop.create_future()
        t0 = _clock()
        factory = functools.partial(conn_class, run, request, done)
        try:
            await asyncio.wait_for(
                loop.create_connection(factory, host, port), timeout=connect_timeout_s
            )
        except (OSError, TimeoutError) as exc:
            kind = "connect_timeout" if isinstance(exc, TimeoutError) else "connect_refused"
            run.record_failure(t0, _clock(), kind)
            await asyncio.sleep(_RECONNECT_BACKOFF_S)
            continue
        reason = await done
        if reason == "done":
            return
        # The connection closed (server said Connection: close, or it broke): reconnect.


async def _watchdog(run: _Run, request_timeout_s: float) -> None:
    while True:
        await asyncio.sleep(_WATCHDOG_PERIOD_S)
        now = _clock()
        for conn in list(run.conns):
            if conn.in_flight and now - conn.t_send > request_timeout_s:
                conn.fail("timeout")


async def run_load(
    host: str,
    port: int,
    path: str,
    body: bytes | str | dict[str, Any],
    concurrency: int,
    duration_s: float,
    warmup_s: float,
    *,
    max_requests: int | None = None,
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    extra_headers: dict[str, str] | None = None,
    target: str | None = None,
    sse: bool = False,
    expect_events: int | None = None,
) -> LoadResult:
    """Run one closed-loop load test and return its measurements.

    Bounded: it returns at most about ``warmup_s + duration_s + STOP_GRACE_S`` seconds after
    it starts, earlier once ``max_requests`` requests were measured. ``sse=True`` also measures
    TTFB and counts SSE events (``expect_events``: the count every 2xx answer must carry).
    """
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    if duration_s <= 0 or warmup_s < 0:
        raise ValueError("duration_s must be > 0 and warmup_s >= 0")
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    elif isinstance(body, str):
        body = body.encode()
    if expect_events is not None and not sse:
        raise ValueError("expect_events needs sse=True")
    request = build_request(host, port, path, body, extra_headers)
    conn_class = _SseConn if sse else _Conn

    cpu_start = time.process_time()
    start = _clock()
    run = _Run(start + warmup_s, start + warmup_s + duration_s, max_requests, expect_events)
    workers = [
        asyncio.create_task(_worker(run, host, port, request, connect_timeout_s, conn_class))
        for _ in range(concurrency)
    ]
    watchdog = asyncio.create_task(_watchdog(run, request_timeout_s))
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(run.stop_event.wait(), timeout=run.measure_end - _clock())
        run.stop(min(_clock(), run.measure_end))
        # Let in-flight requests finish (they are outside the window, so not counted),
        # which spares the server a burst of aborted requests; then drop what is left.
        _, pending = await asyncio.wait(workers, timeout=STOP_GRACE_S)
        for conn in list(run.conns):
            conn.force_close()
        if pending:
            await asyncio.wait(pending, timeout=1.0)
    finally:
        watchdog.cancel()
        for task in workers:
            task.cancel()
        await asyncio.gather(watchdog, *workers, return_exceptions=True)
        for conn in list(run.conns):
            conn.force_close()

    client_cpu_s = time.process_time() - cpu_start
    window = max(run.measure_end - run.measure_start, 1e-9)
    lat = sorted(run.latencies)
    ok = len(lat)
    ms = 1000.0
    ttfbs = sorted(run.ttfbs)
    return LoadResult(
        target=target or f"{host}:{port}{path}",
        concurrency=concurrency,
        duration_s=window,
        requests=ok + run.failures,
        ok=ok,
        errors=run.failures,
        rps=ok / window,
        p50_ms=percentile(lat, 0.50) * ms,
        p90_ms=percentile(lat, 0.90) * ms,
        p99_ms=percentile(lat, 0.99) * ms,
        mean_ms=(sum(lat) / ok * ms) if ok else 0.0,
        max_ms=(lat[-1] * ms) if ok else 0.0,
        bytes_received=run.bytes_received,
        status_counts={str(k): v for k, v in sorted(run.status_counts.items())},
        error_kinds=dict(sorted(run.error_kinds.items())),
        unmeasured_errors=run.unmeasured_errors,
        total_ok=run.total_ok,
        client_cpu_s=client_cpu_s,
        ttfb_p50_ms=percentile(ttfbs, 0.50) * ms if sse else None,
        ttfb_p90_ms=percentile(ttfbs, 0.90) * ms if sse else None,
        ttfb_p99_ms=percentile(ttfbs, 0.99) * ms if sse else None,
        sse_events=run.sse_events,
        events_per_s=run.sse_events / window,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Closed-loop HTTP/1.1 POST load generator.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--path", default=DEFAULT_PATH)
    parser.add_argument("--body", default=DEFAULT_BODY.decode(), help="request body (JSON text)")
    parser.add_argument("--concurrency", "-c", type=int, default=1)
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds first")
    parser.add_argument("--max-requests", type=int, default=None, help="stop after N measured")
    parser.add_argument("--timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S)
    parser.add_argument(
        "--header", action="append", default=[], metavar="NAME:VALUE", help="extra header"
    )
    parser.add_argument("--target", default=None, help="label for the result")
    parser.add_argument(
        "--sse", action="store_true", help="also measure TTFB and count SSE events per answer"
    )
    parser.add_argument(
        "--expect-events",
        type=int,
        default=None,
        metavar="N",
        help="with --sse: a 2xx answer without exactly N SSE events is an error",
    )
    parser.add_argument(
        "--json", default=None, metavar="PATH", help="write the result as JSON ('-' = stdout)"
    )
    args = parser.parse_args(argv)
    if args.expect_events is not None and not args.sse:
        parser.error("--expect-events needs --sse")

    headers: dict[str, str] = {}
    for item in args.header:
        name, sep, value = item.partition(":")
        if not sep:
            parser.error(f"--header {item!r} is not NAME:VALUE")
        headers[name.strip()] = value.strip()

    result: LoadResult = uvloop.run(
        run_load(
            args.host,
            args.port,
            args.path,
            args.body,
            args.concurrency,
            args.duration,
            args.warmup,
            max_requests=args.max_requests,
            request_timeout_s=args.timeout,
            extra_headers=headers,
            target=args.target,
            sse=args.sse,
            expect_events=args.expect_events,
        )
    )
    if args.json == "-":
        print(json.dumps(result.to_dict()))
    else:
        print(result.summary())
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(result.to_dict(), fh, indent=2)
                fh.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
