"""Optional active health checks: GET /health on every registered instance, every interval.

Passive detection only sees instances that get traffic; a probe also notices an idle instance
that died, and closes the circuit of a half-open one that answers again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pdproxy.base.tasks import stop_task
from pdproxy.http.upstream import Upstream, UpstreamError
from pdproxy.metrics import Metrics
from pdproxy.proxy.failures import is_local
from pdproxy.registry.table import Instance, RegistryTable
from pdproxy.reliability.outlier import OutlierDetector

log = logging.getLogger("pdproxy.prober")

_PROBE_LIMIT = 64 * 1024
_CONCURRENT_PROBES = 64


class HealthProber:
    def __init__(
        self,
        interval: float,
        timeout: float,
        table: RegistryTable,
        upstream: Upstream,
        outliers: OutlierDetector,
        metrics: Metrics,
        clock: Callable[[], float],
    ) -> None:
        self._interval = interval
        self._timeout = timeout
        self._table = table
        self._upstream = upstream
        self._outliers = outliers
        self._metrics = metrics
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self._limit = asyncio.Semaphore(_CONCURRENT_PROBES)

    def start(self) -> None:
        if self._interval > 0:
            self._task = asyncio.create_task(self._probe_forever(), name="health-prober")

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None

    async def probe_all(self) -> None:
        if self._upstream.congested:
            return  # a probe would measure the proxy's own congestion, not the instances
        self._outliers.ejected(self._clock())  # ended cool-downs turn half-open: probe them
        snapshot = self._table.snapshot()
        instances = (*snapshot.prefills, *snapshot.decodes)
        await asyncio.gather(*(self._probe(instance) for instance in instances))

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.probe_all()
            except Exception:  # a bug here must not end the probing for good
                log.exception("health probes failed")

    async def _probe(self, instance: Instance) -> None:
        async with self._limit:
            try:
                async with asyncio.timeout(self._timeout):
                    reply = await self._upstream.get(
                        instance.http_address, "/health", {}, _PROBE_LIMIT
                    )
                healthy = reply.status == 200
            except UpstreamError as exc:
                if is_local(exc):
                    return  # the proxy's own limit: nobody's health
                healthy = False
            except TimeoutError:
                healthy = False
        now = self._clock()
        if healthy:
            self._metrics.health_probes.labels("ok").inc()
            self._outliers.probe_succeeded(instance.name, now)
            return
        self._metrics.health_probes.labels("failed").inc()
        role = instance.role
        if self._outliers.failure(instance.name, role, now, self._table.count(instance.role)):
            self._metrics.ejections.labels(role).inc()
            log.warning("%s instance %s ejected: its /health probes fail", role, instance.name)
