"""A very fast fake OpenAI backend for benchmarking pdproxy (and other P/D routers).

A raw asyncio ``Protocol`` HTTP/1.1 server (uvloop, ``httptools`` request
parser) that answers, with keep-alive:

* ``POST /v1/completions`` and ``POST /v1/chat/completions``: a small fixed OpenAI-shaped JSON
  completion (``Content-Length`` set). With ``"stream": true`` in the body it answers an SSE
  body of N events (N = ``max_tokens``, default 16, capped at 4096) followed by
  ``data: [DONE]``, all in one write, framed with ``Content-Length`` (or, with
  ``--stream-chunked``, with chunked transfer-encoding, one HTTP chunk per event).
  A body field ``"bench_token_interval_ms": MS`` (> 0) makes a streamed answer slow instead: the
  head and the first event at once, then one event every MS milliseconds (``[DONE]`` with the
  last), so streams stay open (a benchmark's idle streams). Routers pass the field through.
  With ``"return_token_ids": true`` its chunks carry token ids as vLLM's do (the prompt's in the
  first chunk, each event's own), so a router that asks for them (pdproxy does, for request
  migration) pays for reading them.
* ``GET /health``: 200, empty body.
* ``GET /v1/models``: a one-model list.
* ``GET /bench/stats``: this process's counters as JSON (completions answered, streams, slow
  streams open now, requests that carried ``kv_transfer_params`` or ``bootstrap_room``), so a
  benchmark can check that a router really sent requests to this backend.

With ``--prefill`` it answers as the prefill instance of a P/D pair does: one token whatever
``max_tokens`` says (SGLang's router sends the client's ``max_tokens`` to prefill and decode
alike), and a request carrying ``kv_transfer_params`` with ``do_remote_decode`` gets
``kv_transfer_params`` for the decode side back in its JSON answer, as vLLM's NIXL connector
returns them (vllm-router copies them into the decode request). Without ``--prefill``, nothing
changes for existing users.

Anything else gets a JSON 404/405; an unparsable request gets a 400 and the connection is closed.
Responses are written in request order, so even pipelined requests are answered correctly.

CLI::

    python benchmarks/fast_backend.py --port 8100 [--host 127.0.0.1] [--stream-chunked] [--prefill]

With ``--port 0`` the kernel picks a port; the first stdout line always is
``fast_backend listening on HOST:PORT``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import signal
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, cast

import httptools
import uvloop

try:
    import orjson

    def _loads(data: bytes) -> Any:
        return orjson.loads(data)

    def _dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)

except ImportError:  # pragma: no cover - orjson is a project dependency
    import json

    def _loads(data: bytes) -> Any:
        return json.loads(data)

    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()


MAX_STREAM_EVENTS = 4096
DEFAULT_MAX_TOKENS = 16
MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_TOKEN_INTERVAL_MS = 600_000
TOKEN_INTERVAL_FIELD = "bench_token_interval_ms"
CREATED = int(time.time())
COMPLETION_TEXT = " hello from the fast backend"
# What a vLLM prefill instance with the NIXL connector answers for the decode side (the shape;
# the values mean nothing here).
PREFILL_KV_TRANSFER_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "fast-backend",
    "remote_block_ids": [0],
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
}

_REASONS = {
    200: b"OK",
    400: b"Bad Request",
    404: b"Not Found",
    405: b"Method Not Allowed",
    413: b"Payload Too Large",
}

_COMPLETIONS = b"/v1/completions"
_CHAT = b"/v1/chat/completions"


@dataclass
class Stats:
    """Counters of one backend process (``GET /bench/stats``); a few integer adds per request."""

    completions: int = 0  # 200 answers to completion requests
    streams: int = 0  # ... of which streamed
    slow_streams_open: int = 0  # streams with a token interval still being written
    kv_transfer_params: int = 0  # completion requests that carried kv_transfer_params
    bootstrap_room: int = 0  # completion requests that carried bootstrap_room (SGLang P/D)

    def body(self) -> bytes:
        return _dumps(asdict(self))


def _head(status: int, content_type: bytes, length: int, keep_alive: bool) -> bytes:
    return b"".join(
        (
            b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown")),
            b"Content-Type: " + content_type + b"\r\n",
            b"Content-Length: %d\r\n" % length,
            b"" if keep_alive else b"Connection: close\r\n",
            b"\r\n",
        )
    )


def _chunked_head(keep_alive: bool) -> bytes:
    return b"".join(
        (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n",
            b"" if keep_alive else b"Connection: close\r\n",
            b"\r\n",
        )
    )


def _json_response(status: int, body: bytes, keep_alive: bool) -> bytes:
    return _head(status, b"application/json", len(body), keep_alive) + body


def _error_body(message: str, code: int) -> bytes:
    return _dumps({"error": {"message": message, "type": "invalid_request_error", "code": code}})


@functools.lru_cache(maxsize=1024)
def _completion_body(chat: bool, model: str, max_tokens: int, kv_params: bool = False) -> bytes:
    usage = {
        "prompt_tokens": 2,
        "completion_tokens": max_tokens,
        "total_tokens": 2 + max_tokens,
    }
    extra: dict[str, Any] = {"kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS} if kv_params else {}
    if chat:
        return _dumps(
            {
                "id": "chatcmpl-fastbackend",
                "object": "chat.completion",
                "created": CREATED,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": COMPLETION_TEXT},
                        "logprobs": None,
                        "finish_reason": "length",
                    }
                ],
                "usage": usage,
                **extra,
            }
        )
    return _dumps(
        {
            "id": "cmpl-fastbackend",
            "object": "text_completion",
            "created": CREATED,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "text": COMPLETION_TEXT,
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": usage,
            **extra,
        }
    )


@functools.lru_cache(maxsize=256)
def _stream_events(
    chat: bool, model: str, n_events: int, token_ids: bool = False
) -> tuple[bytes, ...]:
    """The SSE events (each ``data: ...\\n\\n``) of a streamed answer, ``[DONE]`` included."""
    events: list[bytes] = []
    for i in range(n_events):
        last = i == n_events - 1
        finish = "length" if last else None
        if chat:
            delta: dict[str, str] = {"content": " tok"}
            if i == 0:
                delta["role"] = "assistant"
            chunk: dict[str, Any] = {
                "id": "chatcmpl-fastbackend",
                "object": "chat.completion.chunk",
                "created": CREATED,
                "model": model,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                ],
            }
        else:
            chunk = {
                "id": "cmpl-fastbackend",
                "object": "text_completion",
                "created": CREATED,
                "model": model,
                "choices": [
                    {"index": 0, "text": " tok", "logprobs": None, "finish_reason": finish}
                ],
            }
        if token_ids:
            choice = chunk["choices"][0]
            choice["token_ids"] = [100 + i % 500]
            if i == 0:  # vLLM: at the top of a chat chunk, in a completions choice
                (chunk if chat else choice)["prompt_token_ids"] = [1, 2]
        events.append(b"data: " + _dumps(chunk) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return tuple(events)


def _chunk(event: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(event), event)


def _stream_response(
    chat: bool, model: str, n_events: int, keep_alive: bool, chunked: bool, token_ids: bool
) -> bytes:
    events = _stream_events(chat, model, n_events, token_ids)
    if not chunked:
        body = b"".join(events)
        return _head(200, b"text/event-stream", len(body), keep_alive) + body
    parts = [_chunked_head(keep_alive)]
    parts.extend(_chunk(event) for event in events)
    parts.append(b"0\r\n\r\n")
    return b"".join(parts)


class SlowStream:
    """A streamed answer written one event per ``interval_s`` (the first one at once)."""

    __slots__ = ("chunked", "events", "handle", "interval_s", "keep_alive", "next_index")

    def __init__(
        self, events: tuple[bytes, ...], interval_s: float, chunked: bool, keep_alive: bool
    ) -> None:
        self.events = events  # the data events, then [DONE]
        self.interval_s = interval_s
        self.chunked = chunked
        self.keep_alive = keep_alive
        self.next_index = 0
        self.handle: asyncio.TimerHandle | None = None

    def head(self) -> bytes:
        if self.chunked:
            return _chunked_head(self.keep_alive)
        length = sum(len(event) for event in self.events)
        return _head(200, b"text/event-stream", length, self.keep_alive)

    def next_piece(self) -> tuple[bytes, bool]:
        """The next event (with [DONE] and the body's end after the last one); True when done."""
        index = self.next_index
        self.next_index += 1
        done = index >= len(self.events) - 2
        pieces = self.events[index:] if done else (self.events[index],)
        if self.chunked:
            data = b"".join(_chunk(piece) for piece in pieces)
            return (data + b"0\r\n\r\n" if done else data), done
        return b"".join(pieces), done


_HEALTH_OK = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 0\r\n\r\n"
_MODELS_BODY = _dumps(
    {
        "object": "list",
        "data": [{"id": "bench", "object": "model", "created": CREATED, "owned_by": "bench"}],
    }
)


def _int_field(value: Any, default: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        return default
    return value


class BackendProtocol(asyncio.Protocol):
    """One client connection: parse requests with httptools, answer each in order."""

    __slots__ = (
        "_body",
        "_body_size",
        "_chunked",
        "_parser",
        "_paused",
        "_pending",
        "_prefill",
        "_slow",
        "_stats",
        "_too_large",
        "_transport",
        "_url",
    )

    def __init__(
        self, stream_chunked: bool = False, prefill: bool = False, stats: Stats | None = None
    ) -> None:
        self._chunked = stream_chunked
        self._prefill = prefill
        self._stats = stats if stats is not None else Stats()
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._body: list[bytes] = []
        self._body_size = 0
        self._too_large = False
        self._paused = False
        self._slow: SlowStream | None = None  # a slow stream being written
        # Answers to requests pipelined behind a slow stream, in order, with their keep-alive.
        self._pending: collections.deque[tuple[bytes | SlowStream, bool]] | None = None

    # asyncio callbacks ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, so cast instead of asserting.
        self._transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        slow = self._slow
        if slow is not None:
            self._slow = None
            self._stats.slow_streams_open -= 1
            if slow.handle is not None:
                slow.handle.cancel()
        self._pending = None

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reply_and_close(400, "upgrade not supported")
        except httptools.HttpParserError:
            self._reply_and_close(400, "malformed HTTP request")

    def pause_writing(self) -> None:
        # The client is not reading: stop reading its further requests until it catches up.
        if self._transport is not None and not self._paused:
            self._paused = True
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        if self._transport is not None and self._paused:
            self._paused = False
            self._transport.resume_reading()

    # httptools callbacks ----------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url = b""
        self._body = []
        self._body_size = 0
        self._too_large = False

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        if self._body_size > MAX_BODY_BYTES:
            self._too_large = True
            self._body = []
        elif not self._too_large:
            self._body.append(body)

    def on_message_complete(self) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        keep_alive = self._parser.should_keep_alive()
        answer = self._respond(keep_alive)
        if self._slow is not None:
            # A slow stream is still being written: later answers wait their turn.
            if self._pending is None:
                self._pending = collections.deque()
            self._pending.append((answer, keep_alive))
            return
        self._emit(answer, keep_alive)

    # writing ----------------------------------------------------------------------------
    def _emit(self, answer: bytes | SlowStream, keep_alive: bool) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if isinstance(answer, SlowStream):
            self._slow = answer
            self._stats.slow_streams_open += 1
            transport.write(answer.head())
            self._slow_step()
            return
        transport.write(answer)
        if not keep_alive:
            transport.close()

    def _slow_step(self) -> None:
        slow, transport = self._slow, self._transport
        if slow is None or transport is None or transport.is_closing():
            return
        slow.handle = None
        piece, done = slow.next_piece()
        transport.write(piece)
        if not done:
            slow.handle = asyncio.get_running_loop().call_later(slow.interval_s, self._slow_step)
            return
        self._slow = None
        self._stats.slow_streams_open -= 1
        if not slow.keep_alive:
            transport.close()
            return
        while self._pending and self._slow is None:
            self._emit(*self._pending.popleft())

    # request handling -------------------------------------------------------------------
    def _respond(self, keep_alive: bool) -> bytes | SlowStream:
        path = self._url.split(b"?", 1)[0]
        method = self._parser.get_method()
        if path in (_COMPLETIONS, _CHAT):
            if method != b"POST":
                return _json_response(405, _error_body("use POST", 405), keep_alive)
            if self._too_large:
                return _json_response(413, _error_body("body too large", 413), keep_alive)
            return self._completion(path == _CHAT, keep_alive)
        if path == b"/health":
            if keep_alive:
                return _HEALTH_OK
            return _head(200, b"text/plain", 0, False)
        if path == b"/v1/models":
            return _json_response(200, _MODELS_BODY, keep_alive)
        if path == b"/bench/stats":
            return _json_response(200, self._stats.body(), keep_alive)
        return _json_response(404, _error_body("not found", 404), keep_alive)

    def _completion(self, chat: bool, keep_alive: bool) -> bytes | SlowStream:
        raw = b"".join(self._body)
        try:
            request = _loads(raw)
        except ValueError:
            return _json_response(400, _error_body("body is not JSON", 400), keep_alive)
        if not isinstance(request, dict):
            return _json_response(400, _error_body("body is not an object", 400), keep_alive)
        stats = self._stats
        stats.completions += 1
        model = request.get("model")
        if not isinstance(model, str):
            model = "bench"
        kv_params = request.get("kv_transfer_params")
        if kv_params is not None:
            stats.kv_transfer_params += 1
        if "bootstrap_room" in request:
            stats.bootstrap_room += 1
        if self._prefill:
            max_tokens = 1
        else:
            max_tokens = _int_field(
                request.get("max_completion_tokens", request.get("max_tokens")),
                DEFAULT_MAX_TOKENS,
            )
            max_tokens = max(1, min(max_tokens, MAX_STREAM_EVENTS))
        if request.get("stream") is True:
            stats.streams += 1
            interval_ms = _int_field(request.get(TOKEN_INTERVAL_FIELD), 0)
            token_ids = request.get("return_token_ids") is True
            if interval_ms > 0 and max_tokens > 1:
                events = _stream_events(chat, model, max_tokens, token_ids)
                interval_s = min(interval_ms, MAX_TOKEN_INTERVAL_MS) / 1000.0
                return SlowStream(events, interval_s, self._chunked, keep_alive)
            return _stream_response(chat, model, max_tokens, keep_alive, self._chunked, token_ids)
        with_kv = (
            self._prefill
            and isinstance(kv_params, dict)
            and kv_params.get("do_remote_decode") is True
        )
        return _json_response(200, _completion_body(chat, model, max_tokens, with_kv), keep_alive)

    def _reply_and_close(self, status: int, message: str) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        transport.write(_json_response(status, _error_body(message, status), False))
        transport.close()


async def start_server(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    stream_chunked: bool = False,
    prefill: bool = False,
    stats: Stats | None = None,
) -> asyncio.Server:
    """Start the backend on the running loop; ``port=0`` picks a free port."""
    loop = asyncio.get_running_loop()
    shared = stats if stats is not None else Stats()
    return await loop.create_server(
        lambda: BackendProtocol(stream_chunked, prefill, shared),
        host=host,
        port=port,
        backlog=4096,
        reuse_address=True,
    )


async def _serve(host: str, port: int, stream_chunked: bool, prefill: bool) -> None:
    server = await start_server(host, port, stream_chunked=stream_chunked, prefill=prefill)
    bound = server.sockets[0].getsockname()
    print(f"fast_backend listening on {bound[0]}:{bound[1]}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        server.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(server.wait_closed(), timeout=1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Very fast fake OpenAI backend (benchmarks).")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, required=True, help="TCP port (0 = any free port)")
    parser.add_argument(
        "--stream-chunked",
        action="store_true",
        help="frame stream=true answers with chunked transfer-encoding instead of Content-Length",
    )
    parser.add_argument(
        "--prefill",
        action="store_true",
        help="answer as a P/D prefill instance: one token, kv_transfer_params when asked",
    )
    args = parser.parse_args(argv)
    uvloop.run(_serve(args.host, args.port, args.stream_chunked, args.prefill))
    return 0


if __name__ == "__main__":
    sys.exit(main())
