"""The ASGI application: built once from Settings; its lifespan builds all state.

The two completion endpoints are served by a lean ASGI endpoint (the hot path); everything else
(health, readiness, metrics, models, instances, 404s) goes through FastAPI.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI

from pdproxy.config import Settings
from pdproxy.http.alarms import Alarms
from pdproxy.http.upstream import Upstream
from pdproxy.metrics import Metrics
from pdproxy.multiworker.paths import SharedPaths
from pdproxy.multiworker.registry_link import LocalRegistry, RegistryCopy, RegistryLink
from pdproxy.pairing.planner import Planner
from pdproxy.pairing.policies import make_policy
from pdproxy.proxy.admission import Admission
from pdproxy.proxy.completions import CompletionsEndpoint
from pdproxy.proxy.credentials import Credentials
from pdproxy.proxy.dispatch import Dispatcher
from pdproxy.proxy.exchange import Scope
from pdproxy.proxy.front import COMPLETION_PATHS, FrontDoor
from pdproxy.proxy.prober import HealthProber
from pdproxy.proxy.rotation import Rotation
from pdproxy.proxy.routes import install_routes
from pdproxy.registry.seeded import seeded_table
from pdproxy.registry.server import RegistryServer
from pdproxy.registry.table import RegistryTable
from pdproxy.reliability.outlier import OutlierDetector, OutlierPolicy
from pdproxy.tracing.random_ids import RandomHex
from pdproxy.tracing.spans import Tracing, build_tracing

log = logging.getLogger("pdproxy")


@dataclass
class AppState:
    settings: Settings
    metrics: Metrics
    table: RegistryTable
    upstream: Upstream
    planner: Planner
    rotation: Rotation
    dispatcher: Dispatcher
    tracing: Tracing
    outliers: OutlierDetector
    admission: Admission
    prober: HealthProber
    clock: Callable[[], float]
    registry_link: RegistryLink
    alarms: Alarms


def planner_from(settings: Settings) -> Planner:
    return Planner(
        make_policy(settings.prefill_policy, load_factor=settings.prefix_affinity_load_factor),
        make_policy(settings.decode_policy),
        allow_unknown_geometry=settings.allow_unknown_geometry,
        kv_capacity_tokens=settings.decode_kv_capacity_tokens,
        instance_cap=settings.instance_max_inflight,
    )


def outlier_policy(settings: Settings) -> OutlierPolicy:
    return OutlierPolicy(
        settings.outlier_consecutive_failures,
        settings.outlier_base_ejection_seconds,
        settings.outlier_max_ejection_seconds,
        settings.outlier_max_ejection_percent,
    )


async def build_state(
    settings: Settings, clock: Callable[[], float], shared: SharedPaths | None = None
) -> AppState:
    # First: it is the one part that may fail to build, and nothing is bound yet.
    random_hex = RandomHex()  # built here, after any fork: processes must not share its bytes
    tracing = build_tracing(settings.otel_exporter, lambda: random_hex.hex(8))
    metrics = Metrics(shared=shared is not None)
    if shared is None:
        table = seeded_table(settings, metrics, clock)
        registry = RegistryServer(settings, table, metrics, clock)
        registry.publish_counts()
        registry.start()
    else:
        table = RegistryTable(settings.ttl, settings.max_instances)  # the registry process's copy
    upstream = Upstream(settings)
    await upstream.start()
    planner = planner_from(settings)
    outliers = OutlierDetector(outlier_policy(settings))
    metrics.watch_circuits(outliers.circuits)
    admission = Admission(
        settings.max_inflight_requests,
        settings.max_queued_requests,
        settings.queue_timeout,
        settings.retry_after_seconds,
        metrics,
    )
    rotation = Rotation(settings, table, planner, outliers, admission, metrics, clock)
    link: RegistryLink
    if shared is None:
        link = LocalRegistry(registry, table, rotation)
    else:
        copy = RegistryCopy(shared, table, rotation, metrics)
        await copy.first_copy(settings.ttl)  # before the lifespan ends: before it listens
        link = copy
    alarms = Alarms(asyncio.get_running_loop())
    dispatcher = Dispatcher(
        settings, rotation, upstream, metrics, tracing, alarms, new_uid=lambda: random_hex.hex(16)
    )
    prober = HealthProber(
        settings.health_check_interval,
        settings.health_check_timeout,
        table,
        upstream,
        outliers,
        metrics,
        clock,
    )
    prober.start()
    return AppState(
        settings,
        metrics,
        table,
        upstream,
        planner,
        rotation,
        dispatcher,
        tracing,
        outliers,
        admission,
        prober,
        clock,
        link,
        alarms,
    )


class PdproxyApp:
    def __init__(
        self,
        settings: Settings,
        clock: Callable[[], float] = time.monotonic,
        shared: SharedPaths | None = None,
        credentials: Credentials | None = None,
    ) -> None:
        self.settings = settings
        self._clock = clock
        self._shared = shared  # set in an HTTP worker of a multi-worker proxy
        self._state: AppState | None = None
        # Read before anything binds: a missing key file fails the start, not a request.
        self.credentials = credentials or Credentials.from_settings(settings)
        self.api = FastAPI(lifespan=self._lifespan, docs_url=None, redoc_url=None, openapi_url=None)
        install_routes(self.api, self)
        self.front_door = FrontDoor(self.api, self.credentials)

    @property
    def state(self) -> AppState:
        if self._state is None:
            raise RuntimeError("pdproxy state used outside the app's lifespan")
        return self._state

    @contextlib.asynccontextmanager
    async def _lifespan(self, _api: FastAPI) -> AsyncIterator[None]:
        state = await build_state(self.settings, self._clock, self._shared)
        self._state = state
        self.front_door.metrics = state.metrics
        self.front_door.hot = {
            path: CompletionsEndpoint(
                path,
                self.settings,
                state.dispatcher,
                state.admission,
                state.metrics,
                state.alarms,
            )
            for path in COMPLETION_PATHS
        }
        # Everything built so far lives as long as the process: out of the collector's sight,
        # so the full collections that requests' garbage triggers do not walk it each time;
        # and collections less often (the hot path makes few reference cycles). Measured at
        # c=64 on one core (docs/performance.md): p99 51-61 ms -> 17-29 ms, req/s about +15%.
        gc.collect()
        gc.freeze()
        gc.set_threshold(20_000, 20, 20)
        log.info(
            "pdproxy ready to serve on %s:%d (registry %s, prefill policy %s, decode policy %s)",
            self.settings.host,
            self.settings.port,
            self.settings.registry_bind,
            self.settings.prefill_policy,
            self.settings.decode_policy,
        )
        try:
            yield
        finally:
            self.front_door.hot = {}
            self.front_door.metrics = None
            await state.prober.stop()
            await state.registry_link.stop()
            await state.upstream.close()
            state.tracing.shutdown()
            state.alarms.close()
            self._state = None

    def begin_drain(self) -> None:
        """SIGTERM: /ready answers 503 and new requests are refused from now on."""
        if self._state is not None and not self._state.admission.draining:
            self._state.admission.draining = True
            log.info("draining: refusing new requests, waiting for those in flight")

    @property
    def idle(self) -> bool:
        """Nothing in flight or waiting (always true outside the lifespan)."""
        return self._state is None or self._state.admission.idle

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        """For ASGI servers other than pdproxy's own (run_server serves `front_door` itself)."""
        await self.front_door(scope, receive, send)


def create_app(settings: Settings, shared: SharedPaths | None = None) -> PdproxyApp:
    return PdproxyApp(settings, shared=shared)
