"""The non-hot endpoints: health, readiness, metrics, models, instances; OpenAI-shaped errors
for everything FastAPI itself rejects (unknown path, wrong method, unexpected failure)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdproxy.base.roles import Role
from pdproxy.config import Settings
from pdproxy.http.upstream import UpstreamError
from pdproxy.ids import Address, AddressError, parse_address
from pdproxy.metrics import CONTENT_TYPE
from pdproxy.pairing.listing import pairs_report
from pdproxy.pairing.planner import readiness
from pdproxy.proxy.credentials import Credentials
from pdproxy.proxy.errors import error_body
from pdproxy.proxy.failures import is_local
from pdproxy.proxy.openapi import openapi_document
from pdproxy.proxy.peers import (
    FORWARDED_BY,
    LOCAL,
    PeerOutcome,
    Peers,
    replica_id,
    report,
    self_answer,
)
from pdproxy.proxy.state import AppState
from pdproxy.registry.auth import address_allowed, parse_cidrs
from pdproxy.registry.control import ControlUnavailable
from pdproxy.registry.messages import known_fields
from pdproxy.registry.operator import ControlReply, ControlRequest, Operation
from pdproxy.registry.table import Instance, Registration, Source

log = logging.getLogger("pdproxy.routes")

_MODELS_LIMIT = 1024 * 1024
_MODELS_TRIES = 3
_ADMIN_BODY_LIMIT = 16 * 1024


def _json(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(payload), status, headers, media_type="application/json")


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(status, message), status, headers, media_type="application/json")


def install_routes(
    api: FastAPI, current_state: Callable[[], AppState], credentials: Credentials
) -> None:
    @api.get("/health")
    async def health() -> Response:
        return _json({"status": "ok"})

    @api.get("/ready")
    async def ready() -> Response:
        state = current_state()
        if state.admission.closing:
            return _json({"status": "not_ready", "reason": "draining: shutting down"}, 503)
        # Ejected and drained instances do not count: a fleet whose every pair is ejected
        # is not ready, even though its instances are registered.
        out_of_rotation = state.rotation.out_of_rotation(state.clock())
        verdict = readiness(state.planner.survey(state.table.snapshot(), out_of_rotation))
        # Orphans (instances no counterpart can exchange KV with) are named even when ready:
        # part of the fleet is idle and an operator should know why.
        orphans = {"orphans": list(verdict.orphans)} if verdict.orphans else {}
        if verdict.ready:
            return _json({"status": "ready", **orphans})
        reason = verdict.reason
        left_out = _left_out(state, out_of_rotation)
        if left_out:
            shown = left_out[:_LEFT_OUT_SHOWN]
            more = len(left_out) - len(shown)
            reason += " (taking no traffic: " + "; ".join(shown)
            reason += f"; {more} more)" if more else ")"
        return _json({"status": "not_ready", "reason": reason, **orphans}, 503)

    @api.get("/v1/instances/pairs")
    async def pairs() -> Response:
        state = current_state()
        return _json({"prefills": pairs_report(state.planner.survey(state.table.snapshot()))})

    document = orjson.dumps(openapi_document())

    @api.get("/openapi.json")
    async def openapi() -> Response:
        return Response(document, media_type="application/json")

    @api.get("/metrics")
    async def metrics() -> Response:
        return Response(current_state().metrics.render(), media_type=CONTENT_TYPE)

    @api.get("/v1/instances")
    async def instances() -> Response:
        state = current_state()
        now = state.clock()
        entries = sorted(
            state.table.registrations(), key=lambda e: (e.instance.role, e.instance.name)
        )
        return _json(
            {
                "ttl_seconds": state.table.ttl,
                "instances": [_describe(entry, now, state) for entry in entries],
            }
        )

    @api.post("/v1/instances")
    async def register(request: Request) -> Response:
        state = current_state()
        _require_admin(credentials, request)
        spec = await _registration(request)
        networks = parse_cidrs(state.settings.registry_address_cidrs)
        for address in (spec.http_address, spec.zmq_address) if networks else ():
            allowed, why = address_allowed(address.host, networks)
            if not allowed:
                # The same fence as for announcements: no registering an arbitrary host.
                return _error(403, f"{address}: {why}")
        instance = Instance(
            spec.role, spec.http_address, spec.zmq_address, Source.STATIC, model=spec.model
        )
        reply = await _apply(state, ControlRequest(Operation.REGISTER, instance=instance))
        if reply.refusal is not None:
            return _error(409, f"not registered: {reply.refusal}")
        return _json({"registered": instance.name}, 201)

    peers: list[Peers] = []  # built on the first admin call that needs it

    def peers_of(settings: Settings) -> Peers | None:
        if not settings.peers_dns:
            return None
        if not peers:
            own = replica_id(settings.host, settings.port)
            peers.append(Peers(settings.peers_dns, settings.port, own))
        return peers[0]

    async def change(
        name: str, request: Request, operation: Operation, done: str, missing: str
    ) -> Response:
        """Remove, drain or undrain one instance: {done: address}, or 404 saying `missing`.
        With peers_dns, every replica is asked too and `replicas` says which applied it."""
        _require_admin(credentials, request)
        address = _address(name)
        state = current_state()
        group = peers_of(state.settings)
        forwarded_by = request.headers.get(FORWARDED_BY)
        if group is not None and forwarded_by == group.own_id:
            return _json(self_answer())  # this replica fanned the call out and applied it
        reply = await _apply(state, ControlRequest(operation, address=address))
        why = None if reply.done else missing.format(address=address)
        if group is None or forwarded_by is not None:  # a forwarded call goes no further
            return _error(404, why) if why is not None else _json({done: str(address)})
        local = PeerOutcome(LOCAL, reply.done, why)
        headers = {"Authorization": request.headers.get("authorization", "")}
        outcomes = await group.fan_out(
            state.upstream, request.method, request.url.path, headers, local
        )
        if not any(outcome.applied for outcome in outcomes):
            return _error(404, f"{why} (on no replica of {state.settings.peers_dns})")
        return _json({done: str(address), "replicas": report(outcomes)})

    @api.delete("/v1/instances/{name}")
    async def deregister(name: str, request: Request) -> Response:
        return await change(
            name, request, Operation.REMOVE, "removed", "no instance {address} is registered"
        )

    @api.post("/v1/instances/{name}/drain")
    async def drain(name: str, request: Request) -> Response:
        return await change(
            name, request, Operation.DRAIN, "drained", "no instance {address} is registered"
        )

    @api.delete("/v1/instances/{name}/drain")
    async def undrain(name: str, request: Request) -> Response:
        return await change(
            name, request, Operation.UNDRAIN, "undrained", "instance {address} is not drained"
        )

    @api.get("/v1/models")
    async def models(request: Request) -> Response:
        state = current_state()
        snapshot = state.table.snapshot()
        names = sorted({i.model for i in (*snapshot.prefills, *snapshot.decodes) if i.model})
        if names or not snapshot.decodes:
            return _json({"object": "list", "data": [_model_card(name) for name in names]})
        # Only v0/static instances without announced models: ask a decode instance.
        headers = {}
        auth = state.dispatcher.leg_headers("", request.headers.get("authorization"))
        if "Authorization" in auth:
            headers["Authorization"] = auth["Authorization"]
        failures = []
        for instance in snapshot.decodes[:_MODELS_TRIES]:
            try:
                async with asyncio.timeout(state.settings.connect_timeout + 5):
                    reply = await state.upstream.get(
                        instance.http_address, "/v1/models", headers, _MODELS_LIMIT
                    )
            except (TimeoutError, UpstreamError) as exc:
                failures.append(f"{instance.name}: {exc or 'timeout'}")
                if is_local(exc):
                    break  # the proxy's own congestion: another instance would wait as long
                continue
            if reply.status == 200:
                return Response(reply.body, 200, media_type="application/json")
            failures.append(f"{instance.name}: HTTP {reply.status}")
        return _error(502, "no decode instance listed its models: " + "; ".join(failures))

    @api.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> Response:
        message = "not found" if exc.status_code == 404 else str(exc.detail)
        return _error(exc.status_code, message, dict(exc.headers or {}))

    @api.exception_handler(Exception)
    async def unexpected(_request: Request, exc: Exception) -> Response:
        log.error("unexpected error: %r", exc, exc_info=exc)
        return _error(500, "internal error in pdproxy")


async def _apply(state: AppState, request: ControlRequest) -> ControlReply:
    try:
        return await state.registry_link.control.apply(request)
    except ControlUnavailable as exc:
        retry = {"Retry-After": str(state.settings.retry_after_seconds)}
        raise StarletteHTTPException(503, f"not applied: {exc}", retry) from None


def _model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "pdproxy"}


class _Registration(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Role
    http_address: str
    zmq_address: str
    model: str | None = Field(None, min_length=1, max_length=256)


@dataclass(frozen=True, slots=True)
class _Spec:
    role: Role
    http_address: Address
    zmq_address: Address
    model: str | None


async def _registration(request: Request) -> _Spec:
    body = await request.body()
    if len(body) > _ADMIN_BODY_LIMIT:
        raise StarletteHTTPException(413, "registration body too large")
    try:
        parsed = _Registration.model_validate_json(body)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
        )
        raise StarletteHTTPException(400, f"invalid registration: {problems}") from None
    return _Spec(
        parsed.role, _address(parsed.http_address), _address(parsed.zmq_address), parsed.model
    )


def _address(text: str) -> Address:
    try:
        return parse_address(text)
    except AddressError as exc:
        raise StarletteHTTPException(400, f"bad address {text[:100]!r}: {exc}") from None


def _require_admin(credentials: Credentials, request: Request) -> None:
    if not credentials.admin_enabled:
        raise StarletteHTTPException(403, "admin endpoints are disabled: no admin token is set")
    if not credentials.admin_allowed(request.headers.get("authorization")):
        raise StarletteHTTPException(
            401, "the admin token is required", {"WWW-Authenticate": 'Bearer realm="pdproxy"'}
        )


def _describe(entry: Registration, now: float, state: AppState) -> dict[str, Any]:
    instance = entry.instance
    health = state.outliers.status(instance.name, now)
    busy = state.planner.inflight.get(instance.http_address)
    geometry = instance.geometry
    load = instance.load
    return {
        "role": instance.role,
        "type": instance.role.wire,
        "http_address": instance.name,
        "zmq_address": str(instance.zmq_address),
        "source": instance.source.value,
        "model": instance.model,
        "connector": None if instance.connector is None else instance.connector.value,
        "geometry": None if geometry is None else _fields(geometry),
        # As announced: the fields an instance did not report are left out, as on the wire.
        "load": None if load is None else known_fields(load),
        "healthy": instance.healthy,
        "circuit": health.circuit.value,
        "consecutive_failures": health.consecutive_failures,
        "ejections": health.ejections,
        "ejected_for_seconds": round(health.ejected_for_seconds, 3),
        # An operator's drain (admin API), or the pod's drain annotation (Kubernetes discovery).
        "drained": instance.name in state.rotation.drained or instance.pod_drained,
        "ready": instance.ready,
        "legs_in_flight": busy.requests,
        "age_seconds": round(now - entry.first_seen, 3),
        "last_seen_seconds_ago": round(now - entry.last_seen, 3),
    }


def _fields(value: Any) -> dict[str, Any]:
    return {name: getattr(value, name) for name in value.__slots__}


_LEFT_OUT_SHOWN = 8  # the reason stays one readable line however large the fleet


def _left_out(state: AppState, out_of_rotation: frozenset[str]) -> list[str]:
    """Registered instances that take no new legs, each with why: what /ready's reason
    needs when "no decode instance" would otherwise hide that one is registered."""
    reasons = []
    for entry in state.table.registrations():
        instance = entry.instance
        if not instance.healthy:
            why = "announced healthy: false"
        elif not instance.ready:
            why = "its pod is not Ready"
        elif instance.pod_drained:
            why = "its pod is annotated to drain"
        elif instance.name in state.rotation.drained:
            why = "drained by an operator"
        elif instance.name in out_of_rotation:
            why = "ejected after failures"
        else:
            continue
        reasons.append(f"{instance.role} {instance.name} {why}")
    return sorted(reasons)
