"""The non-hot endpoints: health, readiness, metrics, models, instances; OpenAI-shaped errors
for everything FastAPI itself rejects (unknown path, wrong method, unexpected failure)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdproxy.metrics import CONTENT_TYPE
from pdproxy.pairing.listing import pairs_report
from pdproxy.pairing.planner import readiness
from pdproxy.proxy.errors import error_body
from pdproxy.proxy.upstream import UpstreamError
from pdproxy.registry.messages import Role
from pdproxy.registry.table import Entry

if TYPE_CHECKING:
    from pdproxy.proxy.app import PdproxyApp

log = logging.getLogger("pdproxy.routes")

_MODELS_LIMIT = 1024 * 1024
_MODELS_TRIES = 3


def _json(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(payload), status, headers, media_type="application/json")


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(status, message), status, headers, media_type="application/json")


def install_routes(api: FastAPI, app: PdproxyApp) -> None:
    @api.get("/health")
    async def health() -> Response:
        return _json({"status": "ok"})

    @api.get("/ready")
    async def ready() -> Response:
        state = app.state
        verdict = readiness(state.planner.index(state.table.snapshot()))
        # Orphans (instances no counterpart can exchange KV with) are named even when ready:
        # part of the fleet is idle and an operator should know why.
        orphans = {"orphans": list(verdict.orphans)} if verdict.orphans else {}
        if verdict.ready:
            return _json({"status": "ready", **orphans})
        return _json({"status": "not_ready", "reason": verdict.reason, **orphans}, 503)

    @api.get("/v1/instances/pairs")
    async def pairs() -> Response:
        state = app.state
        return _json({"prefills": pairs_report(state.planner.index(state.table.snapshot()))})

    @api.get("/metrics")
    async def metrics() -> Response:
        return Response(app.state.metrics.render(), media_type=CONTENT_TYPE)

    @api.get("/v1/instances")
    async def instances() -> Response:
        state = app.state
        now = state.clock()
        entries = sorted(state.table.entries(), key=lambda e: (e.instance.role, e.instance.name))
        return _json(
            {
                "ttl_seconds": state.table.ttl,
                "instances": [_describe(entry, now) for entry in entries],
            }
        )

    @api.get("/v1/models")
    async def models(request: Request) -> Response:
        state = app.state
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
                if isinstance(exc, UpstreamError) and exc.kind == "saturated":
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


def _model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "pdproxy"}


def _describe(entry: Entry, now: float) -> dict[str, Any]:
    instance = entry.instance
    geometry = instance.geometry
    load = instance.load
    return {
        "role": "prefill" if instance.role is Role.PREFILL else "decode",
        "type": instance.role.value,
        "http_address": instance.name,
        "zmq_address": str(instance.zmq_address),
        "source": instance.source.value,
        "model": instance.model,
        "connector": None if instance.connector is None else instance.connector.value,
        "geometry": None if geometry is None else _fields(geometry),
        "load": None if load is None else _fields(load),
        "healthy": instance.healthy,
        "age_seconds": round(now - entry.first_seen, 3),
        "last_seen_seconds_ago": round(now - entry.last_seen, 3),
    }


def _fields(value: Any) -> dict[str, Any]:
    return {name: getattr(value, name) for name in value.__slots__}
