"""How an HTTP worker of a multi-worker proxy reaches the registry: it keeps a copy of the
registry process's table and sends the admin API's changes there (`RegistryCopy`, built by
`RegistryProcessCopy`, the worker's `RegistrySide`)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq.asyncio

from pdproxy.config import Settings
from pdproxy.metrics import Metrics
from pdproxy.multiworker.fleet_control import RemoteControl
from pdproxy.multiworker.paths import SharedPaths
from pdproxy.multiworker.table_mirror import TableMirror
from pdproxy.multiworker.work_mirror import WorkMirror
from pdproxy.registry.control import DrainedSink, RegistryLink, WorkSink
from pdproxy.registry.table import RegistryTable

log = logging.getLogger("pdproxy")


# A worker starts listening only once it holds the registry's table (republished every two
# seconds), or after this long beyond one TTL: a registry process that was started again holds
# back for one TTL, and a worker must not wait for ever on one that cannot start.
FIRST_COPY_GRACE_SECONDS = 3.0


class RegistryCopy:
    def __init__(
        self,
        shared: SharedPaths,
        table: RegistryTable,
        on_drained: DrainedSink,
        metrics: Metrics,
        work: WorkSink,
    ) -> None:
        self._context = zmq.asyncio.Context()
        self._mirror = TableMirror(shared.state_endpoint, self._context, table, on_drained, metrics)
        self._mirror.start()
        self._work = WorkMirror(shared.work_endpoint, self._context, work)
        self._work.start()
        self.control = RemoteControl(shared.control_endpoint, self._context, self._mirror)

    async def first_copy(self, ttl: float) -> None:
        within = ttl + FIRST_COPY_GRACE_SECONDS
        if not await self._mirror.caught_up(0, within):
            log.warning("no table from the registry process within %gs: serving without", within)

    async def stop(self) -> None:
        await self._work.stop()
        await self._mirror.stop()
        self._context.term()


class RegistryProcessCopy:
    """An HTTP worker's `RegistrySide`: the registry process owns the table; this process holds
    a copy, and its metrics are shared with the other processes."""

    def __init__(self, shared: SharedPaths) -> None:
        self._shared = shared
        self.shared_metrics_dir: str | None = shared.metrics_dir

    def make_table(
        self, settings: Settings, metrics: Metrics, clock: Callable[[], float]
    ) -> RegistryTable:
        return RegistryTable(settings.ttl, settings.max_instances)

    async def attach(
        self,
        settings: Settings,
        table: RegistryTable,
        on_drained: DrainedSink,
        metrics: Metrics,
        work: WorkSink,
    ) -> RegistryLink:
        copy = RegistryCopy(self._shared, table, on_drained, metrics, work)
        await copy.first_copy(settings.ttl)  # before the lifespan ends: before it listens
        return copy
