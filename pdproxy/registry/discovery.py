"""The instance sources a registry runs beside its socket, started where the table lives (one
process: OwnRegistry; under `--workers`: the registry process's RegistryHub), as the static
instances are seeded there (seeded.py): Kubernetes discovery when Settings.discovery is
kubernetes, else none."""

from __future__ import annotations

from typing import Protocol

from pdproxy.config import Settings
from pdproxy.metrics import Metrics
from pdproxy.registry.server import RegistryServer


class Discovery(Protocol):
    async def stop(self) -> None: ...


def start_discovery(
    settings: Settings, registry: RegistryServer, metrics: Metrics
) -> Discovery | None:
    """Start the configured discovery, feeding `registry`'s table; None: announcements only."""
    if settings.discovery != "kubernetes":
        return None
    # Here, not at the top: pdproxy.registry.kubernetes is the only user of the `kubernetes`
    # extra, which a proxy without discovery need not have.
    from pdproxy.registry.kubernetes import KubernetesDiscovery

    discovery = KubernetesDiscovery(settings, registry, metrics)
    discovery.start()
    return discovery
