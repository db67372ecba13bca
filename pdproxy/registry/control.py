"""The admin API's way to the owner of the table and the drained set, and where an HTTP process
gets its table from.

In a single-process proxy the process owns both (`OwnRegistry`, `LocalControl`); under
`--workers` the registry process owns them and each HTTP worker keeps a copy
(pdproxy.multiworker.registry_link). The proxy sees only the protocols here, so it imports
nothing of the multi-worker glue: the process that builds the app chooses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from pdproxy.config import Settings
from pdproxy.ids import Address
from pdproxy.metrics import Metrics
from pdproxy.registry.discovery import Discovery, start_discovery
from pdproxy.registry.operator import ControlReply, ControlRequest, FleetOperator
from pdproxy.registry.seeded import seeded_table
from pdproxy.registry.server import RegistryServer
from pdproxy.registry.table import RegistryTable

# Told the drained set whenever it changes (the rotation keeps those instances out).
DrainedSink = Callable[[frozenset[str]], None]


class WorkSink(Protocol):
    """Where prefills' announced work goes as each report arrives (the planner's legs in
    flight: pairing/inflight.py), for replicas to see each other's work within milliseconds."""

    def follow_work(self) -> None: ...

    def announced_work(self, address: Address, prefill_tokens: int) -> None: ...


class ControlUnavailable(Exception):
    """The owner of the table did not answer in time."""


class FleetControl(Protocol):
    async def apply(self, request: ControlRequest) -> ControlReply: ...


class RegistryLink(Protocol):
    """An HTTP process's hold on the registry, for the lifespan."""

    @property
    def control(self) -> FleetControl: ...

    async def stop(self) -> None: ...


class RegistrySide(Protocol):
    """Where an HTTP process's table comes from; `build_state` asks it in this order."""

    @property
    def shared_metrics_dir(self) -> str | None: ...

    def make_table(
        self, settings: Settings, metrics: Metrics, clock: Callable[[], float]
    ) -> RegistryTable: ...

    async def attach(
        self,
        settings: Settings,
        table: RegistryTable,
        on_drained: DrainedSink,
        metrics: Metrics,
        work: WorkSink,
    ) -> RegistryLink: ...


class LocalControl:
    def __init__(self, operator: FleetOperator, on_drained: DrainedSink) -> None:
        self._operator = operator
        self._on_drained = on_drained

    async def apply(self, request: ControlRequest) -> ControlReply:
        done, refusal = self._operator.apply(request)
        self._on_drained(self._operator.drained)
        return ControlReply(done, 0, refusal)


class LocalRegistry:
    def __init__(
        self,
        registry: RegistryServer,
        table: RegistryTable,
        on_drained: DrainedSink,
        discovery: Discovery | None = None,
    ) -> None:
        self._registry = registry
        self._discovery = discovery
        self.control = LocalControl(FleetOperator(registry, table), on_drained)

    async def stop(self) -> None:
        if self._discovery is not None:
            await self._discovery.stop()
        await self._registry.stop()


class OwnRegistry:
    """A single-process proxy: the process runs the registry server itself."""

    shared_metrics_dir = None

    def __init__(self) -> None:
        self._server: RegistryServer | None = None
        self._discovery: Discovery | None = None

    def make_table(
        self, settings: Settings, metrics: Metrics, clock: Callable[[], float]
    ) -> RegistryTable:
        table = seeded_table(settings, metrics, clock)
        server = RegistryServer(settings, table, metrics, clock)
        server.publish_counts()
        server.start()
        self._server = server
        self._discovery = start_discovery(settings, server, metrics)
        return table

    async def attach(
        self,
        settings: Settings,
        table: RegistryTable,
        on_drained: DrainedSink,
        metrics: Metrics,
        work: WorkSink,
    ) -> RegistryLink:
        assert self._server is not None, "make_table first"
        work.follow_work()
        self._server.work_listener = work.announced_work
        return LocalRegistry(self._server, table, on_drained, self._discovery)
