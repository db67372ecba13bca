"""The operator's actions (the admin API) applied where the table and the drained set live: in
the one process of a single-process proxy, in the registry process under `--workers`."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from enum import StrEnum

from pdproxy.ids import Address
from pdproxy.registry.messages import Rejected
from pdproxy.registry.server import RegistryServer
from pdproxy.registry.table import Instance, RegistryTable

log = logging.getLogger("pdproxy.registry")


class Operation(StrEnum):
    REGISTER = "register"
    REMOVE = "remove"
    DRAIN = "drain"
    UNDRAIN = "undrain"


@dataclass(frozen=True, slots=True)
class ControlRequest:
    operation: Operation
    instance: Instance | None = None  # REGISTER
    address: Address | None = None  # REMOVE, DRAIN, UNDRAIN
    # time.monotonic() (one clock for all processes of the host) past which the worker has
    # answered 503: a request that reaches the registry process later is never applied.
    expires_at: float = math.inf


@dataclass(frozen=True, slots=True)
class ControlReply:
    done: bool  # False: nothing to remove, drain or undrain
    revision: int
    refusal: str | None = None  # REGISTER refused (the registry is full, a static conflict)
    unavailable: str | None = None  # not applied at all, try again later (and why)


@dataclass(frozen=True, slots=True)
class AdminState:
    """What only an operator said, kept in the shared directory so that a registry process
    started again knows it: instances registered through the admin API, the drained set."""

    registered: tuple[Instance, ...]
    drained: frozenset[str]


class FleetOperator:
    def __init__(self, registry: RegistryServer, table: RegistryTable) -> None:
        self._registry = registry
        self._table = table
        # Instances an operator drained: no new legs; those in flight finish.
        self.drained: frozenset[str] = frozenset()
        # Instances an operator registered (and has not removed), by http address.
        self.registered: dict[Address, Instance] = {}

    def admin_state(self) -> AdminState:
        return AdminState(tuple(self.registered.values()), self.drained)

    def restore(self, saved: AdminState) -> None:
        """Take back what an operator said to a registry process that died."""
        for instance in saved.registered:
            try:
                self._registry.add_static(instance)
            except Rejected as exc:
                log.warning("registry: %s could not be registered again: %s", instance.name, exc)
                continue
            self.registered[instance.http_address] = instance
        self.drained = saved.drained

    def apply(self, request: ControlRequest) -> tuple[bool, str | None]:
        """(done, refusal): done is False when there was nothing to remove, drain or
        undrain; a refusal says why a registration was not taken."""
        if request.operation is Operation.REGISTER:
            assert request.instance is not None
            try:
                self._registry.add_static(request.instance)
            except Rejected as exc:
                return False, str(exc)
            self.registered[request.instance.http_address] = request.instance
            return True, None
        assert request.address is not None
        name = str(request.address)
        if request.operation is Operation.REMOVE:
            if not self._registry.remove(request.address):
                return False, None
            self.registered.pop(request.address, None)
            self.drained -= {name}
            return True, None
        if request.operation is Operation.DRAIN:
            if self._table.get(request.address) is None:
                return False, None
            self.drained |= {name}
            log.info("instance %s drained by an admin: no new requests go to it", name)
            return True, None
        if name not in self.drained:
            return False, None
        self.drained -= {name}
        log.info("instance %s back in rotation (admin)", name)
        return True, None
