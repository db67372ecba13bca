"""How an HTTP process reaches the registry: it runs it itself (`LocalRegistry`, one process),
or it keeps a copy of the registry process's table and sends the admin API's changes there
(`RegistryCopy`, one of several HTTP workers)."""

from __future__ import annotations

import logging
from typing import Protocol

import zmq.asyncio

from pdproxy.metrics import Metrics
from pdproxy.multiworker.fleet_control import FleetControl, LocalControl, RemoteControl
from pdproxy.multiworker.paths import SharedPaths
from pdproxy.multiworker.table_mirror import TableMirror
from pdproxy.proxy.rotation import Rotation
from pdproxy.registry.operator import FleetOperator
from pdproxy.registry.server import RegistryServer
from pdproxy.registry.table import RegistryTable

log = logging.getLogger("pdproxy")


class RegistryLink(Protocol):
    @property
    def control(self) -> FleetControl: ...

    async def stop(self) -> None: ...


class LocalRegistry:
    def __init__(self, registry: RegistryServer, table: RegistryTable, rotation: Rotation) -> None:
        self._registry = registry
        self.control = LocalControl(FleetOperator(registry, table), rotation)

    async def stop(self) -> None:
        await self._registry.stop()


# A worker starts listening only once it holds the registry's table (republished every two
# seconds), or after this long beyond one TTL: a registry process that was started again holds
# back for one TTL, and a worker must not wait for ever on one that cannot start.
FIRST_COPY_GRACE_SECONDS = 3.0


class RegistryCopy:
    def __init__(
        self, shared: SharedPaths, table: RegistryTable, rotation: Rotation, metrics: Metrics
    ) -> None:
        self._context = zmq.asyncio.Context()
        self._mirror = TableMirror(shared.state_endpoint, self._context, table, rotation, metrics)
        self._mirror.start()
        self.control = RemoteControl(shared.control_endpoint, self._context, self._mirror)

    async def first_copy(self, ttl: float) -> None:
        within = ttl + FIRST_COPY_GRACE_SECONDS
        if not await self._mirror.caught_up(0, within):
            log.warning("no table from the registry process within %gs: serving without", within)

    async def stop(self) -> None:
        await self._mirror.stop()
        self._context.term()
