"""The v1 registry messages a worker sends (DESIGN.md section 3), built as plain maps. Pure.

The proxy's decoder (pdproxy.registry.messages) is the other half of this contract; the tests
round-trip every message built here through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pdproxy.base.roles import Role
from pdproxy.registry.messages import MAX_MODEL_LEN, MAX_TP_SIZE, MAX_TRANSFERS

TransferOutcome = Literal["ok", "timeout", "error", "missing", "dropped"]


@dataclass(frozen=True, slots=True)
class WorkerGeometry:
    """KV-cache geometry as announced; a None field is one the worker could not determine."""

    tp_size: int | None = None
    block_size: int | None = None
    num_layers: int | None = None
    num_kv_heads: int | None = None  # total over all TP ranks
    head_dim: int | None = None
    kv_dtype: str | None = None
    is_mla: bool | None = None
    kv_layout: str | None = None  # "NHD" or "HND"

    def as_map(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value is not None}


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None  # fraction of the KV cache in use, 0..1

    def as_map(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value is not None}


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    """Who announces: fixed for the life of the worker."""

    role: Role
    http_address: str
    zmq_address: str
    model: str | None = None
    connector: str | None = None
    geometry: WorkerGeometry | None = None
    max_model_len: int | None = None  # the context length the server runs the model with


def context_length(value: object) -> int | None:
    """`value` as an announced max_model_len, or None if the registry would refuse it."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_MODEL_LEN:
        return None
    return value


def announce_message(
    identity: WorkerIdentity, load: WorkerLoad | None = None, healthy: bool = True
) -> dict[str, Any]:
    message: dict[str, Any] = {
        "v": 1,
        "op": "announce",
        "type": identity.role.wire,
        "http_address": identity.http_address,
        "zmq_address": identity.zmq_address,
    }
    if identity.model is not None:
        message["model"] = identity.model
    if identity.connector is not None:
        message["connector"] = identity.connector
    if identity.geometry is not None:
        message["geometry"] = identity.geometry.as_map()
    if identity.max_model_len is not None:
        message["max_model_len"] = identity.max_model_len
    if load is not None:
        message["load"] = load.as_map()
    if not healthy:
        message["healthy"] = False
    return message


def leave_message(identity: WorkerIdentity) -> dict[str, Any]:
    return {
        "v": 1,
        "op": "leave",
        "type": identity.role.wire,
        "http_address": identity.http_address,
        "zmq_address": identity.zmq_address,
    }


def v0_message(identity: WorkerIdentity) -> dict[str, Any]:
    """Byte for byte what stock vLLM's P2pNcclEngine sends."""
    return {
        "type": identity.role.wire,
        "http_address": identity.http_address,
        "zmq_address": identity.zmq_address,
    }


@dataclass(frozen=True, slots=True)
class TransferStat:
    """One rank's view of one KV transfer: a P rank what it sent, a D rank what it received."""

    transfer_id: str  # "<32 hex uid of the request-id tag>-<suffix>": the same on P and D
    peer: str  # the other instance: its http address, or its zmq address (as in the tag)
    bytes: int
    blocks: int
    seconds: float
    outcome: TransferOutcome = "ok"

    def as_map(self) -> dict[str, Any]:
        return {
            "id": self.transfer_id,
            "peer": self.peer,
            "bytes": self.bytes,
            "blocks": self.blocks,
            "seconds": float(self.seconds),
            "outcome": self.outcome,
        }


def stats_message(
    role: Role,
    http_address: str,
    rank: int,
    ranks: int,
    transfers: Sequence[TransferStat],
) -> dict[str, Any]:
    """What TP rank `rank` of `ranks` of an instance reports of its transfers. Raises
    ValueError on what the registry would refuse whatever the entries say."""
    if not 1 <= ranks <= MAX_TP_SIZE or not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} of {ranks}: need 0 <= rank < ranks <= {MAX_TP_SIZE}")
    if len(transfers) > MAX_TRANSFERS:
        raise ValueError(f"{len(transfers)} transfers in one message (at most {MAX_TRANSFERS})")
    return {
        "v": 1,
        "op": "stats",
        "type": role.wire,
        "http_address": http_address,
        "rank": rank,
        "ranks": ranks,
        "transfers": [transfer.as_map() for transfer in transfers],
    }
