"""The registry's wire schema (DESIGN.md section 3), both ways: `parse_message` decodes and
validates a frame's map, `to_map` builds one (the announcer, the stats reporter and the fake
worker send what it builds, so both sides share one schema). Pure; imports only msgpack and
pdproxy's base types, because the vLLM side loads it inside vLLM.

v0 is exactly what stock vLLM's P2pNcclEngine sends; v1 is pdproxy's superset (announce, leave,
and stats: what each TP rank reports of its KV transfers). Anything else is rejected with one
of a small, fixed set of reasons, so a metric labelled by reason stays bounded whatever a
hostile sender writes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import StrEnum
from types import MappingProxyType
from typing import Any

import msgpack

from pdproxy.base.roles import Role
from pdproxy.ids import Address, AddressError, parse_address


class Connector(StrEnum):
    P2P_NCCL = "p2p_nccl"
    NIXL = "nixl"  # vLLM's NixlConnector (= NixlPullConnector): the decode reads the KV
    PDPROXY = "pdproxy"
    MOONCAKE = "mooncake"  # vLLM's MooncakeConnector: the decode asks the prefill's bootstrap
    NIXL_PUSH = "nixl_push"  # vLLM's NixlPushConnector: the prefill writes into the decode


class Reason(StrEnum):
    """Why a frame was rejected. Fixed set: it labels a metric."""

    NOT_MSGPACK = "not_msgpack"
    FRAMING = "framing"
    NOT_A_MAP = "not_a_map"
    MISSING_FIELD = "missing_field"
    WRONG_TYPE = "wrong_type"
    UNKNOWN_TYPE = "unknown_type"
    UNKNOWN_OP = "unknown_op"
    UNKNOWN_CONNECTOR = "unknown_connector"
    UNSUPPORTED_VERSION = "unsupported_version"
    BAD_ADDRESS = "bad_address"
    BAD_GEOMETRY = "bad_geometry"
    BAD_LOAD = "bad_load"
    CAPACITY = "capacity"
    STATIC_CONFLICT = "static_conflict"
    # Kubernetes discovery: another role or KV address than the pod's, or a pod just deleted.
    DISCOVERY_CONFLICT = "discovery_conflict"
    # Authentication and admission (pdproxy.registry.auth).
    UNSIGNED = "unsigned"
    BAD_SIGNATURE = "bad_signature"
    STALE = "stale"
    REPLAYED = "replayed"
    FORBIDDEN_ADDRESS = "forbidden_address"
    TOO_LARGE = "too_large"  # with a secret: more bytes or fields than its kind may have unsigned
    # The table's protection of signed instances (with a secret).
    SIGNED_INSTANCE = "signed_instance"  # an unsigned message for a signed instance
    UNSIGNED_CAPACITY = "unsigned_capacity"  # the unsigned (v0) instances are at their own cap
    # KV transfer statistics (the "stats" op).
    BAD_STATS = "bad_stats"  # rank, ranks or the transfers list
    BAD_TRANSFER = "bad_transfer"  # one entry of the transfers list
    UNKNOWN_INSTANCE = "unknown_instance"  # the sender is not registered in that role


class TransferOutcome(StrEnum):
    """How one rank's part of a KV transfer ended (the "stats" op)."""

    OK = "ok"
    TIMEOUT = "timeout"
    ERROR = "error"
    MISSING = "missing"
    DROPPED = "dropped"


class Rejected(ValueError):
    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Geometry:
    """KV-cache geometry an instance announced; every field optional (unknown if None)."""

    tp_size: int | None = None
    block_size: int | None = None
    num_layers: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    kv_dtype: str | None = None
    is_mla: bool | None = None
    kv_layout: str | None = None


@dataclass(frozen=True, slots=True)
class Load:
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    # A prefill's work: the prompt tokens it has queued or is computing, less what it already
    # held cached. pdproxy's connector counts it; vLLM's /metrics has no such figure.
    prefill_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class KvCoordinates:
    """Where a prefill's connector is reached, for the flows whose decode leg must name it
    before the prefill answered: mooncake's bootstrap server (VLLM_MOONCAKE_BOOTSTRAP_PORT),
    and NIXL push's engine id and side channel (VLLM_NIXL_SIDE_CHANNEL_HOST/PORT)."""

    bootstrap: Address | None = None
    engine_id: str | None = None
    side_channel: Address | None = None


# What a prefill of each kind must announce (or declare) for its flow to be routable.
REQUIRED_COORDINATES: Mapping[Connector, tuple[str, ...]] = MappingProxyType(
    {
        Connector.MOONCAKE: ("bootstrap",),
        Connector.NIXL_PUSH: ("engine_id", "side_channel"),
    }
)


def missing_coordinates(connector: Connector | None, coordinates: KvCoordinates | None) -> str:
    """The coordinates a prefill of `connector` lacks, comma-separated ("" if none)."""
    wanted = REQUIRED_COORDINATES.get(connector) if connector is not None else None
    if not wanted:
        return ""
    have = coordinates or KvCoordinates()
    return ", ".join(name for name in wanted if getattr(have, name) is None)


@dataclass(frozen=True, slots=True)
class Announcement:
    version: int  # 0 (stock vLLM) or 1 (pdproxy)
    role: Role
    http_address: Address
    zmq_address: Address
    model: str | None = None
    connector: Connector | None = None
    geometry: Geometry | None = None
    load: Load | None = None
    # False when the worker's sidecar cannot reach its server: keep it known, route nothing.
    healthy: bool = True
    # The model's context length as the instance runs it (vLLM's max_model_len), if told.
    max_model_len: int | None = None
    coordinates: KvCoordinates | None = None  # mooncake and nixl_push prefills


@dataclass(frozen=True, slots=True)
class Leave:
    http_address: Address


@dataclass(frozen=True, slots=True)
class TransferReport:
    """One rank's view of one KV transfer: a P rank what it sent, a D rank what it received."""

    transfer_id: str  # "<32 hex uid of the request-id tag>-<suffix>"
    peer: Address  # the other instance (its http address, or its zmq address: see the docs)
    bytes: int
    blocks: int
    seconds: float
    outcome: TransferOutcome


@dataclass(frozen=True, slots=True)
class Stats:
    """A "stats" message: what one TP rank of an instance reports after transfers."""

    role: Role
    http_address: Address  # the reporting instance
    rank: int
    ranks: int  # the instance's TP size: a transfer's side is complete when all reported
    transfers: tuple[TransferReport, ...]


Message = Announcement | Leave | Stats

MAX_MODEL_NAME = 256
# Upper bounds of the integer geometry fields, each far above any real model or deployment
# (the largest have ~128 layers and KV heads, head_dim 576 with MLA, TP 64, blocks of a few
# hundred tokens). They keep what pairing derives from an announcement cheap and finite: a
# pair's rank map has one entry per decode rank, so a tp_size of 2**40 once stalled the event
# loop (and /health with it); and KV bytes per block, 2 x layers x max(heads, tp) x head_dim x
# 4-byte dtype x block_size, stays below 2**63, which JSON (orjson) can carry.
MAX_TP_SIZE = 1024
GEOMETRY_LIMITS: Mapping[str, int] = MappingProxyType(
    {
        "tp_size": MAX_TP_SIZE,
        "block_size": 65536,
        "num_layers": 4096,
        "num_kv_heads": 4096,
        "head_dim": 16384,
    }
)
_KV_LAYOUTS = ("NHD", "HND")
MAX_DTYPE_NAME = 32
MAX_ENGINE_ID = 128  # vLLM's are uuid4 strings
# The "stats" op: at most this many transfers per message (a rank batches its reports), and
# per transfer counts at most 2**53, exact as a float (a metric's value).
MAX_TRANSFERS = 256
MAX_TRANSFER_COUNT = 2**53
# Far above any real context (a few million tokens at most), far below anything that would
# make arithmetic on it costly.
MAX_MODEL_LEN = 2**32
TRANSFER_ID = re.compile(r"[0-9a-f]{32}-[A-Za-z0-9_.-]{0,63}", re.ASCII)


def decode_frame(frame: bytes) -> Message:
    """Decode one registry frame or raise Rejected."""
    return parse_message(unpack_frame(frame))


def unpack_frame(frame: bytes) -> object:
    """The frame's msgpack value, not yet validated (the verifier needs it whole)."""
    try:
        return msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises many unrelated types on garbage
        raise Rejected(Reason.NOT_MSGPACK, type(exc).__name__) from None


def parse_message(payload: object) -> Message:
    if not isinstance(payload, dict):
        raise Rejected(Reason.NOT_A_MAP, f"expected a map, got {type(payload).__name__}")
    version = message_version(payload.get("v", 0))
    if version == 0:
        return _announcement(payload, version=0)
    op = payload.get("op", "announce")
    if op == "announce":
        return _announcement(payload, version=1)
    if op == "leave":
        return Leave(_address(payload, "http_address"))
    if op == "stats":
        return _stats(payload)
    raise Rejected(Reason.UNKNOWN_OP, f"unknown op {_short(op)}")


def message_version(value: object) -> int:
    """0 or 1, from the "v" field's value (0 when there is none), or Rejected."""
    if not _is_int(value) or value not in (0, 1):
        raise Rejected(Reason.UNSUPPORTED_VERSION, f"unsupported v={_short(value)}")
    assert isinstance(value, int)
    return value


def _role(payload: dict[Any, Any]) -> Role:
    role_value = _required_str(payload, "type")
    try:
        return Role.from_wire(role_value)
    except ValueError:
        raise Rejected(
            Reason.UNKNOWN_TYPE, f"type must be 'P' or 'D', got {_short(role_value)}"
        ) from None


def _announcement(payload: dict[Any, Any], version: int) -> Announcement:
    role = _role(payload)
    http_address = _address(payload, "http_address")
    zmq_address = _address(payload, "zmq_address")
    if version == 0:
        return Announcement(0, role, http_address, zmq_address)
    connector = _connector(payload.get("connector"))
    coordinates = _coordinates(payload.get("kv_coordinates"))
    missing = missing_coordinates(connector, coordinates) if role is Role.PREFILL else ""
    if missing:
        assert connector is not None
        raise Rejected(
            Reason.MISSING_FIELD,
            f"a {connector.value} prefill must announce kv_coordinates {missing}",
        )
    return Announcement(
        version=1,
        role=role,
        http_address=http_address,
        zmq_address=zmq_address,
        model=_model(payload.get("model")),
        connector=connector,
        geometry=_geometry(payload.get("geometry")),
        load=_load(payload.get("load")),
        healthy=_healthy(payload.get("healthy", True)),
        max_model_len=_max_model_len(payload.get("max_model_len")),
        coordinates=coordinates,
    )


def _required_str(payload: dict[Any, Any], key: str) -> str:
    if key not in payload:
        raise Rejected(Reason.MISSING_FIELD, f"missing field {key!r}")
    value = payload[key]
    if not isinstance(value, str):
        raise Rejected(Reason.WRONG_TYPE, f"{key!r} must be a string, got {type(value).__name__}")
    return value


def _address(payload: dict[Any, Any], key: str) -> Address:
    text = _required_str(payload, key)
    try:
        return parse_address(text)
    except AddressError as exc:
        raise Rejected(Reason.BAD_ADDRESS, f"{key} {_short(text)}: {exc}") from None


def _model(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_MODEL_NAME:
        raise Rejected(Reason.WRONG_TYPE, "'model' must be a non-empty string (<= 256 chars)")
    return value


def _max_model_len(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_MODEL_LEN:
        raise Rejected(Reason.WRONG_TYPE, "'max_model_len' must be an integer in 1..2**32")
    return value


def _connector(value: object) -> Connector | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise Rejected(Reason.WRONG_TYPE, "'connector' must be a string")
    try:
        return Connector(value)
    except ValueError:
        raise Rejected(Reason.UNKNOWN_CONNECTOR, f"unknown connector {_short(value)}") from None


def _coordinates(value: object) -> KvCoordinates | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise Rejected(Reason.WRONG_TYPE, "'kv_coordinates' must be a map")
    addresses: dict[str, Address] = {}
    for key in ("bootstrap", "side_channel"):
        if value.get(key) is not None:
            addresses[key] = _address(value, key)
    engine_id = value.get("engine_id")
    if engine_id is not None and (
        not isinstance(engine_id, str)
        or not engine_id
        or len(engine_id) > MAX_ENGINE_ID
        or not engine_id.isprintable()
    ):
        raise Rejected(
            Reason.WRONG_TYPE,
            f"kv_coordinates.engine_id must be a printable string of 1..{MAX_ENGINE_ID} chars",
        )
    return KvCoordinates(engine_id=engine_id, **addresses)


def parse_geometry(value: object) -> Geometry | None:
    """A geometry map as the v1 announcement carries it (None: unknown); Rejected
    (BAD_GEOMETRY) if malformed. Kubernetes discovery reads a pod's annotation with it too."""
    return _geometry(value)


def _geometry(value: object) -> Geometry | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise Rejected(Reason.BAD_GEOMETRY, "'geometry' must be a map")
    fields: dict[str, Any] = {}
    for key, limit in GEOMETRY_LIMITS.items():
        item = value.get(key)
        if item is None:
            continue
        if not _is_int(item) or not 1 <= item <= limit:
            raise Rejected(Reason.BAD_GEOMETRY, f"geometry.{key} must be an integer in 1..{limit}")
        fields[key] = item
    dtype = value.get("kv_dtype")
    if dtype is not None:
        if not isinstance(dtype, str) or not dtype or len(dtype) > MAX_DTYPE_NAME:
            raise Rejected(Reason.BAD_GEOMETRY, "geometry.kv_dtype must be a short string")
        fields["kv_dtype"] = dtype
    is_mla = value.get("is_mla")
    if is_mla is not None:
        if not isinstance(is_mla, bool):
            raise Rejected(Reason.BAD_GEOMETRY, "geometry.is_mla must be a boolean")
        fields["is_mla"] = is_mla
    layout = value.get("kv_layout")
    if layout is not None:
        if layout not in _KV_LAYOUTS:
            raise Rejected(Reason.BAD_GEOMETRY, "geometry.kv_layout must be 'NHD' or 'HND'")
        fields["kv_layout"] = layout
    return Geometry(**fields)


def _healthy(value: object) -> bool:
    if not isinstance(value, bool):
        raise Rejected(Reason.WRONG_TYPE, "'healthy' must be a boolean")
    return value


def _load(value: object) -> Load | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise Rejected(Reason.BAD_LOAD, "'load' must be a map")
    counts: dict[str, int] = {}
    for key in ("running", "waiting", "prefill_tokens"):
        item = value.get(key)
        if item is None:
            continue
        if not _is_int(item) or item < 0:
            raise Rejected(Reason.BAD_LOAD, f"load.{key} must be a non-negative integer")
        counts[key] = item
    usage = value.get("kv_usage")
    if usage is not None and (
        isinstance(usage, bool)
        or not isinstance(usage, int | float)
        or not math.isfinite(usage)
        or not 0.0 <= usage <= 1.0
    ):
        raise Rejected(Reason.BAD_LOAD, "load.kv_usage must be a number in [0, 1]")
    return Load(
        running=counts.get("running"),
        waiting=counts.get("waiting"),
        kv_usage=None if usage is None else float(usage),
        prefill_tokens=counts.get("prefill_tokens"),
    )


def _stats(payload: dict[Any, Any]) -> Stats:
    role = _role(payload)
    http_address = _address(payload, "http_address")
    for key in ("rank", "ranks", "transfers"):
        if key not in payload:
            raise Rejected(Reason.MISSING_FIELD, f"missing field {key!r}")
    ranks, rank = payload["ranks"], payload["rank"]
    if not _is_int(ranks) or not 1 <= ranks <= MAX_TP_SIZE:
        raise Rejected(Reason.BAD_STATS, f"'ranks' must be an integer in 1..{MAX_TP_SIZE}")
    if not _is_int(rank) or not 0 <= rank < ranks:
        raise Rejected(Reason.BAD_STATS, "'rank' must be an integer in 0..ranks-1")
    items = payload["transfers"]
    if not isinstance(items, list) or len(items) > MAX_TRANSFERS:
        raise Rejected(Reason.BAD_STATS, f"'transfers' must be a list of at most {MAX_TRANSFERS}")
    transfers = tuple(parse_transfer(item, index) for index, item in enumerate(items))
    return Stats(role, http_address, rank, ranks, transfers)


def parse_transfer(item: object, index: int = 0) -> TransferReport:
    """One entry of a stats message's transfers list, or Rejected (BAD_TRANSFER). Workers
    check their own entries with it before queueing them: one bad entry refuses a message."""

    def bad(what: str) -> Rejected:
        return Rejected(Reason.BAD_TRANSFER, f"transfers[{index}]: {what}")

    if not isinstance(item, dict):
        raise bad("must be a map")
    transfer_id = item.get("id")
    if not isinstance(transfer_id, str) or not TRANSFER_ID.fullmatch(transfer_id):
        raise bad("'id' must be <32 lowercase hex>-<up to 63 of [A-Za-z0-9_.-]>")
    peer = item.get("peer")
    if not isinstance(peer, str):
        raise bad("'peer' must be a 'host:port' string")
    try:
        peer_address = parse_address(peer)
    except AddressError as exc:
        raise bad(f"peer {_short(peer)}: {exc}") from None
    counts: list[int] = []
    for key in ("bytes", "blocks"):
        value = item.get(key)
        if (
            not isinstance(value, int)
            or isinstance(value, bool)
            or not 0 <= value <= MAX_TRANSFER_COUNT
        ):
            raise bad(f"{key!r} must be an integer in 0..2**53")
        counts.append(value)
    seconds = item.get("seconds")
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not math.isfinite(seconds)
        or seconds < 0
    ):
        raise bad("'seconds' must be a finite number >= 0")
    outcome = item.get("outcome")
    if not isinstance(outcome, str) or outcome not in _OUTCOMES:
        raise bad(f"'outcome' must be one of {', '.join(_OUTCOMES)}")
    return TransferReport(
        transfer_id, peer_address, counts[0], counts[1], float(seconds), TransferOutcome(outcome)
    )


_OUTCOMES = tuple(outcome.value for outcome in TransferOutcome)


def to_map(message: Message) -> dict[str, Any]:
    """The wire map of `message`: parse_message(to_map(m)) == m for every valid m. A version 0
    announcement is byte for byte what stock vLLM's P2pNcclEngine sends (its other fields are
    not on that wire)."""
    if isinstance(message, Leave):
        return {"v": 1, "op": "leave", "http_address": str(message.http_address)}
    if isinstance(message, Stats):
        return {
            **_sender(1, "stats", message.role, message.http_address),
            "rank": message.rank,
            "ranks": message.ranks,
            "transfers": [transfer_map(transfer) for transfer in message.transfers],
        }
    if message.version == 0:
        return _sender(0, None, message.role, message.http_address, message.zmq_address)
    return _announcement_map(message)


def _sender(
    version: int, op: str | None, role: Role, http_address: Address, zmq: Address | None = None
) -> dict[str, Any]:
    head: dict[str, Any] = {} if version == 0 else {"v": version, "op": op}
    head |= {"type": role.wire, "http_address": str(http_address)}
    if zmq is not None:
        head["zmq_address"] = str(zmq)
    return head


def _announcement_map(announcement: Announcement) -> dict[str, Any]:
    wire = _sender(
        1, "announce", announcement.role, announcement.http_address, announcement.zmq_address
    )
    if announcement.model is not None:
        wire["model"] = announcement.model
    if announcement.connector is not None:
        wire["connector"] = announcement.connector.value
    if announcement.geometry is not None:
        wire["geometry"] = known_fields(announcement.geometry)
    if announcement.max_model_len is not None:
        wire["max_model_len"] = announcement.max_model_len
    if announcement.load is not None:
        wire["load"] = known_fields(announcement.load)
    if not announcement.healthy:
        wire["healthy"] = False
    if announcement.coordinates is not None:
        wire["kv_coordinates"] = {
            name: str(item)
            for name in ("bootstrap", "engine_id", "side_channel")
            if (item := getattr(announcement.coordinates, name)) is not None
        }
    return wire


def transfer_map(transfer: TransferReport) -> dict[str, Any]:
    """One entry of a stats message's transfers list (parse_transfer's input)."""
    return {
        "id": transfer.transfer_id,
        "peer": str(transfer.peer),
        "bytes": transfer.bytes,
        "blocks": transfer.blocks,
        "seconds": float(transfer.seconds),
        "outcome": transfer.outcome.value,
    }


def known_fields(value: Geometry | Load) -> dict[str, Any]:
    """The fields that are known (None is left off the wire)."""
    return {
        name: item
        for name in (field.name for field in fields(value))
        if (item := getattr(value, name)) is not None
    }


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: object, limit: int = 64) -> str:
    # Containers are named, never printed: a hostile frame may nest a thousand levels deep.
    if not isinstance(value, str | bytes | int | float | bool) and value is not None:
        return f"<{type(value).__name__}>"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
