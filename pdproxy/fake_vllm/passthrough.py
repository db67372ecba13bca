"""vLLM's other endpoints (tokenize, embeddings, score, render...) and any other path, as one
echo: the answer says which worker served, what it was sent, and how; a test proves with it
where pdproxy passed a request through and what it forwarded."""

from __future__ import annotations

from aiohttp import web

from pdproxy.fake_vllm.asyncio_helpers import sleep
from pdproxy.fake_vllm.config import WorkerConfig
from pdproxy.fake_vllm.control import Control
from pdproxy.fake_vllm.http_json import json_response

# `?fake_stream_bytes=N`: the answer is N bytes of a known pattern, sent in pieces of this
# size (a large streamed body to relay).
STREAM_PIECE = 16 * 1024
MAX_STREAM_BYTES = 256 * 1024 * 1024


def pattern(size: int) -> bytes:
    """The streamed answer's bytes: position i holds i mod 251 (no piece repeats another)."""
    cycle = bytes(range(251))
    return (cycle * (size // 251 + 1))[:size]


class Echo:
    def __init__(self, cfg: WorkerConfig, control: Control) -> None:
        self._cfg = cfg
        self._control = control

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        # The injected behaviour (status, error body, delay) applies here as to completions.
        behaviour = self._control.behaviour
        await sleep(behaviour.delay_s)
        if behaviour.status is not None:
            return behaviour.response()
        raw = await request.read()  # cached: the recording middleware read it first
        size = request.query.get("fake_stream_bytes", "")
        if size.isdigit() and int(size) <= MAX_STREAM_BYTES:
            return await self._stream(request, int(size))
        return json_response(
            {
                "served_by": str(self._cfg.http),
                "role": self._cfg.role.value,
                "method": request.method,
                # As sent: still percent-encoded.
                "path": request.raw_path.partition("?")[0],
                "query": request.raw_path.partition("?")[2],
                "content_type": request.headers.get("Content-Type"),
                "authorization": request.headers.get("Authorization"),
                "request_id": request.headers.get("X-Request-Id"),
                "body": raw.decode("utf-8", errors="replace"),
            }
        )

    async def _stream(self, request: web.Request, size: int) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        await response.prepare(request)
        body = pattern(size)
        for start in range(0, size, STREAM_PIECE):
            await response.write(body[start : start + STREAM_PIECE])
        await response.write_eof()
        return response
