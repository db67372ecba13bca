"""One fake worker's state and its vLLM endpoints: completions, chat, models, health, and an
echo for every other path (fake_vllm/passthrough.py)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import zmq.asyncio
from aiohttp import web

from pdproxy.base.roles import Role
from pdproxy.fake_vllm.asyncio_helpers import sleep
from pdproxy.fake_vllm.chat_apis import (
    CHAT_API_PATHS,
    answer_id,
    error_response,
    frames,
    parse_api_generation,
    whole_answer,
)
from pdproxy.fake_vllm.config import WorkerConfig
from pdproxy.fake_vllm.control import Control
from pdproxy.fake_vllm.generation import (
    GENERATE_PATH,
    Generation,
    check_model,
    parse_generation,
    parse_token_generation,
)
from pdproxy.fake_vllm.http_json import ApiError, json_response, parse_json_object
from pdproxy.fake_vllm.kv_handoff import KvHandoff
from pdproxy.fake_vllm.kv_held import HeldTransfers
from pdproxy.fake_vllm.kv_mooncake import query_answer
from pdproxy.fake_vllm.kv_nixl_push import NixlPushFlow
from pdproxy.fake_vllm.kv_params import request_params
from pdproxy.fake_vllm.kv_pull_flow import PullFlow
from pdproxy.fake_vllm.kv_push_flow import PushFlow
from pdproxy.fake_vllm.kv_stats import KvStats
from pdproxy.fake_vllm.kv_store import KvStore
from pdproxy.fake_vllm.kv_transport import KvSender
from pdproxy.fake_vllm.load import LoadTracker, Share, vllm_metrics_text
from pdproxy.fake_vllm.passthrough import Echo
from pdproxy.fake_vllm.records import RecordedRequest, Records
from pdproxy.fake_vllm.responses import Envelope, full_response, tokens_response
from pdproxy.fake_vllm.streaming import SSE_DONE, stream_error_event

MAX_BODY_BYTES = 64 * 1024 * 1024


class FakeWorker:
    """All state of one fake worker; built in run_worker and handed to the aiohttp app."""

    def __init__(self, cfg: WorkerConfig, ctx: zmq.asyncio.Context) -> None:
        self.cfg = cfg
        self.records = Records()
        self.load = LoadTracker(
            cfg.kv_capacity_tokens, counts_prefill_work=cfg.role is Role.PREFILL
        )
        self.control = Control(self.records, self.load)
        # A fresh engine id per start unless given, as vLLM's: a restarted prefill is another
        # engine.
        self.engine_id = cfg.engine_id
        self.kv_store = KvStore()
        self.kv_held = HeldTransfers(self.engine_id, cfg.kv_timeout_s)
        self.kv_sender = KvSender(ctx, str(cfg.kv))
        self.kv_stats = KvStats.connect(cfg)  # stopped by run_worker
        push = PushFlow(cfg, self.kv_store, self.kv_sender, self.records, self.kv_stats)
        self.nixl_push = NixlPushFlow(cfg, push, self.kv_sender, self.records)
        self.kv_handoff = KvHandoff(
            cfg,
            self.records,
            push,
            PullFlow(cfg, self.kv_held, ctx, self.records, self.kv_stats),
            self.nixl_push,
        )
        self.started = int(time.time())

    def build_app(self) -> web.Application:
        app = web.Application(
            middlewares=[self.control.record_request], client_max_size=MAX_BODY_BYTES
        )
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post(GENERATE_PATH, self.generate_tokens)
        for path in CHAT_API_PATHS:  # OpenAI's Responses, Anthropic's Messages
            app.router.add_post(path, self.chat_api)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        if self.cfg.connector == "mooncake" and self.cfg.role is Role.PREFILL:
            app.router.add_get("/query", self.bootstrap_query)  # its bootstrap server
        self.control.add_routes(app.router)
        # Last: every path nothing above serves (vLLM's other endpoints, unknown paths).
        app.router.add_route("*", "/{tail:.*}", Echo(self.cfg, self.control))
        return app

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def generate_tokens(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False, tokens=True)

    async def chat_api(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True, api=request.path)

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

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        text = vllm_metrics_text(self.load.announced(), self.cfg.model)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def bootstrap_query(self, request: web.Request) -> web.StreamResponse:
        return json_response(query_answer(self.engine_id, str(self.cfg.kv)))

    async def _generate(
        self, request: web.Request, chat: bool, tokens: bool = False, api: str = ""
    ) -> web.StreamResponse:
        header_id = request.headers.get("X-Request-Id")
        # vLLM's ids: cmpl-, chatcmpl-, and generate-tokens- for the token-in/token-out API.
        prefix = "generate-tokens" if tokens else "chatcmpl" if chat else "cmpl"
        response_id = f"{prefix}-{header_id or uuid.uuid4().hex}"
        recorded = RecordedRequest(header_id or response_id, request.path)
        try:
            return await self._answer(request, chat, tokens, header_id, response_id, recorded, api)
        except asyncio.CancelledError:
            # handler_cancellation: the client went away (or the server is stopping).
            self.records.add_abort(recorded)
            raise

    async def _answer(
        self,
        request: web.Request,
        chat: bool,
        tokens: bool,
        header_id: str | None,
        response_id: str,
        recorded: RecordedRequest,
        api: str = "",
    ) -> web.StreamResponse:
        behaviour = self.control.behaviour
        await sleep(behaviour.delay_s)
        if behaviour.status is not None:
            return behaviour.response()
        try:
            body = parse_json_object(await request.read())
            check_model(body, self.cfg.model)
            if api:
                generation = parse_api_generation(api, body, self.cfg.max_model_len)
                response_id = answer_id(api, header_id or recorded.record_id, body)
            elif tokens:
                generation = parse_token_generation(body, self.cfg.max_model_len)
            else:
                generation = parse_generation(body, chat, self.cfg.max_model_len)
            params = request_params(body)
        except ApiError as err:
            return error_response(err, api)
        with self.load.occupy(generation.prompt_tokens) as share:
            try:
                answer_params = await self.kv_handoff.before_first_token(
                    recorded.record_id, header_id, params, generation
                )
            except ApiError as err:
                return error_response(err, api)
            env = Envelope(response_id, int(time.time()), self.cfg.model)
            drop = behaviour.drop_after_chunks
            if generation.stream:
                # Like vLLM, a streamed answer carries no kv_transfer_params.
                return await self._stream(
                    request, env, generation, recorded, share, drop, behaviour.stream_error
                )
            if drop == 0:
                _cut(request)
                self.records.add_abort(recorded)
                return web.Response(status=500)  # never sent: the connection is gone
            answer = await self._whole(env, generation, recorded, share, answer_params)
            if behaviour.truncate_whole:
                return await _truncated(request, answer)
            return answer

    async def _whole(
        self,
        env: Envelope,
        generation: Generation,
        recorded: RecordedRequest,
        share: Share,
        kv_transfer_params: dict[str, Any] | None,
    ) -> web.Response:
        for _ in range(generation.max_tokens):  # token by token, so the load grows as it would
            await sleep(self.cfg.token_latency_s)
            share.generated(len(generation.prompts))
        self.records.add("completed", recorded.record_id)
        if generation.api:
            answer = whole_answer(env, generation)
        elif generation.tokens:
            answer = tokens_response(env, generation)
        else:
            answer = full_response(env, generation)
        if kv_transfer_params is not None:
            answer["kv_transfer_params"] = kv_transfer_params
        return json_response(answer)

    async def _stream(
        self,
        request: web.Request,
        env: Envelope,
        generation: Generation,
        recorded: RecordedRequest,
        share: Share,
        drop_after_chunks: int | None = None,
        stream_error: dict[str, Any] | None = None,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        # vLLM opens each chat choice with a role-only event before it can fail the request.
        openers = len(generation.prompts) if generation.chat else 0
        try:
            await response.prepare(request)
            sent = 0
            async for frame in frames(env, generation, self.cfg.token_latency_s, share.generated):
                if sent == drop_after_chunks:
                    _cut(request)
                    self.records.add_abort(recorded)
                    return response
                if stream_error is not None and sent == openers:
                    await response.write(stream_error_event(stream_error) + SSE_DONE)
                    self.records.add("stream_error", recorded.record_id)
                    return response
                await response.write(frame)
                sent += 1
            if not generation.api:  # Responses and Messages streams end with their own event
                await response.write(SSE_DONE)
        except ConnectionResetError:
            # The peer closed before the handler was cancelled; aiohttp copes with the return.
            self.records.add_abort(recorded)
            return response
        self.records.add("completed", recorded.record_id)
        return response


async def _truncated(request: web.Request, answer: web.Response) -> web.StreamResponse:
    """`answer`'s headers (its full Content-Length) and half its body, then the connection
    cut: a whole answer that breaks while it is received."""
    body = answer.body
    assert isinstance(body, bytes)
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    response.content_length = len(body)
    await response.prepare(request)
    await response.write(body[: len(body) // 2])
    _cut(request)
    return response


def _cut(request: web.Request) -> None:
    """Drop the connection without ending the answer (a crash or a network failure)."""
    if request.transport is not None:
        request.transport.abort()
