"""The registry table as a proxy starts it: empty but for the instances configured statically
(`--prefill`/`--decode`, with the connector and geometry the operator gave, so that they are
paired by the same rules as announced ones), each one known to the metrics; with a registry
secret, unsigned instances have their own cap (Settings.unsigned_instance_cap)."""

from __future__ import annotations

from collections.abc import Callable

from pdproxy.base.roles import Role
from pdproxy.config import Settings
from pdproxy.metrics import Metrics
from pdproxy.registry.table import Instance, RegistryTable, Source


def static_instances(settings: Settings) -> list[Instance]:
    configured = [(Role.PREFILL, spec) for spec in settings.prefill]
    configured += [(Role.DECODE, spec) for spec in settings.decode]
    return [
        Instance(
            role,
            spec.http_address,
            spec.zmq_address,
            Source.STATIC,
            model=spec.model,
            max_model_len=spec.max_model_len,
            connector=spec.connector,
            coordinates=spec.coordinates,
            geometry=spec.geometry,
        )
        for role, spec in configured
    ]


def seeded_table(settings: Settings, metrics: Metrics, clock: Callable[[], float]) -> RegistryTable:
    table = RegistryTable(
        settings.ttl, settings.max_instances, max_unsigned=settings.unsigned_instance_cap
    )
    for instance in static_instances(settings):
        table.add_static(instance, clock())
        metrics.instance_joined(instance.name)
    return table
