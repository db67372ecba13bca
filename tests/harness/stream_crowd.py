"""Thousands of concurrent streaming completions from one event loop, and what each one got.

Used by tests/integration/test_many_streams.py and benchmarks/bench_streams.py to hold many SSE
streams open through a live proxy, measure the proxy while they are held, and check every stream
afterwards. The client is raw asyncio streams rather than aiohttp or openai: at 2,000+ streams on
a 2-core machine the client's own CPU must stay small, or it would be measured instead of the
proxy.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

SSE_DONE = b"data: [DONE]\n\n"
DEFAULT_CONNECT_LIMIT = 256
_HEAD_END = b"\r\n\r\n"


@dataclass(slots=True)
class StreamRecord:
    """One client stream: its status, its whole de-chunked body and when things happened."""

    index: int
    status: int = 0
    body: bytearray = field(default_factory=bytearray)
    first_data_at: float | None = None  # monotonic: the first SSE event arrived (on a 200)
    ended_at: float | None = None  # monotonic: the response ended (or failed)
    error: str | None = None

    @property
    def open(self) -> bool:
        return self.ended_at is None


@dataclass(frozen=True, slots=True)
class CrowdTarget:
    host: str
    port: int
    path: str
    body: bytes

    def request_bytes(self) -> bytes:
        head = (
            f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(self.body)}\r\n"
            "Connection: close\r\n\r\n"
        )
        return head.encode("latin-1") + self.body


class CrowdError(RuntimeError):
    """The crowd could not be held as asked (a stream failed, or a bound ran out)."""


class StreamCrowd:
    """`count` concurrent streaming requests to one target.

    At most `connect_limit` TCP handshakes are under way at a time, which spreads the burst of
    connections a little; it cannot keep a busy server's accept queue from filling, since a
    handshake completes before the server accepts. Every stream is bounded by `stream_timeout`
    seconds. Use as an async context manager: leaving it cancels any
    stream still running, so a failing caller never leaves sockets behind.
    """

    def __init__(
        self,
        target: CrowdTarget,
        count: int,
        stream_timeout: float,
        connect_limit: int = DEFAULT_CONNECT_LIMIT,
    ) -> None:
        self.target = target
        self.records = [StreamRecord(index) for index in range(count)]
        self._stream_timeout = stream_timeout
        self._connecting = asyncio.Semaphore(connect_limit)
        self._tasks: list[asyncio.Task[None]] = []
        self._with_data = 0
        # Set once every stream has data, or as soon as one ends without any: the waiter
        # learns of a failure at once instead of at its timeout.
        self._settled = asyncio.Event()
        self.started_at = 0.0

    async def __aenter__(self) -> StreamCrowd:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.cancel()

    def start(self) -> None:
        self.started_at = time.monotonic()
        request = self.target.request_bytes()
        self._tasks = [
            asyncio.create_task(self._run(record, request), name=f"stream-{record.index}")
            for record in self.records
        ]

    async def wait_all_streaming(self, within_s: float) -> float:
        """Seconds from start() until every stream had its first SSE event; raises CrowdError
        when a stream ended without one or `within_s` ran out."""
        try:
            async with asyncio.timeout(within_s):
                await self._settled.wait()
        except TimeoutError:
            raise CrowdError(
                f"not every stream had data within {within_s:g}s: {self.describe()}"
            ) from None
        failed = [r for r in self.records if r.first_data_at is None]
        if failed:
            raise CrowdError(f"a stream ended before its first data: {self.describe()}")
        last = max(r.first_data_at or 0.0 for r in self.records)
        return last - self.started_at

    async def wait_any_ended(self, within_s: float) -> None:
        """Wait (bounded) until the first stream ends; a timeout is not an error here."""
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=within_s, return_when=asyncio.FIRST_COMPLETED)

    async def wait_all_ended(self, within_s: float) -> None:
        """Wait (bounded) until every stream ended; failures are in the records."""
        if not self._tasks:
            return
        _, pending = await asyncio.wait(self._tasks, timeout=within_s)
        if pending:
            raise CrowdError(
                f"{len(pending)} streams still open after {within_s:g}s: {self.describe()}"
            )

    async def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def open_count(self) -> int:
        return sum(1 for r in self.records if r.open)

    def describe(self) -> str:
        """Counts and the first few errors: what a failure message needs."""
        with_data = sum(1 for r in self.records if r.first_data_at is not None)
        errors = [f"#{r.index}: {r.error}" for r in self.records if r.error][:5]
        statuses = sorted({r.status for r in self.records})
        return (
            f"{len(self.records)} streams, {with_data} with data, {self.open_count()} open, "
            f"statuses {statuses}, first errors {errors}"
        )

    async def _run(self, record: StreamRecord, request: bytes) -> None:
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(self._stream_timeout):
                async with self._connecting:
                    reader, writer = await asyncio.open_connection(
                        self.target.host, self.target.port
                    )
                writer.write(request)
                await self._read_response(reader, record)
        except TimeoutError:
            record.error = f"no complete answer within {self._stream_timeout:g}s"
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
            record.error = f"{type(e).__name__}: {e}"
        finally:
            record.ended_at = time.monotonic()
            if record.first_data_at is None:
                self._settled.set()
            if writer is not None:
                writer.close()

    async def _read_response(self, reader: asyncio.StreamReader, record: StreamRecord) -> None:
        head = await reader.readuntil(_HEAD_END)
        record.status, headers = parse_head(head)
        if headers.get("transfer-encoding", "").lower() == "chunked":
            async for piece in _dechunked(reader):
                self._received(record, piece)
        elif "content-length" in headers:
            self._received(record, await reader.readexactly(int(headers["content-length"])))
        else:
            self._received(record, await reader.read())

    def _received(self, record: StreamRecord, piece: bytes) -> None:
        record.body += piece
        # An error answer has a body too: only a 200 carrying an SSE event is streaming.
        streaming = record.status == 200 and record.body.startswith(b"data: ")
        if record.first_data_at is None and streaming:
            record.first_data_at = time.monotonic()
            self._with_data += 1
            if self._with_data == len(self.records):
                self._settled.set()


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    """Status and lower-cased headers of an HTTP/1.1 response head."""
    status_line, *lines = head.decode("latin-1").split("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
        raise ValueError(f"not an HTTP/1.1 status line: {status_line!r}")
    headers: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def _dechunked(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The pieces of a chunked body, in order."""
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            await reader.readuntil(b"\r\n")  # no trailers are sent: just the final CRLF
            return
        piece = await reader.readexactly(size)
        if await reader.readexactly(2) != b"\r\n":
            raise ValueError("chunk not followed by CRLF")
        yield piece


def sse_events(body: bytes) -> list[bytes]:
    """The data payloads of an SSE body, `[DONE]` included (events are blank-line separated)."""
    events = body.split(b"\n\n")
    if events and events[-1] == b"":
        events.pop()
    return [event.removeprefix(b"data: ") for event in events]


def stream_problems(record: StreamRecord, tokens: int) -> list[str]:
    """Why `record` is not a complete, well-formed completion stream of `tokens` tokens
    (empty when it is): 200, one JSON chunk per token with one response id, the last with
    finish_reason "length", then `data: [DONE]` and nothing after it."""
    if record.error is not None:
        return [record.error]
    if record.status != 200:
        return [f"HTTP {record.status}: {bytes(record.body[:200])!r}"]
    body = bytes(record.body)
    if not body.endswith(SSE_DONE) or body.count(SSE_DONE) != 1:
        return [f"does not end with one data: [DONE]: ...{body[-200:]!r}"]
    problems: list[str] = []
    payloads = sse_events(body)[:-1]
    if len(payloads) != tokens:
        problems.append(f"{len(payloads)} chunks, expected {tokens}")
    chunks = []
    for payload in payloads:
        try:
            chunks.append(json.loads(payload))
        except ValueError:
            return [*problems, f"not a JSON event: {payload[:200]!r}"]
    problems += _chunk_problems(chunks)
    return problems


def _chunk_problems(chunks: Sequence[Any]) -> list[str]:
    problems = []
    if len({chunk.get("id") for chunk in chunks if isinstance(chunk, dict)}) != 1:
        problems.append("chunks do not share one response id")
    texts = [_choice(chunk).get("text") for chunk in chunks]
    if not all(isinstance(text, str) and text for text in texts):
        problems.append("a chunk carries no text")
    finishes = [_choice(chunk).get("finish_reason") for chunk in chunks]
    if finishes and (finishes[-1] != "length" or any(finishes[:-1])):
        problems.append(f"finish reasons {finishes}: only the last chunk should say length")
    return problems


def _choice(chunk: Any) -> dict[str, Any]:
    if not isinstance(chunk, dict):
        return {}
    choices = chunk.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return {}
    return choices[0]


def completion_body(model: str, max_tokens: int, prompt: str = "hold this stream open") -> bytes:
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    return json.dumps(payload).encode()


def rss_kib(pid: int) -> int:
    """Resident set size of process `pid` (VmRSS in /proc/PID/status), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text(encoding="ascii").splitlines():
        if line.startswith("VmRSS:"):
            value, unit = line.split()[1:3]
            if unit != "kB":
                raise ValueError(f"unexpected VmRSS unit {unit!r}")
            return int(value)
    raise ValueError(f"no VmRSS for pid {pid} (a zombie?)")


def open_fds(pid: int) -> int:
    """File descriptors process `pid` holds now."""
    return sum(1 for _ in Path(f"/proc/{pid}/fd").iterdir())


def sse_event_count(records: Sequence[StreamRecord]) -> int:
    """Data events relayed to the clients, [DONE] excluded."""
    return sum(bytes(r.body).count(b"data: ") - bytes(r.body).count(SSE_DONE) for r in records)
