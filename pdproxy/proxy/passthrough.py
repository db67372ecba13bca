"""vLLM's endpoints other than completions and chat, passed through to one instance.

Nothing is disaggregated here: the request goes, as the client sent it, to one instance of the
path's role (decode unless `passthrough_role` says otherwise), chosen by the pairing's planner
among the instances in rotation that serve the body's model; the answer comes back as the
instance gave it (status, content type, body, streamed through with bounded buffers). A leg
that could not reach its instance (refused, reset before any answer) is retried on another;
one that reached it never is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from typing import Any

import orjson

from pdproxy.base.roles import Role
from pdproxy.config import Settings, passthrough_roles
from pdproxy.http.alarms import Alarms
from pdproxy.http.deadline import Deadline
from pdproxy.http.upstream import UpstreamClient
from pdproxy.logs import ACCESS_LOGGER, FIELDS
from pdproxy.metrics import Metrics
from pdproxy.proxy.admission import Admission
from pdproxy.proxy.completions import (
    CLIENT_CLOSED,
    SHUTTING_DOWN,
    read_body,
    read_client_headers,
    timed_out,
)
from pdproxy.proxy.dispatch import Dispatcher
from pdproxy.proxy.errors import ProxyError
from pdproxy.proxy.exchange import ClientGone, ClientHeaders, Exchange, Scope
from pdproxy.proxy.failures import LegFailed, classify
from pdproxy.proxy.lease import LegLease, lease_one
from pdproxy.proxy.rotation import Rotation
from pdproxy.reliability.backoff import RetryPolicy
from pdproxy.reliability.failures import FailureKind

log = logging.getLogger("pdproxy.passthrough")
access = logging.getLogger(ACCESS_LOGGER)

# vLLM 0.32's endpoints (vllm/entrypoints/...: pooling, scoring, tokenize, render, derender,
# instrumentator), each its own metric label. `/v1/models` is merged by pdproxy instead.
PASSTHROUGH_PATHS = (
    "/v1/embeddings",
    "/v2/embed",
    "/pooling",
    "/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/tokenize",
    "/detokenize",
    "/v1/messages/count_tokens",
    "/tokenizer_info",
    "/version",
    "/v1/chat/completions/render",
    "/v1/completions/render",
    "/v1/messages/render",
    "/v1/responses/render",
    "/v1/chat/completions/derender",
    "/v1/completions/derender",
)
# Every other path passed through is counted under one label: client-chosen paths must not
# grow label sets.
UNKNOWN_LABEL = "other"
# pdproxy's own paths (FastAPI's routes, the admin prefixes): never passed through. The
# prefixes are exactly those the front door's admin check skips the client key for (a path
# there passed through would reach an instance without one).
_OWN_PATHS = frozenset(("/health", "/ready", "/metrics", "/v1/models", "/openapi.json"))
_OWN_PREFIXES = ("/v1/instances", "/v1/admin/")
# HEAD is left out: its answer has no body, which the upstream client does not expect.
_METHODS = frozenset(("GET", "POST", "PUT", "PATCH", "DELETE"))
# Failures that happen before the request reached the instance: safe to send elsewhere.
_RETRIED = frozenset((FailureKind.CONNECT, FailureKind.CONNECT_TIMEOUT, FailureKind.RESET))
_MAX_MODEL_NAME = 256
_SSE = b"text/event-stream"


def is_own_path(path: str) -> bool:
    """Whether pdproxy itself serves `path` (it is then never passed through)."""
    return path in _OWN_PATHS or path.startswith(_OWN_PREFIXES)


def route_table(settings: Settings) -> dict[str, Role]:
    """The role serving each known path: decode, unless `passthrough_role` names it."""
    overrides = passthrough_roles(settings.passthrough_role)
    return {path: overrides.get(path, Role.DECODE) for path in PASSTHROUGH_PATHS}


class PassThroughEndpoint:
    """One known path (or, with `role=None`, every unknown one: the role then comes from
    `passthrough_role` per path), as an ASGI endpoint."""

    def __init__(
        self,
        label: str,
        role: Role | None,
        settings: Settings,
        dispatcher: Dispatcher,
        rotation: Rotation,
        upstream: UpstreamClient,
        admission: Admission,
        metrics: Metrics,
        alarms: Alarms,
    ) -> None:
        self._label = label
        self._role = role
        self._overrides = passthrough_roles(settings.passthrough_role)
        self._settings = settings
        self._dispatcher = dispatcher
        self._rotation = rotation
        self._upstream = upstream
        self._admission = admission
        self._metrics = metrics
        self._alarms = alarms
        self._access_log = settings.access_log
        self._retry = RetryPolicy(
            settings.max_attempts,
            settings.retry_backoff_base_seconds,
            settings.retry_backoff_max_seconds,
        )
        self._loop = asyncio.get_running_loop()

    def role_for(self, path: str) -> Role:
        if self._role is not None:
            return self._role
        return self._overrides.get(path, Role.DECODE)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        started = time.perf_counter()
        client = read_client_headers(scope["headers"])
        task = asyncio.current_task(self._loop)
        assert task is not None
        exchange = Exchange(scope, receive, send, client.request_id, task, started)
        try:
            method: str = scope["method"]
            if method not in _METHODS:
                raise ProxyError(405, f"method {method} not allowed here")
            target = _target(scope)
            with Deadline(self._alarms, task, self._settings.request_timeout) as deadline:
                exchange.deadline = deadline.when() or exchange.deadline
                admission = self._admission
                if not admission.try_enter():
                    await admission.enter()
                try:
                    body = await read_body(exchange, client, self._settings, self._alarms)
                    exchange.notes.model = _model_of(body)
                    exchange.watch_disconnect()
                    await self._serve(scope, target, body, exchange, client)
                finally:
                    admission.leave()
        except ProxyError as exc:
            exchange.notes.error = exc.code
            log.warning("%s: %d %s", self._label, exc.status, exc.message)
            await exchange.fail(exc)
        except TimeoutError:
            exchange.notes.error = "timeout"
            await exchange.fail(timed_out(exchange, self._settings.request_timeout))
        except ClientGone:
            exchange.client_gone = True
        except asyncio.CancelledError:
            # As in CompletionsEndpoint: our own disconnect watch ends the request quietly.
            if not exchange.client_gone or task.uncancel() > 0:
                exchange.notes.error = "shutting_down"
                with contextlib.suppress(Exception):
                    await exchange.fail(SHUTTING_DOWN)
                raise
        except Exception:
            log.exception("unexpected error passing %s through", scope["path"])
            exchange.notes.error = "internal"
            await exchange.fail(ProxyError(500, "internal error in pdproxy", code="internal"))
        finally:
            exchange.stop_watching()
            status = CLIENT_CLOSED if exchange.client_gone else exchange.status
            elapsed = time.perf_counter() - started
            self._metrics.request_answered(self._label, str(status), elapsed)
            if self._access_log and access.isEnabledFor(logging.INFO):
                self._log_access(exchange, scope, status, elapsed)

    async def _serve(
        self, scope: Scope, target: str, body: bytes, exchange: Exchange, client: ClientHeaders
    ) -> None:
        """Legs until one reaches an instance: a failure before that is tried elsewhere."""
        role = self.role_for(scope["path"])
        headers = self._headers(scope, client)
        sent = None if not body and scope["method"] in ("GET", "DELETE") else body
        failed: set[str] = set()
        last: LegFailed | None = None
        while True:
            try:
                instance = await self._rotation.choose_one(
                    role, exchange.notes.model, frozenset(failed)
                )
            except ProxyError as refusal:
                if last is not None and refusal.code == "no_instance":
                    raise last from None  # the failures took the last instances away
                raise
            leg = lease_one(self._rotation, role, instance)
            try:
                await self._leg(leg, scope["method"], target, sent, headers, exchange)
                return
            except LegFailed as failure:
                last = failure
                if failure.kind not in _RETRIED or not failure.retryable or exchange.started:
                    raise
                failed.add(failure.instance)
                remaining = exchange.deadline - self._loop.time()
                delay = self._retry.next_delay(len(failed), random.random(), remaining)
                if delay is None:
                    raise
                self._metrics.retries.labels(failure.role, failure.kind).inc()
                exchange.notes.attempts = len(failed) + 1
                await asyncio.sleep(delay)
            finally:
                leg.release()

    def _headers(self, scope: Scope, client: ClientHeaders) -> dict[str, str]:
        """What the instance gets: the client's content type, pdproxy's request id, and the
        Authorization the completion legs would carry (never a key meant for pdproxy)."""
        request_id = self._dispatcher.new_request_id()
        headers = self._dispatcher.leg_headers(request_id, client.authorization)
        del headers["Content-Type"]
        for name, value in scope["headers"]:
            if name == b"content-type":
                headers["Content-Type"] = value.decode("latin-1")
        return headers

    async def _leg(
        self,
        leg: LegLease,
        method: str,
        target: str,
        body: bytes | None,
        headers: dict[str, str],
        exchange: Exchange,
    ) -> None:
        """Send the request to the leg's instance and relay its answer."""
        settings = self._settings
        notes = exchange.notes
        if leg.role is Role.PREFILL:
            notes.prefill, limit = leg.instance.name, settings.prefill_timeout
        else:
            notes.decode, limit = leg.instance.name, settings.decode_timeout
        exchange.request_id = headers["X-Request-Id"]
        started = time.perf_counter()
        # The answer's head and first byte within the role's whole-leg bound (these answers
        # mostly come whole, as a non-streaming decode's does); then each further piece
        # within stream_idle_timeout.
        with (
            leg.watch("answer", limit),
            Deadline(self._alarms, exchange.task, leg.limit) as deadline,
        ):
            async with self._upstream.stream(
                method, leg.instance.http_address, target, body, headers
            ) as stream:
                leg.answered = True  # it reached the instance: never sent elsewhere now
                kind = classify(stream.status)
                if stream.status >= 400:
                    answer = await stream.read_all(settings.max_response_bytes)
                    notes.decode_first_byte_seconds = time.perf_counter() - started
                    deadline.reschedule(None)
                    self._settle(leg, kind, stream.status, answer)
                    await exchange.whole(stream.status, stream.content_type, answer)
                    return
                chunk = await stream.next_chunk()
                notes.decode_first_byte_seconds = time.perf_counter() - started
                deadline.reschedule(None)
                if stream.content_type.startswith(_SSE):
                    await exchange.start_stream(stream.status, stream.content_type)
                else:
                    await exchange.start_body(stream.status, stream.content_type)
                leg.waiting, leg.limit = "next chunk", settings.stream_idle_timeout
                while chunk:
                    await exchange.chunk(chunk)
                    deadline.reschedule(self._loop.time() + leg.limit)
                    chunk = await stream.next_chunk()
                    deadline.reschedule(None)
                self._settle(leg, kind, stream.status, b"")
                await exchange.end_stream()

    @staticmethod
    def _settle(leg: LegLease, kind: FailureKind | None, status: int, answer: bytes) -> None:
        """The leg's outcome, its answer relayed either way: a 5xx counts against the
        instance's health (and in pdproxy_upstream_errors), a 2xx or 4xx does not."""
        if kind is None:
            leg.succeeded()
        else:
            leg.failed(kind, f"answered HTTP {status}: {answer[:300]!r}")

    def _log_access(self, exchange: Exchange, scope: Scope, status: int, elapsed: float) -> None:
        notes = exchange.notes
        client_id = exchange.client_id
        fields = {
            "endpoint": self._label,
            "path": scope["path"][:_MAX_LOGGED_PATH],
            "method": scope["method"],
            "status": status,
            "duration_ms": round(elapsed * 1000, 3),
            "request_id": exchange.request_id or None,
            "client_request_id": client_id,
            "model": notes.model,
            "prefill": notes.prefill,
            "decode": notes.decode,
            "passthrough": True,
            "attempts": notes.attempts,
            "outcome": _outcome(exchange, status),
        }
        access.info("request", extra={FIELDS: fields})


_MAX_LOGGED_PATH = 200


def _outcome(exchange: Exchange, status: int) -> str:
    if exchange.client_gone:
        return "client_gone"
    if exchange.notes.error:
        return exchange.notes.error
    return "instance_refused" if status >= 400 else "ok"


def _target(scope: Scope) -> str:
    """The request line's target for the instance: the path as the client wrote it (still
    percent-encoded: the instance decodes it as pdproxy did), and its query."""
    raw: bytes = scope.get("raw_path") or scope["path"].encode("utf-8")
    query: bytes = scope.get("query_string", b"")
    target = raw + b"?" + query if query else raw
    if any(byte <= 0x20 or byte == 0x7F for byte in target):
        raise ProxyError(400, "the request target holds spaces or control characters")
    return target.decode("latin-1")


def _model_of(body: bytes) -> str | None:
    """The JSON body's "model", if it names one: the instance must serve it."""
    if body[:64].lstrip()[:1] != b"{":
        return None
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None  # the instance says what is wrong with it, in its own words
    model = parsed.get("model") if isinstance(parsed, dict) else None
    if isinstance(model, str) and 0 < len(model) <= _MAX_MODEL_NAME:
        return model
    return None
