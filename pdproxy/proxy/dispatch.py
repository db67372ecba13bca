"""The two legs of a disaggregated request: prefill (max_tokens=1, read and discarded), then
decode (the client's body, relayed as it streams).

Both legs carry the same tagged X-Request-Id so the P and D workers find each other. A failed
prefill never sends decode (vLLM's example proxy goes on to decode, which then waits forever).

A leg that fails before the client saw a byte is retried with a new pair and a new id, passing
over the instances that already failed this request, with jittered exponential backoff, within
the request's deadline. Every failure and success also feeds the outlier detector, which takes
instances that keep failing out of rotation.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from pdproxy.base.roles import Role
from pdproxy.config import Settings
from pdproxy.http.alarms import Alarms
from pdproxy.http.deadline import Deadline
from pdproxy.http.upstream import Reply, Upstream, UpstreamError
from pdproxy.ids import build_request_id
from pdproxy.metrics import DECODE_REFUSED, Metrics
from pdproxy.pairing.features import RequestFeatures
from pdproxy.pairing.planner import Direct, Pair
from pdproxy.proxy.errors import ProxyError
from pdproxy.proxy.exchange import ClientHeaders, Exchange
from pdproxy.proxy.kv_params import (
    PARAMS_FIELD,
    params_from_answer,
    prefill_leg_params,
    uses_params,
)
from pdproxy.proxy.prompt import request_features
from pdproxy.proxy.request import CompletionRequest
from pdproxy.proxy.rotation import Rotation
from pdproxy.proxy.side_by_side import decode_beside_prefill
from pdproxy.registry.table import Instance
from pdproxy.reliability.backoff import RetryPolicy
from pdproxy.reliability.failures import counts_against_instance, is_retryable
from pdproxy.tracing.context import trace_context
from pdproxy.tracing.random_ids import RandomHex
from pdproxy.tracing.spans import RequestTrace, Tracing

log = logging.getLogger("pdproxy.dispatch")

_ERROR_SNIPPET = 300


@dataclass(slots=True, init=False)
class Wait:
    """What a leg is waiting for right now, and for how long at most; whether any of the
    answer arrived (after that, the leg is never retried)."""

    what: str
    limit: float
    began: float  # on the rotation's clock: outcomes of legs begun before an ejection are moot
    answered: bool

    # A hand-written __init__ (not frozen): see pdproxy/compiled.py on dataclasses.
    def __init__(self, what: str, limit: float, began: float, answered: bool = False) -> None:
        self.what = what
        self.limit = limit
        self.began = began
        self.answered = answered


class LegFailed(ProxyError):
    """A leg failed; `retryable` if another pair may serve the request instead."""

    def __init__(self, error: ProxyError, role: Role, instance: str, kind: str, retryable: bool):
        super().__init__(
            error.status, error.message, code=error.code, param=error.param, headers=error.headers
        )
        self.role = role
        self.instance = instance
        self.kind = kind
        self.retryable = retryable


def _random_uid() -> Callable[[], str]:
    source = RandomHex()
    return lambda: source.hex(16)


class Dispatcher:
    def __init__(
        self,
        settings: Settings,
        rotation: Rotation,
        upstream: Upstream,
        metrics: Metrics,
        tracing: Tracing,
        alarms: Alarms,
        new_uid: Callable[[], str] | None = None,
        unit_random: Callable[[], float] = random.random,
    ) -> None:
        self._settings = settings
        self._rotation = rotation
        self._upstream = upstream
        self._metrics = metrics
        self._tracing = tracing
        self._alarms = alarms
        self._new_uid = new_uid or _random_uid()
        self._unit_random = unit_random
        self._decode_beside_prefill = frozenset(settings.concurrent_decode_connectors)
        self._loop = asyncio.get_running_loop()  # see CompletionsEndpoint: built in the lifespan
        self._retry = RetryPolicy(
            settings.max_attempts,
            settings.retry_backoff_base_seconds,
            settings.retry_backoff_max_seconds,
        )
        self._retry_after = ((b"retry-after", str(settings.retry_after_seconds).encode()),)
        # Prefix windows are hashed only for the policy that reads them.
        uses_prefixes = settings.prefill_policy == "prefix_affinity"
        self._prefix_tokens = settings.prefix_affinity_tokens if uses_prefixes else 0
        key = settings.upstream_api_key
        self._upstream_auth = None if key is None else f"Bearer {key.get_secret_value()}"
        # A client's key for pdproxy is pdproxy's secret: never passed on to the instances.
        self._forward_client_auth = not settings.api_key and settings.api_key_file is None

    def features(self, request: CompletionRequest) -> RequestFeatures:
        return request_features(request.payload, request.model, request.chat, self._prefix_tokens)

    def leg_headers(self, request_id: str, authorization: str | None) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        auth = self._upstream_auth or (authorization if self._forward_client_auth else None)
        if auth:
            headers["Authorization"] = auth
        return headers

    async def serve(
        self, request: CompletionRequest, exchange: Exchange, client: ClientHeaders
    ) -> None:
        """Run both legs (or only decode, for a short prompt) and answer through `exchange`."""
        context = trace_context(client.traceparent, client.tracestate, self._new_uid())
        with self._tracing.request(context, request.path) as trace:
            exchange.notes.trace_id = trace.trace_id
            await self._serve_traced(request, exchange, client.authorization, trace)

    async def _serve_traced(
        self,
        request: CompletionRequest,
        exchange: Exchange,
        authorization: str | None,
        trace: RequestTrace,
    ) -> None:
        features = self.features(request)
        failed: set[str] = set()  # instances that failed this request: passed over if possible
        failures = 0
        last: LegFailed | None = None
        while True:
            try:
                await self._attempt(
                    request, features, exchange, authorization, trace, frozenset(failed)
                )
                return
            except LegFailed as failure:
                last = failure
                if not failure.retryable or exchange.started:
                    raise
                failed.add(failure.instance)
                failures += 1
                remaining = exchange.deadline - exchange.task.get_loop().time()
                delay = self._retry.next_delay(failures, self._unit_random(), remaining)
                if delay is None:
                    raise
                self._metrics.retries.labels(failure.role, failure.kind).inc()
                log.info(
                    "retrying in %.0f ms after %s (attempt %d of %d)",
                    delay * 1000,
                    failure.message,
                    failures + 1,
                    self._settings.max_attempts,
                )
                exchange.notes.attempts = failures + 1
                await asyncio.sleep(delay)
            except ProxyError as refusal:
                # Nothing left to retry on (the failures ejected the last instances): the
                # client hears what actually went wrong, not just that nothing is left.
                if last is not None and refusal.code == "no_instance":
                    raise last from None
                raise

    async def _attempt(
        self,
        request: CompletionRequest,
        features: RequestFeatures,
        exchange: Exchange,
        authorization: str | None,
        trace: RequestTrace,
        avoid: frozenset[str],
    ) -> None:
        """One try with one pair (or one decode instance, for a short prompt)."""
        if features.prompt_tokens < self._settings.disagg_min_tokens:
            direct = self._rotation.choose_direct(features, avoid)
            if direct is not None:
                await self._serve_direct(direct, request, exchange, authorization, trace)
                return
        notes = exchange.notes
        pair = await self._rotation.choose(features, avoid)
        notes.prefill, notes.decode = pair.prefill.name, pair.decode.name
        prefill_held = True
        refusal = _context_refusal(request, pair.decode)

        def release_prefill() -> None:
            nonlocal prefill_held
            if prefill_held:
                prefill_held = False
                self._rotation.release(pair.prefill.http_address, pair.prefill_tokens)

        try:
            if refusal is not None:
                # The decode would refuse it after the prefill made its KV for nothing: the
                # client hears the decode's own words now, and no leg is sent.
                notes.error = "context_length"
                await exchange.whole(400, b"application/json", refusal)
                return
            request_id = build_request_id(
                pair.prefill.zmq_address, pair.decode.zmq_address, self._new_uid()
            )
            exchange.request_id = request_id
            headers = self.leg_headers(request_id, authorization)
            leg_params = prefill_leg_params(pair.connector, pair.decode)
            if pair.connector in self._decode_beside_prefill:
                notes.concurrent = True
                await self._both_legs(
                    pair, request, headers, leg_params, exchange, trace, release_prefill
                )
                return
            prefill_began = self._rotation.now()
            with trace.leg(Role.PREFILL, pair.prefill.name) as span:
                answer = await self._prefill(
                    pair.prefill, request, headers | span, leg_params, exchange, exchange.task
                )
            release_prefill()
            if answer.status >= 400:
                # vLLM refused the request (4xx): the client gets vLLM's own words.
                self._answered_well(Role.PREFILL, pair.prefill, prefill_began)
                await exchange.whole(answer.status, answer.content_type, answer.body)
                return
            with_params = uses_params(pair.connector)
            params = self._kv_params(pair.prefill, answer, prefill_began) if with_params else None
            self._answered_well(Role.PREFILL, pair.prefill, prefill_began)
            with trace.leg(Role.DECODE, pair.decode.name) as span:
                body = request.decode_body(params)
                refused = await self._decode(
                    pair.decode, body, request, headers | span, exchange, exchange.task
                )
            if refused:
                self._metrics.kv_orphaned.labels(DECODE_REFUSED).inc()
        finally:
            release_prefill()
            self._rotation.release(pair.decode.http_address, pair.decode_tokens)

    async def _both_legs(
        self,
        pair: Pair,
        request: CompletionRequest,
        headers: dict[str, str],
        leg_params: dict[str, Any] | None,
        exchange: Exchange,
        trace: RequestTrace,
        release_prefill: Callable[[], None],
    ) -> None:
        """Prefill and decode sent at once (proxy.side_by_side): for connectors whose decode
        instance waits for the KV itself without holding its other requests."""
        prefilled = refused = False

        async def prefill() -> Reply:
            nonlocal prefilled
            began = self._rotation.now()
            task = asyncio.current_task(self._loop)
            assert task is not None
            try:
                with trace.leg(Role.PREFILL, pair.prefill.name) as span:
                    answer = await self._prefill(
                        pair.prefill, request, headers | span, leg_params, exchange, task
                    )
            finally:
                release_prefill()
            self._answered_well(Role.PREFILL, pair.prefill, began)
            prefilled = answer.status < 400
            return answer

        async def decode() -> None:
            nonlocal refused
            task = asyncio.current_task(self._loop)
            assert task is not None
            with trace.leg(Role.DECODE, pair.decode.name) as span:
                refused = await self._decode(
                    pair.decode,
                    request.decode_body(None),
                    request,
                    headers | span,
                    exchange,
                    task,
                    self._settings.prefill_timeout,
                )

        refusal = await decode_beside_prefill(
            prefill(), decode(), lambda: exchange.started, exchange.task.get_loop()
        )
        if refusal is not None:
            # vLLM refused the request (4xx) before the decode answered: its own words.
            await exchange.whole(refusal.status, refusal.content_type, refusal.body)
        elif refused and prefilled:  # the prefill ran to its end beside a decode that refused
            self._metrics.kv_orphaned.labels(DECODE_REFUSED).inc()

    async def _serve_direct(
        self,
        direct: Direct,
        request: CompletionRequest,
        exchange: Exchange,
        authorization: str | None,
        trace: RequestTrace,
    ) -> None:
        self._metrics.direct.inc()
        exchange.notes.decode, exchange.notes.direct = direct.decode.name, True
        try:
            # No tag: the decode instance's connector computes the prompt itself.
            exchange.request_id = self._new_uid()
            headers = self.leg_headers(exchange.request_id, authorization)
            with trace.leg(Role.DECODE, direct.decode.name) as span:
                await self._decode(
                    direct.decode, request.body, request, headers | span, exchange, exchange.task
                )
        finally:
            self._rotation.release(direct.decode.http_address, direct.decode_tokens)

    def _kv_params(self, prefill: Instance, answer: Reply, began: float) -> dict[str, Any]:
        params = params_from_answer(answer.body)
        if params is None:
            # Without it the decode instance cannot know where the KV is: it would recompute
            # or wait, so the prefill counts as failed.
            raise self._leg_failed(
                Role.PREFILL,
                prefill,
                "no_kv_transfer_params",
                f"answered without {PARAMS_FIELD} (is its connector really nixl?)",
                began,
            )
        return params

    async def _prefill(
        self,
        instance: Instance,
        request: CompletionRequest,
        headers: dict[str, str],
        leg_params: dict[str, Any] | None,
        exchange: Exchange,
        task: asyncio.Task[Any],
    ) -> Reply:
        """The prefill answer: 2xx, or a 4xx to relay; anything else raises. `task`: the one
        this runs in (its deadline cancels it)."""
        settings = self._settings
        started = time.perf_counter()
        body = request.prefill_body(leg_params)
        with (
            self._leg(Role.PREFILL, instance, "answer", settings.prefill_timeout) as wait,
            Deadline(self._alarms, task, wait.limit),
        ):
            reply = await self._upstream.post(
                instance.http_address,
                request.path,
                body,
                headers,
                settings.max_response_bytes,
            )
        notes = exchange.notes
        notes.prefill_seconds = time.perf_counter() - started
        self._metrics.prefill_done(notes.prefill_seconds)
        if 200 <= reply.status < 300 or 400 <= reply.status < 500:
            # Counted as a success by the caller, once the answer proved usable.
            return reply
        raise self._leg_failed(
            Role.PREFILL,
            instance,
            _status_kind(reply.status),
            _answered(reply.status, reply.body),
            wait.began,
        )

    async def _decode(
        self,
        instance: Instance,
        body: bytes,
        request: CompletionRequest,
        headers: dict[str, str],
        exchange: Exchange,
        task: asyncio.Task[Any],
        prefill_wait: float = 0.0,
    ) -> bool:
        """Relay the decode's answer; True if it was a refusal (4xx). `task`: the one this runs
        in (its deadlines cancel it); `prefill_wait`: how long the instance may first wait for
        a prefill running alongside."""
        settings = self._settings
        loop = task.get_loop()
        started = time.perf_counter()
        # A stream must show its first byte soon (a KV handoff that hangs shows up here); a
        # non-streaming answer arrives whole at the end, so it gets the whole-leg bound.
        if request.stream:
            waiting, limit = "first byte", settings.decode_first_byte_timeout
        else:
            waiting, limit = "answer", settings.decode_timeout
        with (
            self._leg(Role.DECODE, instance, waiting, limit + prefill_wait) as wait,
            Deadline(self._alarms, task, wait.limit) as deadline,
        ):
            async with self._upstream.stream(
                "POST", instance.http_address, request.path, body, headers
            ) as stream:
                if not 200 <= stream.status < 300:
                    body = await stream.read_all(settings.max_response_bytes)
                    if 400 <= stream.status < 500:
                        self._answered_well(Role.DECODE, instance, wait.began)
                        await exchange.whole(stream.status, stream.content_type, body)
                        return True
                    raise self._leg_failed(
                        Role.DECODE,
                        instance,
                        _status_kind(stream.status),
                        _answered(stream.status, body),
                        wait.began,
                    )
                if not request.stream:
                    # vLLM sends a whole answer's headers once it is ready: from here on a
                    # retry would compute it twice.
                    wait.answered = True
                    body = await stream.read_all(settings.max_response_bytes)
                    self._first_byte(exchange, started)
                    deadline.reschedule(None)
                    self._answered_well(Role.DECODE, instance, wait.began)
                    await exchange.whole(stream.status, stream.content_type, body)
                    return False
                chunk = await stream.next_chunk()
                wait.answered = bool(chunk)
                self._first_byte(exchange, started)
                deadline.reschedule(None)
                await exchange.start_stream(stream.status, stream.content_type)
                wait.what, wait.limit = "next chunk", settings.stream_idle_timeout
                while chunk:
                    # Only the instance is on the clock: a slow client is not its fault
                    # (the request timeout bounds the client).
                    await exchange.chunk(chunk)
                    deadline.reschedule(loop.time() + wait.limit)
                    chunk = await stream.next_chunk()
                    deadline.reschedule(None)
                self._answered_well(Role.DECODE, instance, wait.began)
                await exchange.end_stream()
                return False

    def _first_byte(self, exchange: Exchange, started: float) -> None:
        exchange.notes.decode_first_byte_seconds = time.perf_counter() - started
        self._metrics.decode_first_byte_seen(exchange.notes.decode_first_byte_seconds)

    def _leg(self, role: Role, instance: Instance, what: str, limit: float) -> _LegWatch:
        """Count the leg in flight and turn its failures into 502s naming role and instance;
        `Wait` says what a timeout was waiting for."""
        return _LegWatch(self, role, instance, Wait(what, limit, self._rotation.now()))

    def _answered_well(self, role: Role, instance: Instance, began: float) -> None:
        self._rotation.succeeded(role, instance, began)

    def _leg_failed(
        self,
        role: Role,
        instance: Instance,
        kind: str,
        detail: str,
        began: float,
        answered: bool = False,
    ) -> ProxyError:
        self._metrics.upstream_errors.labels(role, kind).inc()
        if kind == "saturated":
            return ProxyError(
                503, f"pdproxy is saturated: {detail}", code="saturated", headers=self._retry_after
            )
        if counts_against_instance(kind):
            self._rotation.failed(role, instance, began)
        # A leg that ran out of time is a gateway timeout (the P2pNccl id-suffix hang of vLLM
        # >= 0.14 shows up as the decode's first byte never coming); anything else is 502.
        status = 504 if kind == "timeout" else 502
        error = ProxyError(
            status, f"{role} instance {instance.name} failed: {detail}", code=f"{role}_{kind}"
        )
        retryable = is_retryable(kind) and not answered
        return LegFailed(error, role, instance.name, kind, retryable)


class _LegWatch:
    """Dispatcher._leg's context manager. (A class, not a generator: two per request.)"""

    __slots__ = ("_dispatcher", "_instance", "_role", "_wait")

    def __init__(self, dispatcher: Dispatcher, role: Role, instance: Instance, wait: Wait) -> None:
        self._dispatcher = dispatcher
        self._role = role
        self._instance = instance
        self._wait = wait

    def __enter__(self) -> Wait:
        self._dispatcher._metrics.leg_started(self._role, self._instance.name)
        return self._wait

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        dispatcher, role, instance, wait = self._dispatcher, self._role, self._instance, self._wait
        dispatcher._metrics.leg_finished(role, instance.name)
        if exc_type is None:
            return
        if issubclass(exc_type, TimeoutError):
            raise dispatcher._leg_failed(
                role,
                instance,
                "timeout",
                f"no {wait.what} within {wait.limit:g}s",
                wait.began,
                wait.answered,
            ) from None
        if isinstance(exc, UpstreamError):
            raise dispatcher._leg_failed(
                role, instance, exc.kind, exc.detail, wait.began, wait.answered
            ) from None


def _context_refusal(request: CompletionRequest, decode: Instance) -> bytes | None:
    """What `decode` would answer a request asking for more tokens than its context holds,
    when it announced its context length (max_model_len)."""
    if decode.max_model_len is None:
        return None
    return request.context_refusal(decode.max_model_len)


def _status_kind(status: int) -> str:
    return "status_5xx" if status >= 500 else "status_other"


def _answered(status: int, body: bytes) -> str:
    text = body[:_ERROR_SNIPPET].decode("utf-8", errors="replace")
    return f"answered HTTP {status}: {text}" if text else f"answered HTTP {status}"
