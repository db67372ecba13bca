"""The two legs of a disaggregated request: prefill (max_tokens=1, read and discarded), then
decode (the client's body, relayed as it streams).

Both legs carry the same tagged X-Request-Id so the P and D workers find each other. A failed
prefill never sends decode (vLLM's example proxy goes on to decode, which then waits forever).

A leg that fails before the client saw a byte is retried with a new pair and a new id, passing
over the instances that already failed this request, with jittered exponential backoff, within
the request's deadline. Every failure and success also feeds the outlier detector, which takes
instances that keep failing out of rotation.

A streamed answer whose decode fails after bytes reached the client is migrated (when on): the
same attempt runs again for a continuation request (proxy/migration_plan.py) whose chunks the
exchange's ledger (proxy/migration_stream.py) relays as the rest of the same answer.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from pdproxy.base.roles import Role
from pdproxy.config import Settings
from pdproxy.http.alarms import Alarms
from pdproxy.http.deadline import Deadline
from pdproxy.http.upstream import AnswerStream, Reply, UpstreamClient
from pdproxy.ids import Address, build_request_id
from pdproxy.metrics import DECODE_REFUSED, Metrics
from pdproxy.pairing.features import RequestFeatures
from pdproxy.proxy.bootstrap import BootstrapError, EngineIds
from pdproxy.proxy.errors import ProxyError
from pdproxy.proxy.exchange import ClientHeaders, Exchange
from pdproxy.proxy.failures import LegFailed, classify
from pdproxy.proxy.kv_params import (
    PARAMS_FIELD,
    mooncake_decode_params,
    mooncake_prefill_params,
    nixl_push_decode_params,
    params_from_answer,
    prefill_leg_params,
    prefill_params,
    uses_params,
)
from pdproxy.proxy.lease import LegLease, lease_direct, lease_pair
from pdproxy.proxy.migration_plan import (
    TOKEN_IDS_FIELD,
    continuation,
    migration_refusal,
    replays,
    upstream_for_migration,
)
from pdproxy.proxy.migration_stream import MalformedStream, StreamLedger
from pdproxy.proxy.prompt import request_features
from pdproxy.proxy.request import CompletionRequest
from pdproxy.proxy.rotation import Rotation
from pdproxy.proxy.side_by_side import DecodeBound, decode_beside_prefill
from pdproxy.proxy.stream_opening import Opening, read_opening
from pdproxy.registry.messages import Connector
from pdproxy.registry.table import Instance
from pdproxy.reliability.backoff import RetryPolicy
from pdproxy.reliability.failures import FailureKind
from pdproxy.tracing.context import trace_context
from pdproxy.tracing.random_ids import RandomHex
from pdproxy.tracing.spans import RequestTrace, Tracing

log = logging.getLogger("pdproxy.dispatch")

_ERROR_SNIPPET = 300


def _random_uid() -> Callable[[], str]:
    source = RandomHex()
    return lambda: source.hex(16)


class Dispatcher:
    def __init__(
        self,
        settings: Settings,
        rotation: Rotation,
        upstream: UpstreamClient,
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
        self._engine_ids = EngineIds(
            upstream, settings.bootstrap_query_timeout, self._loop, settings.max_instances
        )
        self._retry = RetryPolicy(
            settings.max_attempts,
            settings.retry_backoff_base_seconds,
            settings.retry_backoff_max_seconds,
        )
        # Prefix windows are hashed only for the policy that reads them.
        uses_prefixes = settings.prefill_policy == "prefix_affinity"
        self._prefix_tokens = settings.prefix_affinity_tokens if uses_prefixes else 0
        key = settings.upstream_api_key
        self._upstream_auth = None if key is None else f"Bearer {key.get_secret_value()}"
        # A client's key for pdproxy is pdproxy's secret: never passed on to the instances.
        self._forward_client_auth = not settings.api_key and settings.api_key_file is None
        self._migration_limit = settings.migration_limit if settings.migration == "on" else 0
        self._whole_min = settings.migration_whole_min_tokens

    def features(self, request: CompletionRequest) -> RequestFeatures:
        return request_features(
            request.payload,
            request.model,
            request.chat,
            self._prefix_tokens,
            request.generate,
            request.responses,
        )

    def new_request_id(self) -> str:
        """A fresh id for a request served by one instance alone (no pair to tag)."""
        return self._new_uid()

    def leg_headers(self, request_id: str, authorization: str | None) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        auth = self._upstream_auth or (authorization if self._forward_client_auth else None)
        if auth:
            headers["Authorization"] = auth
        return headers

    def trace(
        self, request: CompletionRequest, client: ClientHeaders
    ) -> AbstractContextManager[RequestTrace]:
        """`with dispatcher.trace(request, client) as trace:` the request's trace (the client's
        context, or a new trace), around `serve`. (Not inside serve: a coroutine less between
        the request's task and its legs, docs/performance.md, "Calls on the request path".)"""
        context = trace_context(client.traceparent, client.tracestate, self._new_uid())
        return self._tracing.request(context, request.path)

    async def serve(
        self,
        request: CompletionRequest,
        exchange: Exchange,
        authorization: str | None,
        trace: RequestTrace,
    ) -> None:
        """Run both legs (or only decode, for a short prompt) and answer through `exchange`."""
        exchange.notes.trace_id = trace.trace_id
        original = request
        if self._migration_limit and migration_refusal(request, self._whole_min) is None:
            exchange.ledger = self._ledger(request)
            request = upstream_for_migration(request)
        features = self.features(request)
        failed: set[str] = set()  # instances that failed this request: passed over if possible
        failures = 0
        last: LegFailed | None = None
        migrating: FailureKind | None = None  # the failure the running continuation follows
        try:
            while True:
                try:
                    await self._attempt(
                        request, features, exchange, authorization, trace, frozenset(failed)
                    )
                    if migrating is not None:
                        self._metrics.migrations.labels(migrating, "completed").inc()
                        migrating = None
                    return
                except LegFailed as failure:
                    last = failure
                    if exchange.started or _whole_under_way(exchange):
                        if migrating is not None:
                            self._metrics.migrations.labels(migrating, "failed").inc()
                            migrating = None
                        if await self._finish_early(exchange):
                            return
                        following = self._continuation(original, exchange, failure)
                        if following is None:
                            raise
                        migrating = failure.kind
                        failed.add(failure.instance)
                        request = following
                        features = self.features(request)
                        continue
                    if not failure.retryable:
                        raise
                    if exchange.ledger is not None and exchange.ledger.whole:
                        exchange.ledger = self._ledger(original)  # what it read is dropped
                    failed.add(failure.instance)
                    failures += 1
                    remaining = exchange.deadline - exchange.task.get_loop().time()
                    delay = self._retry.next_delay(failures, self._unit_random(), remaining)
                    if delay is None:
                        raise
                    self._metrics.retries.labels(failure.role, failure.kind).inc()
                    log.info(
                        "retrying in %.0f ms after %s (attempt %d of %d, client id %r)",
                        delay * 1000,
                        failure.message,
                        failures + 1,
                        self._settings.max_attempts,
                        exchange.client_id,
                    )
                    exchange.notes.attempts = failures + 1
                    await asyncio.sleep(delay)
                except ProxyError as refusal:
                    # Nothing left to retry on (the failures ejected the last instances): the
                    # client hears what actually went wrong, not just that nothing is left.
                    if last is not None and refusal.code == "no_instance":
                        raise last from None
                    raise
        finally:
            if migrating is not None:  # the continuation ended otherwise (no pair, cancelled)
                self._metrics.migrations.labels(migrating, "failed").inc()

    def _ledger(self, request: CompletionRequest) -> StreamLedger:
        payload = request.payload
        options = payload.get("stream_options")
        return StreamLedger(
            request.chat,
            payload.get(TOKEN_IDS_FIELD) is True,
            isinstance(options, dict) and bool(options.get("include_usage")),
            self._settings.max_response_bytes,
            whole=not request.stream,
        )

    async def _finish_early(self, exchange: Exchange) -> bool:
        """End a stream whose answer was whole before its decode failed (only its usage or
        [DONE] was missing): nothing to migrate."""
        ledger = exchange.ledger
        if ledger is None or not ledger.finished or ledger.done or exchange.complete:
            return False
        if ledger.whole:
            await _answer_ledgered(exchange, ledger)
        else:
            await exchange.end_stream(ledger.closing())
        return True

    def _continuation(
        self, original: CompletionRequest, exchange: Exchange, failure: LegFailed
    ) -> CompletionRequest | None:
        """The request that continues a stream cut by `failure`; None: not migrated (counted
        as refused, except when migration is off for this request)."""
        ledger = exchange.ledger
        if ledger is None or exchange.complete:
            return None
        if failure.role is not Role.DECODE and not ledger.migrations:
            return None  # (a prefill fails before any byte; a continuation's prefill may)
        following = None
        if (
            ledger.migratable
            and ledger.migrations < self._migration_limit
            and ledger.prompt_ids is not None
            and exchange.deadline > exchange.task.get_loop().time()
        ):
            following = continuation(original, ledger.prompt_ids, ledger.settled())
        if following is None:
            self._metrics.migrations.labels(failure.kind, "refused").inc()
            return None
        generated = len(ledger.generated)
        # Computed again: the prompt and the tokens before the cut (prefilled, or replayed).
        self._metrics.migration_recomputed_tokens.inc(len(ledger.prompt_ids or ()) + generated)
        ledger.cut(replays(original))
        exchange.notes.migrations = ledger.migrations
        log.info(
            "migrating after %s: %d tokens generated, continuing on another pair "
            "(migration %d of at most %d, client id %r)",
            failure.message,
            generated,
            ledger.migrations,
            self._migration_limit,
            exchange.client_id,
        )
        return following

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
            direct = lease_direct(self._rotation, features, avoid)
            if direct is not None:
                with direct:
                    await self._serve_direct(direct.decode, request, exchange, authorization, trace)
                return
        # Planned in a plain call; only a request that must wait for room awaits (a coroutine
        # less per request).
        rotation = self._rotation
        pair = rotation.plan(features, avoid)
        if pair is None:
            pair = await rotation.wait_for_pair(features, avoid)
        lease = lease_pair(rotation, pair)
        with lease:  # gives back whatever the legs still hold, on every path
            prefill, decode = lease.prefill, lease.decode
            assert prefill is not None  # a pair's lease holds both legs
            notes = exchange.notes
            notes.prefill, notes.decode = prefill.instance.name, decode.instance.name
            refusal = _context_refusal(request, decode.instance)
            if refusal is not None:
                # The decode would refuse it after the prefill made its KV for nothing: the
                # client hears the decode's own words now, and no leg is sent.
                notes.error = "context_length"
                await _answer_whole(exchange, 400, b"application/json", refusal)
                return
            uid = self._new_uid()  # a new one per attempt: also mooncake's transfer id
            request_id = build_request_id(
                prefill.instance.zmq_address, decode.instance.zmq_address, uid
            )
            exchange.request_id = request.leg_id = request_id
            headers = self.leg_headers(request_id, authorization)
            leg_params: dict[str, Any] | None
            decode_params: dict[str, Any] | None
            if lease.connector is Connector.MOONCAKE:
                leg_params = mooncake_prefill_params(uid)
                decode_params = await self._mooncake_decode_params(prefill, uid)
            elif lease.connector is Connector.NIXL_PUSH:
                leg_params = prefill_params()
                decode_params = _nixl_push_decode_params(prefill.instance, request_id)
            else:
                leg_params = prefill_leg_params(lease.connector, decode.instance)
                decode_params = None
            if lease.connector in self._decode_beside_prefill:
                notes.concurrent = True
                try:
                    await self._both_legs(
                        prefill,
                        decode,
                        request,
                        headers,
                        (leg_params, decode_params),
                        exchange,
                        trace,
                    )
                except LegFailed:
                    self._forget_engine_id(prefill.instance)
                    raise
                return
            with trace.leg(Role.PREFILL, prefill.instance.name) as span:
                answer = await self._prefill(
                    prefill, request, headers | span, leg_params, exchange, exchange.task
                )
            prefill.release()
            if answer.status >= 400:
                # vLLM refused the request (4xx): the client gets vLLM's own words.
                prefill.succeeded()
                await _answer_whole(exchange, answer.status, answer.content_type, answer.body)
                return
            if uses_params(lease.connector):
                decode_params = self._kv_params(prefill, answer)
            prefill.succeeded()
            with trace.leg(Role.DECODE, decode.instance.name) as span:
                body = request.decode_body(decode_params)
                try:
                    refused = await self._decode(
                        decode, body, request, headers | span, exchange, exchange.task
                    )
                except LegFailed:
                    self._forget_engine_id(prefill.instance)
                    raise
            if refused:
                self._metrics.kv_orphaned.labels(DECODE_REFUSED).inc()

    async def _mooncake_decode_params(self, prefill: LegLease, uid: str) -> dict[str, Any]:
        """The mooncake decode leg's params: the prefill's bootstrap address (announced or
        declared: the registry refuses a mooncake prefill without one) and engine id."""
        bootstrap = _bootstrap_of(prefill.instance)
        assert bootstrap is not None  # the registry refuses a mooncake prefill without one
        limit = self._settings.bootstrap_query_timeout
        with prefill.watch("bootstrap /query answer", limit):
            try:
                engine_id = await self._engine_ids.engine_id(bootstrap)
            except BootstrapError as exc:
                raise prefill.failed(FailureKind.BOOTSTRAP_QUERY, str(exc)) from None
        return mooncake_decode_params(uid, bootstrap, engine_id)

    def _forget_engine_id(self, prefill: Instance) -> None:
        """After a pair's legs failed: a mooncake prefill's cached engine id is forgotten, so
        the next attempt asks its bootstrap server again (a restarted prefill is another
        engine, and a decode given the old id cannot pull)."""
        bootstrap = _bootstrap_of(prefill)
        if bootstrap is not None:
            self._engine_ids.forget(bootstrap)

    async def _both_legs(
        self,
        prefill_leg: LegLease,
        decode_leg: LegLease,
        request: CompletionRequest,
        headers: dict[str, str],
        params: tuple[dict[str, Any] | None, dict[str, Any] | None],
        exchange: Exchange,
        trace: RequestTrace,
    ) -> None:
        """Prefill and decode sent at once (proxy.side_by_side): for connectors whose decode
        instance waits for the KV itself without holding its other requests. `params`: the
        kv_transfer_params of the prefill leg and of the decode leg, if any."""
        leg_params, decode_params = params
        prefilled = refused = False
        bound = DecodeBound(self._settings.prefill_timeout)

        async def prefill() -> Reply:
            nonlocal prefilled
            task = asyncio.current_task(self._loop)
            assert task is not None
            try:
                with trace.leg(Role.PREFILL, prefill_leg.instance.name) as span:
                    answer = await self._prefill(
                        prefill_leg, request, headers | span, leg_params, exchange, task
                    )
            finally:
                prefill_leg.release()
            prefill_leg.succeeded()
            prefilled = answer.status < 400
            if prefilled:
                bound.prefill_answered(self._alarms.time())
            return answer

        async def decode() -> None:
            nonlocal refused
            task = asyncio.current_task(self._loop)
            assert task is not None
            try:
                with trace.leg(Role.DECODE, decode_leg.instance.name) as span:
                    refused = await self._decode(
                        decode_leg,
                        request.decode_body(decode_params),
                        request,
                        headers | span,
                        exchange,
                        task,
                        bound,
                    )
            finally:
                bound.release()  # a prefill answering later moves no deadline of a leg ended

        # Whether this attempt's decode reached the client: a continuation's stream had started
        # before it (migration), so there it is the leg's own first chunk.
        continuing = exchange.started
        refusal = await decode_beside_prefill(
            prefill(),
            decode(),
            (lambda: decode_leg.answered) if continuing else (lambda: exchange.started),
            exchange.task.get_loop(),
        )
        if refusal is not None:
            # vLLM refused the request (4xx) before the decode answered: its own words.
            await _answer_whole(exchange, refusal.status, refusal.content_type, refusal.body)
        elif refused and prefilled:  # the prefill ran to its end beside a decode that refused
            self._metrics.kv_orphaned.labels(DECODE_REFUSED).inc()

    async def _serve_direct(
        self,
        leg: LegLease,
        request: CompletionRequest,
        exchange: Exchange,
        authorization: str | None,
        trace: RequestTrace,
    ) -> None:
        self._metrics.direct.inc()
        exchange.notes.decode, exchange.notes.direct = leg.instance.name, True
        # No tag: the decode instance's connector computes the prompt itself.
        exchange.request_id = self._new_uid()
        headers = self.leg_headers(exchange.request_id, authorization)
        with trace.leg(Role.DECODE, leg.instance.name) as span:
            await self._decode(leg, request.body, request, headers | span, exchange, exchange.task)

    def _kv_params(self, prefill: LegLease, answer: Reply) -> dict[str, Any]:
        params = params_from_answer(answer.body)
        if params is None:
            # Without it the decode instance cannot know where the KV is: it would recompute
            # or wait, so the prefill counts as failed.
            raise prefill.failed(
                FailureKind.NO_KV_TRANSFER_PARAMS,
                f"answered without {PARAMS_FIELD} (is its connector really nixl?)",
            )
        return params

    async def _prefill(
        self,
        leg: LegLease,
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
            leg.watch("answer", settings.prefill_timeout),
            Deadline(self._alarms, task, leg.limit),
        ):
            reply = await self._upstream.post(
                leg.instance.http_address,
                request.path,
                body,
                headers,
                settings.max_response_bytes,
            )
        notes = exchange.notes
        notes.prefill_seconds = time.perf_counter() - started
        self._metrics.prefill_done(notes.prefill_seconds)
        kind = classify(reply.status)
        if kind is None:
            # Counted as a success by the caller, once the answer proved usable.
            return reply
        raise leg.failed(kind, _answered(reply.status, reply.body))

    async def _decode(
        self,
        leg: LegLease,
        body: bytes,
        request: CompletionRequest,
        headers: dict[str, str],
        exchange: Exchange,
        task: asyncio.Task[Any],
        beside: DecodeBound | None = None,
    ) -> bool:
        """Relay the decode's answer; True if it was a refusal (4xx). `task`: the one this runs
        in (its deadlines cancel it); `beside`: the bound when a prefill runs alongside (the
        instance may first wait for it)."""
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
            leg.watch(waiting, limit if beside is None else limit + beside.prefill_wait),
            Deadline(self._alarms, task, leg.limit) as deadline,
        ):
            if beside is not None:
                beside.waiting(deadline, leg, limit)
            async with self._upstream.stream(
                "POST", leg.instance.http_address, request.path, body, headers
            ) as stream:
                if not 200 <= stream.status < 300:
                    body = await stream.read_all(settings.max_response_bytes)
                    kind = classify(stream.status)
                    if kind is None:  # a 4xx: vLLM's own words for the client
                        leg.succeeded()
                        await _answer_whole(exchange, stream.status, stream.content_type, body)
                        return True
                    raise leg.failed(kind, _answered(stream.status, body))
                if not request.stream:
                    # vLLM sends a whole answer's headers once it is ready: from here on a
                    # retry would compute it twice, which is what migration (when on) is for:
                    # the client has nothing yet and is owed the whole answer.
                    leg.answered = not self._migration_limit
                    body = await stream.read_all(settings.max_response_bytes)
                    self._first_byte(exchange, started)
                    if beside is not None:
                        beside.release()
                    deadline.reschedule(None)
                    leg.succeeded()
                    await exchange.whole(stream.status, stream.content_type, body)
                    return False
                chunk = await _opening(stream, await stream.next_chunk(), leg)
                ledger = exchange.ledger
                # A whole answer's chunks stay in the proxy: computing it again from its prompt
                # sends the client nothing twice (done when it cannot be continued).
                leg.answered = bool(chunk) and (ledger is None or not ledger.whole)
                self._first_byte(exchange, started)
                if ledger is None or not ledger.whole:
                    # The client's first token leaves now: the request's time to first token.
                    self._metrics.first_token_sent(time.perf_counter() - exchange.arrived)
                if beside is not None:
                    beside.release()
                deadline.reschedule(None)
                leg.waiting, leg.limit = "next chunk", settings.stream_idle_timeout
                if ledger is not None:
                    await self._relay_ledgered(leg, stream, chunk, exchange, ledger, deadline)
                    return False
                await exchange.start_stream(stream.status, stream.content_type)
                while chunk:
                    # Only the instance is on the clock: a slow client is not its fault
                    # (the request timeout bounds the client).
                    await exchange.chunk(chunk)
                    deadline.reschedule(loop.time() + leg.limit)
                    chunk = await stream.next_chunk()
                    deadline.reschedule(None)
                leg.succeeded()
                await exchange.end_stream()
                return False

    async def _relay_ledgered(
        self,
        leg: LegLease,
        stream: AnswerStream,
        chunk: bytes,
        exchange: Exchange,
        ledger: StreamLedger,
        deadline: Deadline,
    ) -> None:
        """The relay with migration on: whole events only, read by the ledger (a first leg's
        or a continuation's); a stream that ends before its [DONE] is a failed leg. For a whole
        answer nothing is relayed: the ledger's answer goes out once the stream ends."""
        loop = exchange.task.get_loop()
        whole = ledger.whole
        if not exchange.started and not whole:
            await exchange.start_stream(stream.status, stream.content_type)
        while chunk:
            try:
                data = ledger.feed(chunk)
            except MalformedStream as exc:
                raise leg.failed(FailureKind.PROTOCOL, f"sent {exc}") from None
            if data and not whole:
                await exchange.chunk(data)
            deadline.reschedule(loop.time() + leg.limit)
            chunk = await stream.next_chunk()
            deadline.reschedule(None)
        if not ledger.done:
            raise leg.failed(FailureKind.PROTOCOL, "ended its stream before [DONE]")
        leg.succeeded()
        if whole:
            await _answer_ledgered(exchange, ledger)
        else:
            await exchange.end_stream()

    def _first_byte(self, exchange: Exchange, started: float) -> None:
        exchange.notes.decode_first_byte_seconds = time.perf_counter() - started
        self._metrics.decode_first_byte_seen(exchange.notes.decode_first_byte_seconds)


async def _answer_whole(exchange: Exchange, status: int, content_type: bytes, body: bytes) -> None:
    """Relay an instance's refusal; once an answer is under way (a continuation refused), the
    answer fails instead: a stream ends with an error event (its status is sent already)."""
    ledger = exchange.ledger
    if not exchange.started and (ledger is None or not ledger.migrations):
        await exchange.whole(status, content_type, body)
        return
    text = body[:_ERROR_SNIPPET].decode("utf-8", errors="replace")
    raise ProxyError(
        502,
        f"the answer could not be continued: the new pair answered HTTP {status}: {text}",
        code="migration_refused",
    )


async def _answer_ledgered(exchange: Exchange, ledger: StreamLedger) -> None:
    """A whole answer the ledger put together from its decode legs' streams."""
    status, body = ledger.whole_answer()
    await exchange.whole(status, b"application/json", body)


def _whole_under_way(exchange: Exchange) -> bool:
    """Whether a whole answer's decode had sent some of it, with the token ids to continue it
    on another pair (or a continuation is running)."""
    ledger = exchange.ledger
    if ledger is None or not ledger.whole:
        return False
    if ledger.migrations:
        return True
    return ledger.migratable and ledger.prompt_ids is not None and bool(ledger.generated)


def _nixl_push_decode_params(prefill: Instance, request_id: str) -> dict[str, Any]:
    coordinates = prefill.coordinates
    # The registry refuses a nixl_push prefill without them.
    assert coordinates is not None
    assert coordinates.engine_id is not None and coordinates.side_channel is not None
    geometry = prefill.geometry
    tp_size = 1 if geometry is None or geometry.tp_size is None else geometry.tp_size
    return nixl_push_decode_params(
        coordinates.engine_id, coordinates.side_channel, tp_size, request_id
    )


def _bootstrap_of(prefill: Instance) -> Address | None:
    """A mooncake prefill's bootstrap server (None: not a mooncake prefill)."""
    coordinates = prefill.coordinates
    if prefill.connector is not Connector.MOONCAKE or coordinates is None:
        return None
    return coordinates.bootstrap


def _context_refusal(request: CompletionRequest, decode: Instance) -> bytes | None:
    """What `decode` would answer a request asking for more tokens than its context holds,
    when it announced its context length (max_model_len)."""
    if decode.max_model_len is None:
        return None
    return request.context_refusal(decode.max_model_len)


async def _opening(stream: AnswerStream, chunk: bytes, leg: LegLease) -> bytes:
    """A stream's first bytes, read on past a chat answer's role-only events; raises the leg's
    failure if the instance failed the request before its first token (stream_opening.py)."""
    held = chunk
    while True:
        verdict, detail = read_opening(held)
        if verdict is Opening.RELAY:
            return held
        if verdict is Opening.FAILED:
            raise leg.failed(FailureKind.STREAM_ERROR, f"stream failed before any token: {detail}")
        more = await stream.next_chunk()
        if not more:
            return held  # the stream ended: relayed as it is
        held += more


def _answered(status: int, body: bytes) -> str:
    text = body[:_ERROR_SNIPPET].decode("utf-8", errors="replace")
    return f"answered HTTP {status}: {text}" if text else f"answered HTTP {status}"
