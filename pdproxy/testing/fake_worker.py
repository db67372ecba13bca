"""A fake vLLM worker (prefill or decode) for tests and the demo: no GPU, no model.

    python -m pdproxy fake-worker --role P --port 18100 --kv-port 18101 --proxy 127.0.0.1:30001

It answers vLLM's OpenAI endpoints the way vLLM does (object shapes, ids, SSE framing, validation
errors) with deterministic text, and it imitates P2pNcclConnector's addressing (DESIGN.md
section 2): a prefill worker given a tagged X-Request-Id pushes a small KV payload over ZMQ to
the decode address that vLLM's regex finds in the id, and a decode worker given a tagged id
answers only once that payload arrived, from the prefill address the id names, for the same
prompt. A proxy that tags ids wrongly or sends a leg to the wrong instance gets a loud HTTP 500
instead of a silent success.

Endpoints under /_fake/ let tests in other processes see what arrived (requests, KV traffic,
aborts) and inject failures. Times are `time.monotonic()` ("time", comparable between processes
on one machine) plus `time.time()` ("wall").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import re
import signal
import socket
import sys
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal

import msgpack
import zmq
import zmq.asyncio
from aiohttp import web
from aiohttp.typedefs import Handler

from pdproxy.ids import (
    VLLM_DECODE_SIDE,
    VLLM_PREFILL_SIDE,
    Address,
    AddressError,
    make_address,
    parse_address,
)

log = logging.getLogger(__name__)

# Output words; token i of a completion is VOCABULARY[sha256(prompt_text + str(i)) % len].
# fmt: off
VOCABULARY = (
    "alpha", "bravo", "cache", "delta", "echo", "fleet", "gamma", "hello",
    "index", "joule", "kilo", "lima", "model", "nova", "omega", "prefill",
    "quartz", "relay", "sigma", "token", "union", "vector", "whisky", "xenon",
    "yield", "zulu", "decode", "tensor", "block", "layer", "head", "stream",
)
# fmt: on
DEFAULT_MAX_TOKENS = 16
RECORD_LIMIT = 1000  # each /_fake/ ring keeps the last this many entries
EVENT_NAMES = ("kv_sent", "kv_received", "kv_ok", "kv_failed", "aborted", "completed")
KV_STORE_LIMIT = 10_000
KV_STORE_TTL_S = 60.0
KV_SENDER_CACHE = 64  # PUSH sockets kept open, one per decode destination
KV_SNDHWM = 1000
KV_FRAME_TAG = b"kv"
ANNOUNCE_SNDHWM = 16  # a dead registry must not make stale announcements pile up
ANNOUNCE_LINGER_MS = 500  # long enough for a final "leave" to get out, short enough to exit fast
LEAVE_SEND_TIMEOUT_S = 0.5
HTTP_SHUTDOWN_TIMEOUT_S = 1.0
MAX_BODY_BYTES = 64 * 1024 * 1024

Role = Literal["P", "D"]


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True, slots=True)
class Geometry:
    tp_size: int = 1
    block_size: int = 16
    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 32
    kv_dtype: str = "float16"
    is_mla: bool = False
    kv_layout: str = "NHD"


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    role: Role
    http: Address
    kv: Address
    proxy: Address | None
    announce: Literal["v0", "v1"]
    announce_interval_s: float
    model: str
    token_latency_s: float
    prefill_latency_s: float
    kv_timeout_s: float
    max_model_len: int
    connector: str
    geometry: Geometry


# --------------------------------------------------------------------------- errors


def error_type(status: int) -> str:
    """vLLM / OpenAI error type for a status: 400 -> BadRequestError, 500 -> InternalServerError."""
    try:
        name = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
    except ValueError:
        return "APIError"
    return name if name.endswith("Error") else f"{name}Error"


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": error_type(status), "param": param, "code": status}
    }


class ApiError(Exception):
    """A request vLLM would refuse; becomes an OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def response(self) -> web.Response:
        return json_response(error_body(self.status, self.message, self.param), self.status)


def json_response(body: Any, status: int = 200) -> web.Response:
    # body= (not text=) so the Content-Type is plain "application/json", as vLLM sends it.
    payload = json.dumps(body, separators=(",", ":")).encode()
    return web.Response(status=status, body=payload, content_type="application/json")


# --------------------------------------------------------------------------- request parsing


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    tokens: int


@dataclass(frozen=True, slots=True)
class Generation:
    """A validated completion or chat request."""

    chat: bool
    prompts: tuple[Prompt, ...]
    max_tokens: int
    stream: bool
    include_usage: bool


def text_prompt(text: str) -> Prompt:
    return Prompt(text, len(text.split()))


def token_prompt(ids: list[Any]) -> Prompt:
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ApiError(400, "prompt token ids must be integers", "prompt")
    return Prompt(" ".join(map(str, ids)), len(ids))


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"Invalid JSON in request body: {err}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "Request body must be a JSON object")
    return body


def parse_prompts(value: Any) -> tuple[Prompt, ...]:
    """`prompt`: a string, a list of strings, a list of ints, or a list of lists of ints."""
    if value is None:
        raise ApiError(400, "Field required: prompt", "prompt")
    if isinstance(value, str):
        return (text_prompt(value),)
    if not isinstance(value, list) or not value:
        raise ApiError(400, "prompt must be a string or a non-empty list", "prompt")
    if all(isinstance(item, str) for item in value):
        return tuple(text_prompt(item) for item in value)
    if all(isinstance(item, list) for item in value):
        return tuple(token_prompt(item) for item in value)
    return (token_prompt(value),)


def message_text(message: Any) -> str:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ApiError(400, "each message must be an object with a string 'role'", "messages")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        # OpenAI content parts; only text parts carry prompt text here.
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        )
    raise ApiError(400, "message content must be a string, a list of parts or null", "messages")


def parse_messages(value: Any) -> Prompt:
    """Chat `messages` -> one prompt: the message contents joined by newlines."""
    if value is None:
        raise ApiError(400, "Field required: messages", "messages")
    if not isinstance(value, list) or not value:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    return text_prompt("\n".join(message_text(m) for m in value))


def parse_max_tokens(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ApiError(400, f"{name} must be an integer, got {value!r}", name)
    if value < 1:
        raise ApiError(400, f"{name} must be at least 1, got {value}.", name)
    return value


def check_sampling(body: dict[str, Any]) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        # Loud rather than silently answering one choice where vLLM would answer n.
        raise ApiError(400, f"fake worker supports only n=1, got {n!r}", "n")
    temperature = body.get("temperature")
    if temperature is None:
        return
    if not isinstance(temperature, int | float) or isinstance(temperature, bool):
        raise ApiError(400, f"temperature must be a number, got {temperature!r}", "temperature")
    if temperature < 0:
        raise ApiError(400, f"temperature must be non-negative, got {temperature}.", "temperature")


def parse_stream(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage). vLLM refuses stream_options on a non-streaming request."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, f"stream must be a boolean, got {stream!r}", "stream")
    options = body.get("stream_options")
    if options is None:
        return bool(stream), False
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    if not stream:
        raise ApiError(
            400, "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    return True, bool(options.get("include_usage"))


def check_context_length(prompts: tuple[Prompt, ...], max_tokens: int, max_model_len: int) -> None:
    for prompt in prompts:
        total = prompt.tokens + max_tokens
        if total > max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {total} tokens ({prompt.tokens} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion.",
            )


def parse_generation(body: dict[str, Any], chat: bool, max_model_len: int) -> Generation:
    if chat:
        # Like vLLM: max_completion_tokens wins over the deprecated max_tokens.
        completion_max = parse_max_tokens(body, "max_completion_tokens")
        legacy_max = parse_max_tokens(body, "max_tokens")
        max_tokens = completion_max if completion_max is not None else legacy_max
        prompts: tuple[Prompt, ...] = (parse_messages(body.get("messages")),)
    else:
        max_tokens = parse_max_tokens(body, "max_tokens")
        prompts = parse_prompts(body.get("prompt"))
    check_sampling(body)
    stream, include_usage = parse_stream(body)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    check_context_length(prompts, max_tokens, max_model_len)
    return Generation(chat, prompts, max_tokens, stream, include_usage)


def check_model(body: dict[str, Any], served: str) -> None:
    model = body.get("model")
    if model is not None and model != served:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")


# --------------------------------------------------------------------------- output


def generated_words(prompt_text: str, count: int) -> list[str]:
    """Deterministic "tokens": the same prompt gives the same words, streamed or not."""
    words = []
    for i in range(count):
        digest = hashlib.sha256(f"{prompt_text}{i}".encode()).digest()
        words.append(VOCABULARY[int.from_bytes(digest[:8], "big") % len(VOCABULARY)])
    return words


def kv_payload(generation: Generation) -> bytes:
    """What a P "computes" for a request; a D checks it got the KV of its own prompt."""
    return hashlib.sha256("\x00".join(p.text for p in generation.prompts).encode()).digest()


def usage(generation: Generation) -> dict[str, Any]:
    prompt_tokens = sum(p.tokens for p in generation.prompts)
    completion_tokens = generation.max_tokens * len(generation.prompts)
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


def finish_reason(step: int, generation: Generation) -> str | None:
    # Nothing ever "stops": every completion runs to max_tokens.
    return "length" if step == generation.max_tokens - 1 else None


@dataclass(frozen=True, slots=True)
class Envelope:
    """The fields every response object and chunk of one request shares."""

    id: str
    created: int
    model: str

    def wrap(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        return {**body, "choices": choices, **extra}


def full_response(env: Envelope, generation: Generation) -> dict[str, Any]:
    choices = []
    for index, prompt in enumerate(generation.prompts):
        text = "".join(f" {w}" for w in generated_words(prompt.text, generation.max_tokens))
        if generation.chat:
            message = {"role": "assistant", "content": text}
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                }
            )
        else:
            choices.append(
                {
                    "index": index,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                }
            )
    obj = "chat.completion" if generation.chat else "text_completion"
    return env.wrap(obj, choices, usage=usage(generation))


def stream_choice(
    generation: Generation, index: int, delta: dict[str, Any] | str, finish: str | None
) -> dict[str, Any]:
    if generation.chat:
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {
        "index": index,
        "text": delta,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
    }


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


# --------------------------------------------------------------------------- records


def stamp() -> dict[str, float]:
    return {"time": time.monotonic(), "wall": time.time()}


class Records:
    """What the worker saw, for GET /_fake/requests and /_fake/events (bounded rings)."""

    def __init__(self) -> None:
        self.requests: deque[dict[str, Any]] = deque(maxlen=RECORD_LIMIT)
        self.events: dict[str, deque[Any]] = {n: deque(maxlen=RECORD_LIMIT) for n in EVENT_NAMES}

    def add(self, event: str, entry: Any) -> None:
        self.events[event].append(entry)

    def events_snapshot(self) -> dict[str, list[Any]]:
        return {name: list(entries) for name, entries in self.events.items()}

    def clear(self) -> None:
        self.requests.clear()
        for entries in self.events.values():
            entries.clear()


@dataclass(frozen=True, slots=True)
class Behaviour:
    """Injected by POST /_fake/behaviour; applies to every later completion request."""

    status: int | None = None
    error_body: Any = None
    delay_s: float | None = None

    def response(self) -> web.Response:
        """The injected answer: `error_body` verbatim (a string as raw text), else vLLM-shaped."""
        assert self.status is not None
        if isinstance(self.error_body, str):
            return web.Response(status=self.status, text=self.error_body)
        body = self.error_body
        if body is None:
            body = error_body(self.status, f"fake worker: injected HTTP {self.status}")
        return json_response(body, self.status)

    def as_json(self) -> dict[str, Any]:
        delay_ms = None if self.delay_s is None else self.delay_s * 1000.0
        return {"status": self.status, "error_body": self.error_body, "delay_ms": delay_ms}


def parse_behaviour(body: dict[str, Any]) -> Behaviour:
    """The whole behaviour is replaced: an absent or null field means "normal"."""
    status = body.get("status")
    if status is not None and (
        not isinstance(status, int) or isinstance(status, bool) or not 400 <= status <= 599
    ):
        raise ApiError(400, "status must be an integer in 400..599 or null", "status")
    delay_ms = body.get("delay_ms")
    if delay_ms is not None and (
        not isinstance(delay_ms, int | float) or isinstance(delay_ms, bool) or delay_ms < 0
    ):
        raise ApiError(400, "delay_ms must be a non-negative number or null", "delay_ms")
    delay_s = None if delay_ms is None else float(delay_ms) / 1000.0
    return Behaviour(status, body.get("error_body"), delay_s)


# --------------------------------------------------------------------------- KV handoff


@dataclass(frozen=True, slots=True)
class KvItem:
    sender: str
    payload: bytes
    arrived: float  # monotonic


class KvStore:
    """KV payloads received by this worker, keyed by request id, and the requests awaiting them."""

    def __init__(self, limit: int = KV_STORE_LIMIT, ttl_s: float = KV_STORE_TTL_S) -> None:
        self._limit = limit
        self._ttl_s = ttl_s
        self._items: OrderedDict[str, KvItem] = OrderedDict()  # oldest first
        self._waiters: dict[str, set[asyncio.Future[KvItem]]] = {}

    def put(self, request_id: str, item: KvItem) -> None:
        self._items.pop(request_id, None)
        self._items[request_id] = item
        self._prune(item.arrived)
        for waiter in self._waiters.get(request_id, ()):
            if not waiter.done():
                waiter.set_result(item)

    def _prune(self, now: float) -> None:
        while self._items:
            oldest = next(iter(self._items.values()))
            if len(self._items) <= self._limit and now - oldest.arrived <= self._ttl_s:
                break
            self._items.popitem(last=False)

    async def wait(self, request_id: str, timeout_s: float) -> KvItem | None:
        """The payload for `request_id`, waiting at most `timeout_s`; None on timeout."""
        item = self._items.get(request_id)
        if item is not None and time.monotonic() - item.arrived <= self._ttl_s:
            return item
        waiter: asyncio.Future[KvItem] = asyncio.get_running_loop().create_future()
        waiters = self._waiters.setdefault(request_id, set())
        waiters.add(waiter)
        try:
            return await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            return None
        finally:  # also on cancellation: no waiter outlives its request
            waiters.discard(waiter)
            if not waiters:
                self._waiters.pop(request_id, None)


async def receive_kv(sock: zmq.asyncio.Socket, store: KvStore, records: Records) -> None:
    """Pull [b"kv", request_id, sender zmq address, payload] frames into the store, forever."""
    while True:
        frames = await sock.recv_multipart()
        if len(frames) != 4 or frames[0] != KV_FRAME_TAG:
            log.warning("fake worker: ignoring a malformed KV message (%d frames)", len(frames))
            continue
        try:
            request_id, sender = frames[1].decode(), frames[2].decode()
        except UnicodeDecodeError:
            log.warning("fake worker: ignoring a KV message with a non-UTF-8 id or sender")
            continue
        store.put(request_id, KvItem(sender, frames[3], time.monotonic()))
        records.add(
            "kv_received",
            {"request_id": request_id, "sender": sender, "bytes": len(frames[3]), **stamp()},
        )


class KvSender:
    """PUSH sockets to decode workers, one per destination, least recently used closed first."""

    def __init__(self, ctx: zmq.asyncio.Context, own_address: str) -> None:
        self._ctx = ctx
        self._own = own_address.encode()
        self._sockets: OrderedDict[str, zmq.asyncio.Socket] = OrderedDict()

    def _socket(self, destination: str) -> zmq.asyncio.Socket:
        sock = self._sockets.get(destination)
        if sock is not None:
            self._sockets.move_to_end(destination)
            return sock
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, KV_SNDHWM)
        try:
            sock.connect(f"tcp://{destination}")
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        self._sockets[destination] = sock
        while len(self._sockets) > KV_SENDER_CACHE:
            self._sockets.popitem(last=False)[1].close(linger=0)
        return sock

    async def push(
        self, destination: str, request_id: str, payload: bytes, timeout_s: float
    ) -> None:
        """Queue the payload for `destination`; raises zmq.ZMQError or TimeoutError."""
        frames = [KV_FRAME_TAG, request_id.encode(), self._own, payload]
        # asyncio sockets never block the loop, but a full queue would wait forever.
        await asyncio.wait_for(self._socket(destination).send_multipart(frames), timeout_s)

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()


def engine_request_id(header_id: str, chat: bool) -> str:
    """The id vLLM's engine (and so its connector regexes) sees for X-Request-Id."""
    suffix = uuid.uuid4().hex[:8]
    return f"chatcmpl-{header_id}-{suffix}" if chat else f"cmpl-{header_id}-0-{suffix}"


def regex_address(pattern: re.Pattern[str], engine_id: str) -> str | None:
    """ "host:port" as vLLM's greedy regex captures it, unvalidated (as vLLM uses it)."""
    match = pattern.search(engine_id)
    return None if match is None else f"{match[1]}:{int(match[2])}"


# --------------------------------------------------------------------------- announcing


def announce_message(cfg: WorkerConfig, op: str, running: int) -> dict[str, Any]:
    base = {"type": cfg.role, "http_address": str(cfg.http), "zmq_address": str(cfg.kv)}
    if cfg.announce == "v0":
        return base  # byte-for-byte what stock vLLM's P2pNcclEngine sends
    message: dict[str, Any] = {"v": 1, "op": op, **base}
    if op == "announce":
        geometry = cfg.geometry
        message |= {
            "model": cfg.model,
            "connector": cfg.connector,
            "geometry": {
                "tp_size": geometry.tp_size,
                "block_size": geometry.block_size,
                "num_layers": geometry.num_layers,
                "num_kv_heads": geometry.num_kv_heads,
                "head_dim": geometry.head_dim,
                "kv_dtype": geometry.kv_dtype,
                "is_mla": geometry.is_mla,
                "kv_layout": geometry.kv_layout,
            },
            "load": {"running": running, "waiting": 0, "kv_usage": 0.0},
        }
    return message


async def send_frame(sock: zmq.asyncio.Socket, message: dict[str, Any], timeout_s: float) -> bool:
    try:
        await asyncio.wait_for(sock.send(msgpack.packb(message)), timeout_s)
    except TimeoutError:
        log.debug("fake worker: registry not reachable, %s dropped", message.get("op", "announce"))
        return False
    return True


async def announce_forever(
    cfg: WorkerConfig, sock: zmq.asyncio.Socket, running: Callable[[], int]
) -> None:
    while True:
        message = announce_message(cfg, "announce", running())
        await send_frame(sock, message, cfg.announce_interval_s)
        await asyncio.sleep(cfg.announce_interval_s)


def registry_socket(ctx: zmq.asyncio.Context, cfg: WorkerConfig) -> zmq.asyncio.Socket:
    assert cfg.proxy is not None
    sock = ctx.socket(zmq.DEALER)
    # The registry's ROUTER sees this identity frame; stock vLLM uses its zmq_address.
    sock.setsockopt(zmq.IDENTITY, str(cfg.kv).encode())
    sock.setsockopt(zmq.LINGER, ANNOUNCE_LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, ANNOUNCE_SNDHWM)
    sock.connect(f"tcp://{cfg.proxy}")
    return sock


# --------------------------------------------------------------------------- the worker


@dataclass(slots=True)
class Exchange:
    """One completion request as the records know it."""

    record_id: str  # X-Request-Id, or the response id when the header is absent
    path: str
    aborted: bool = False


class FakeWorker:
    """All state of one fake worker; built in run_worker and handed to the aiohttp app."""

    def __init__(self, cfg: WorkerConfig, ctx: zmq.asyncio.Context) -> None:
        self.cfg = cfg
        self.records = Records()
        self.behaviour = Behaviour()
        self.kv_store = KvStore()
        self.kv_sender = KvSender(ctx, str(cfg.kv))
        self.in_flight = 0
        self.started = int(time.time())

    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._record_request], client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/_fake/requests", self.fake_requests)
        app.router.add_get("/_fake/events", self.fake_events)
        app.router.add_get("/_fake/behaviour", self.get_behaviour)
        app.router.add_post("/_fake/behaviour", self.set_behaviour)
        app.router.add_post("/_fake/reset", self.fake_reset)
        return app

    @web.middleware
    async def _record_request(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.path.startswith("/_fake/"):
            raw = await request.read() if request.can_read_body else b""
            try:
                body = json.loads(raw) if raw else None
            except (json.JSONDecodeError, UnicodeDecodeError):
                body = None
            headers = {name.lower(): value for name, value in request.headers.items()}
            entry = {"path": request.path, "method": request.method, "headers": headers}
            self.records.requests.append({**entry, "body": body, **stamp()})
        return await handler(request)

    # ---- vLLM endpoints

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def models(self, request: web.Request) -> web.StreamResponse:
        card = {
            "id": self.cfg.model,
            "object": "model",
            "created": self.started,
            "owned_by": "vllm",
            "root": self.cfg.model,
            "parent": None,
            "max_model_len": self.cfg.max_model_len,
        }
        return json_response({"object": "list", "data": [card]})

    async def health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=200)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        header_id = request.headers.get("X-Request-Id")
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{header_id or uuid.uuid4().hex}"
        exchange = Exchange(header_id or response_id, request.path)
        self.in_flight += 1
        try:
            return await self._answer(request, chat, header_id, response_id, exchange)
        except asyncio.CancelledError:
            # handler_cancellation: the client went away (or the server is stopping).
            self._record_abort(exchange)
            raise
        finally:
            self.in_flight -= 1

    def _record_abort(self, exchange: Exchange) -> None:
        if not exchange.aborted:
            exchange.aborted = True
            self.records.add(
                "aborted", {"request_id": exchange.record_id, "path": exchange.path, **stamp()}
            )

    async def _answer(
        self,
        request: web.Request,
        chat: bool,
        header_id: str | None,
        response_id: str,
        exchange: Exchange,
    ) -> web.StreamResponse:
        behaviour = self.behaviour
        await sleep(behaviour.delay_s)
        if behaviour.status is not None:
            return behaviour.response()
        try:
            body = parse_json_object(await request.read())
            check_model(body, self.cfg.model)
            generation = parse_generation(body, chat, self.cfg.max_model_len)
            await self._before_first_token(header_id, generation)
        except ApiError as err:
            return err.response()
        env = Envelope(response_id, int(time.time()), self.cfg.model)
        if generation.stream:
            return await self._stream(request, env, generation, exchange)
        await sleep(self.cfg.token_latency_s * generation.max_tokens)
        self.records.add("completed", exchange.record_id)
        return json_response(full_response(env, generation))

    async def _stream(
        self, request: web.Request, env: Envelope, generation: Generation, exchange: Exchange
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        try:
            await response.prepare(request)
            async for chunk in self._chunks(env, generation):
                await response.write(sse(chunk))
            await response.write(SSE_DONE)
        except ConnectionResetError:
            # The peer closed before the handler was cancelled; aiohttp copes with the return.
            self._record_abort(exchange)
            return response
        self.records.add("completed", exchange.record_id)
        return response

    async def _chunks(self, env: Envelope, generation: Generation) -> AsyncIterator[dict[str, Any]]:
        obj = "chat.completion.chunk" if generation.chat else "text_completion"
        words = [generated_words(p.text, generation.max_tokens) for p in generation.prompts]
        if generation.chat:  # vLLM opens each chat choice with a role-only delta
            for index in range(len(words)):
                role = {"role": "assistant", "content": ""}
                yield env.wrap(obj, [stream_choice(generation, index, role, None)])
        for step in range(generation.max_tokens):
            await sleep(self.cfg.token_latency_s)
            finish = finish_reason(step, generation)
            for index, prompt_words in enumerate(words):
                text = f" {prompt_words[step]}"
                delta: dict[str, Any] | str = {"content": text} if generation.chat else text
                yield env.wrap(obj, [stream_choice(generation, index, delta, finish)])
        if generation.include_usage:
            yield env.wrap(obj, [], usage=usage(generation))

    # ---- KV handoff

    async def _before_first_token(self, header_id: str | None, generation: Generation) -> None:
        """Prefill latency and the KV handoff a tagged id asks for; raises ApiError on failure."""
        engine_id = None if header_id is None else engine_request_id(header_id, generation.chat)
        if self.cfg.role == "P":
            await sleep(self.cfg.prefill_latency_s)
            decode = None if engine_id is None else regex_address(VLLM_PREFILL_SIDE, engine_id)
            if header_id is not None and decode is not None:
                await self._push_kv(header_id, decode, generation)
            return
        prefill = None if engine_id is None else regex_address(VLLM_DECODE_SIDE, engine_id)
        if header_id is not None and engine_id is not None and prefill is not None:
            await self._await_kv(header_id, engine_id, prefill, generation)
        else:  # untagged: this D computes the prompt itself
            await sleep(self.cfg.prefill_latency_s)

    async def _push_kv(self, request_id: str, decode: str, generation: Generation) -> None:
        try:
            await self.kv_sender.push(
                decode, request_id, kv_payload(generation), self.cfg.kv_timeout_s
            )
        except (zmq.ZMQError, TimeoutError) as err:
            reason = "send_timeout" if isinstance(err, TimeoutError) else "send_error"
            self.records.add("kv_failed", {"request_id": request_id, "reason": reason, **stamp()})
            raise ApiError(
                500, f"fake prefill: cannot push KV for request {request_id} to decode {decode}"
            ) from None
        self.records.add("kv_sent", {"request_id": request_id, "to": decode, **stamp()})

    async def _await_kv(
        self, request_id: str, engine_id: str, prefill: str, generation: Generation
    ) -> None:
        item = await self.kv_store.wait(request_id, self.cfg.kv_timeout_s)
        if item is None:
            reason = "timeout"
            message = (
                f"fake decode: no KV for request {request_id} from prefill {prefill} "
                f"within {self.cfg.kv_timeout_s}s"
            )
            named_decode = regex_address(VLLM_PREFILL_SIDE, engine_id)
            if named_decode is not None and named_decode != str(self.cfg.kv):
                message += f" (the id names decode {named_decode}, this worker is {self.cfg.kv})"
        elif item.sender != prefill:
            reason = "wrong_sender"
            message = (
                f"fake decode: KV for request {request_id} came from {item.sender}, "
                f"but the request id names prefill {prefill}"
            )
        elif item.payload != kv_payload(generation):
            reason = "payload_mismatch"
            message = (
                f"fake decode: KV for request {request_id} from {item.sender} was computed "
                "for a different prompt"
            )
        else:
            self.records.add("kv_ok", request_id)
            return
        self.records.add("kv_failed", {"request_id": request_id, "reason": reason, **stamp()})
        raise ApiError(500, message)

    # ---- control endpoints

    async def fake_requests(self, request: web.Request) -> web.StreamResponse:
        return json_response(list(self.records.requests))

    async def fake_events(self, request: web.Request) -> web.StreamResponse:
        return json_response(self.records.events_snapshot())

    async def get_behaviour(self, request: web.Request) -> web.StreamResponse:
        return json_response(self.behaviour.as_json())

    async def set_behaviour(self, request: web.Request) -> web.StreamResponse:
        try:
            self.behaviour = parse_behaviour(parse_json_object(await request.read()))
        except ApiError as err:
            return err.response()
        return json_response(self.behaviour.as_json())

    async def fake_reset(self, request: web.Request) -> web.StreamResponse:
        self.records.clear()
        return json_response({"ok": True})


async def sleep(seconds: float | None) -> None:
    if seconds:
        await asyncio.sleep(seconds)


# --------------------------------------------------------------------------- lifecycle


def zmq_bind_host(host: str) -> str:
    """ZMQ binds to an interface or IP, not a DNS name: resolve names such as "localhost"."""
    try:
        socket.inet_aton(host)
    except OSError:
        return socket.gethostbyname(host)
    return host


async def run_worker(cfg: WorkerConfig) -> int:
    """Serve until SIGTERM/SIGINT (exit 0); 1 if a port cannot be bound."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    ctx = zmq.asyncio.Context()
    worker = FakeWorker(cfg, ctx)
    async with contextlib.AsyncExitStack() as stack:
        # Unwound in reverse order; the context goes last, after every socket is closed.
        stack.callback(ctx.term)
        stack.callback(worker.kv_sender.close)
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
            stack.callback(loop.remove_signal_handler, signum)

        kv_socket = ctx.socket(zmq.PULL)
        kv_socket.setsockopt(zmq.LINGER, 0)
        stack.callback(kv_socket.close, 0)
        runner = web.AppRunner(
            worker.build_app(),
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=HTTP_SHUTDOWN_TIMEOUT_S,
        )
        try:
            kv_socket.bind(f"tcp://{zmq_bind_host(cfg.kv.host)}:{cfg.kv.port}")
            await runner.setup()
            stack.push_async_callback(runner.cleanup)
            await web.TCPSite(runner, cfg.http.host, cfg.http.port).start()
        except (OSError, zmq.ZMQError) as err:
            print(f"fake-worker: cannot bind: {err}", file=sys.stderr)
            return 1

        stack.push_async_callback(
            cancel_task, loop.create_task(receive_kv(kv_socket, worker.kv_store, worker.records))
        )
        if cfg.proxy is not None:
            await start_announcing(stack, ctx, cfg, lambda: worker.in_flight)
        print(
            f"fake-worker ready: role={cfg.role} http={cfg.http} kv={cfg.kv} model={cfg.model}",
            flush=True,
        )
        await stop.wait()
    return 0


async def start_announcing(
    stack: contextlib.AsyncExitStack,
    ctx: zmq.asyncio.Context,
    cfg: WorkerConfig,
    running: Callable[[], int],
) -> None:
    sock = registry_socket(ctx, cfg)
    stack.callback(sock.close, ANNOUNCE_LINGER_MS)

    async def leave() -> None:
        if cfg.announce == "v1":
            await send_frame(sock, announce_message(cfg, "leave", 0), LEAVE_SEND_TIMEOUT_S)

    stack.push_async_callback(leave)  # runs after the loop below is cancelled
    stack.push_async_callback(
        cancel_task, asyncio.get_running_loop().create_task(announce_forever(cfg, sock, running))
    )


async def cancel_task(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    if not task.cancelled() and task.exception() is not None:
        log.error("fake worker: background task failed", exc_info=task.exception())


# --------------------------------------------------------------------------- CLI


def port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is outside 1..65535")
    return value


def non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--role", choices=("P", "D"), required=True, help="prefill (P) or decode (D) worker")
    add(
        "--host",
        default="127.0.0.1",
        help="HTTP bind host, also the announced http_address host (default: %(default)s)",
    )
    add("--port", type=port, required=True, help="HTTP port")
    add(
        "--kv-port",
        type=port,
        required=True,
        help="KV (ZMQ) port; the worker's zmq_address is KV_HOST:KV_PORT",
    )
    add("--kv-host", default=None, help="KV (ZMQ) bind host (default: --host)")
    add(
        "--proxy",
        type=parse_proxy,
        default=None,
        metavar="HOST:PORT",
        help="registry address; when given, announce to it",
    )
    add(
        "--announce",
        choices=("v0", "v1"),
        default="v0",
        help="announcement format: v0 as stock vLLM, v1 with model/geometry/load "
        "(default: %(default)s)",
    )
    add(
        "--announce-interval",
        type=positive,
        default=3.0,
        metavar="SECONDS",
        help="seconds between announcements (default: %(default)s)",
    )
    add("--model", default="fake-model", help="served model name (default: %(default)s)")
    add(
        "--token-latency-ms",
        type=non_negative,
        default=0.0,
        metavar="MS",
        help="sleep per generated token (default: %(default)s)",
    )
    add(
        "--prefill-latency-ms",
        type=non_negative,
        default=0.0,
        metavar="MS",
        help="sleep before the first token, simulating prompt processing (default: %(default)s)",
    )
    add(
        "--kv-timeout",
        type=positive,
        default=5.0,
        metavar="SECONDS",
        help="how long a decode worker waits for a request's KV payload (default: %(default)s)",
    )
    add(
        "--max-model-len",
        type=positive_int,
        default=4096,
        help="context length: prompt tokens + max_tokens may not exceed it (default: %(default)s)",
    )
    geometry = parser.add_argument_group("v1 announcement (geometry and connector)")
    add = geometry.add_argument
    add("--connector", default="p2p_nccl", help="announced connector (default: %(default)s)")
    add(
        "--tp-size",
        type=positive_int,
        default=1,
        help="tensor-parallel size (default: %(default)s)",
    )
    add("--block-size", type=positive_int, default=16, help="KV block size (default: %(default)s)")
    add("--num-layers", type=positive_int, default=2, help="layers (default: %(default)s)")
    add(
        "--num-kv-heads", type=positive_int, default=2, help="total KV heads (default: %(default)s)"
    )
    add("--head-dim", type=positive_int, default=32, help="head dimension (default: %(default)s)")
    add("--kv-dtype", default="float16", help="KV cache dtype (default: %(default)s)")
    add("--is-mla", action="store_true", help="announce an MLA (latent) KV cache")
    add(
        "--kv-layout",
        choices=("NHD", "HND"),
        default="NHD",
        help="KV layout (default: %(default)s)",
    )


def parse_proxy(text: str) -> Address:
    try:
        return parse_address(text)
    except AddressError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """Raises AddressError when the KV address could not be carried in a request id."""
    kv_host = args.kv_host if args.kv_host is not None else args.host
    return WorkerConfig(
        role=args.role,
        http=Address(args.host, args.port),
        kv=make_address(kv_host, args.kv_port),
        proxy=args.proxy,
        announce=args.announce,
        announce_interval_s=args.announce_interval,
        model=args.model,
        token_latency_s=args.token_latency_ms / 1000.0,
        prefill_latency_s=args.prefill_latency_ms / 1000.0,
        kv_timeout_s=args.kv_timeout,
        max_model_len=args.max_model_len,
        connector=args.connector,
        geometry=Geometry(
            tp_size=args.tp_size,
            block_size=args.block_size,
            num_layers=args.num_layers,
            num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            kv_dtype=args.kv_dtype,
            is_mla=args.is_mla,
            kv_layout=args.kv_layout,
        ),
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Entry point for `pdproxy fake-worker`; returns the process exit code."""
    try:
        cfg = config_from_args(args)
    except AddressError as err:
        print(f"fake-worker: bad KV address: {err}", file=sys.stderr)
        return 2
    return asyncio.run(run_worker(cfg))


DESCRIPTION = (
    "Run a fake vLLM prefill or decode worker: OpenAI endpoints with deterministic text, "
    "P2pNcclConnector-style KV handoff over ZMQ, registry announcements, and /_fake/ control "
    "endpoints for tests."
)


def add_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `fake-worker` subcommand; its `func` default runs the worker."""
    parser = subparsers.add_parser(
        "fake-worker", help="run a fake vLLM worker (tests, demo)", description=DESCRIPTION
    )
    add_arguments(parser)
    parser.set_defaults(func=run_from_args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdproxy.testing.fake_worker", description=DESCRIPTION
    )
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
