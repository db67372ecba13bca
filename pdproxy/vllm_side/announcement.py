"""The registry messages a worker sends (DESIGN.md section 3). Pure.

They are built as the registry's own typed messages and turned into maps by its one builder,
pdproxy.registry.messages.to_map: announcer and registry share one schema.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pdproxy.base.roles import Role
from pdproxy.ids import parse_address
from pdproxy.registry.messages import (
    MAX_MODEL_LEN,
    Announcement,
    Connector,
    Geometry,
    KvCoordinates,
    Leave,
    Load,
    Stats,
    TransferReport,
    parse_message,
    parse_transfer,
    to_map,
    transfer_map,
)
from pdproxy.registry.messages import (
    TransferOutcome as Outcome,
)

TransferOutcome = Literal["ok", "timeout", "error", "missing", "dropped"]


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    """Who announces: fixed for the life of the worker."""

    role: Role
    http_address: str
    zmq_address: str
    model: str | None = None
    connector: str | None = None
    geometry: Geometry | None = None
    max_model_len: int | None = None  # the context length the server runs the model with
    # Where its connector is reached: a mooncake prefill's bootstrap server, a nixl_push
    # prefill's engine id and side channel.
    coordinates: KvCoordinates | None = None


def context_length(value: object) -> int | None:
    """`value` as an announced max_model_len, or None if the registry would refuse it."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_MODEL_LEN:
        return None
    return value


def announcement(
    identity: WorkerIdentity, load: Load | None = None, healthy: bool = True
) -> Announcement:
    """`identity`'s v1 announcement; ValueError on an address or connector the registry
    would refuse."""
    return Announcement(
        version=1,
        role=identity.role,
        http_address=parse_address(identity.http_address),
        zmq_address=parse_address(identity.zmq_address),
        model=identity.model,
        connector=None if identity.connector is None else Connector(identity.connector),
        geometry=identity.geometry,
        load=load,
        healthy=healthy,
        max_model_len=identity.max_model_len,
        coordinates=identity.coordinates,
    )


def announce_message(
    identity: WorkerIdentity, load: Load | None = None, healthy: bool = True
) -> dict[str, Any]:
    return to_map(announcement(identity, load, healthy))


def leave_message(identity: WorkerIdentity) -> dict[str, Any]:
    return to_map(Leave(parse_address(identity.http_address)))


def v0_message(identity: WorkerIdentity) -> dict[str, Any]:
    """Byte for byte what stock vLLM's P2pNcclEngine sends."""
    version_0 = Announcement(
        0, identity.role, parse_address(identity.http_address), parse_address(identity.zmq_address)
    )
    return to_map(version_0)


@dataclass(frozen=True, slots=True)
class TransferStat:
    """One rank's view of one KV transfer: a P rank what it sent, a D rank what it received."""

    transfer_id: str  # "<32 hex uid of the request-id tag>-<suffix>": the same on P and D
    peer: str  # the other instance: its http address, or its zmq address (as in the tag)
    bytes: int
    blocks: int
    seconds: float
    outcome: TransferOutcome = "ok"

    def report(self) -> TransferReport:
        """This entry as the registry's type, checked by the registry's own decoder: ValueError
        (Rejected, AddressError) if the registry would refuse it."""
        report = TransferReport(
            self.transfer_id,
            parse_address(self.peer),
            self.bytes,
            self.blocks,
            self.seconds,
            Outcome(self.outcome),
        )
        return parse_transfer(transfer_map(report))

    def as_map(self) -> dict[str, Any]:
        """The entry as the wire carries it (ValueError as report())."""
        return transfer_map(self.report())


def stats_message(
    role: Role,
    http_address: str,
    rank: int,
    ranks: int,
    transfers: Sequence[TransferStat],
) -> dict[str, Any]:
    """What TP rank `rank` of `ranks` of an instance reports of its transfers. Raises
    ValueError (Rejected) on what the registry would refuse, by the registry's own checks."""
    reports = tuple(transfer.report() for transfer in transfers)
    wire = to_map(Stats(role, parse_address(http_address), rank, ranks, reports))
    parse_message(wire)  # rank, ranks and the number of transfers
    return wire
