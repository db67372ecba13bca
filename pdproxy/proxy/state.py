"""Everything a serving process holds while its app lives, built in one place (`build_state`)
and passed down: the registry table, pairing, reliability, the upstream client, metrics."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from pdproxy import __version__
from pdproxy.config import Settings
from pdproxy.http.alarms import Alarms
from pdproxy.http.upstream import Upstream
from pdproxy.metrics import Metrics
from pdproxy.pairing.planner import Planner
from pdproxy.pairing.policies import make_policy
from pdproxy.proxy.admission import Admission
from pdproxy.proxy.dispatch import Dispatcher
from pdproxy.proxy.prober import HealthProber
from pdproxy.proxy.rotation import Rotation
from pdproxy.registry.control import RegistryLink, RegistrySide
from pdproxy.registry.table import RegistryTable
from pdproxy.reliability.outlier import OutlierDetector, OutlierPolicy
from pdproxy.tracing.random_ids import RandomHex
from pdproxy.tracing.spans import Tracing, build_tracing


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
    # Seeds and a first ticket of this process's own: replicas (and workers) that share them
    # draw the same candidates for the same tickets, all at once, and herd onto the same
    # instances (round robin from 0 in every replica sends each one's first request to the
    # first instance).
    return Planner(
        make_policy(
            settings.prefill_policy,
            load_factor=settings.prefix_affinity_load_factor,
            seed=secrets.randbits(64),
        ),
        make_policy(settings.decode_policy, seed=secrets.randbits(64)),
        allow_unknown_geometry=settings.allow_unknown_geometry,
        kv_capacity_tokens=settings.decode_kv_capacity_tokens,
        instance_cap=settings.instance_max_inflight,
        first_ticket=secrets.randbits(32),
    )


def outlier_policy(settings: Settings) -> OutlierPolicy:
    return OutlierPolicy(
        settings.outlier_consecutive_failures,
        settings.outlier_base_ejection_seconds,
        settings.outlier_max_ejection_seconds,
        settings.outlier_max_ejection_percent,
    )


async def build_state(
    settings: Settings, clock: Callable[[], float], registry_side: RegistrySide
) -> AppState:
    # First: it is the one part that may fail to build, and nothing is bound yet.
    random_hex = RandomHex()  # built here, after any fork: processes must not share its bytes
    tracing = build_tracing(settings.otel_exporter, partial(random_hex.hex, 8))
    metrics = Metrics(shared_dir=registry_side.shared_metrics_dir)
    table = registry_side.make_table(settings, metrics, clock)
    upstream = Upstream(
        settings.connect_timeout, settings.upstream_max_connections, f"pdproxy/{__version__}"
    )
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
    link = await registry_side.attach(
        settings, table, rotation.set_drained, metrics, planner.inflight
    )
    alarms = Alarms(asyncio.get_running_loop())
    dispatcher = Dispatcher(
        settings, rotation, upstream, metrics, tracing, alarms, new_uid=partial(random_hex.hex, 16)
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
