"""Fuzzing the registry's pure path: decoding, admission (auth) and the table.

Frames go through RegistryServer.handle, the very function the live ROUTER loop calls for each
message (decode, admission, table, counting), with its clocks injected and no socket bound.
Hypothesis feeds it raw bytes, garbled frames, msgpack of every shape and near-valid maps
(right keys, hostile values). The properties:

- nothing but Rejected ever leaves the decoder or the verifier, and handle() never raises;
- every message is counted exactly once, as accepted or under one rejection reason;
- whatever the table holds satisfies the registry's invariants and came from an accepted
  message (a rejected one never changes anything);
- with a secret, only correctly signed, fresh, first-seen v1 messages register, and a signed
  message is accepted at most once however often it is sent;
- anything accepted stays cheap and serialisable downstream (pairing, JSON).
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import count
from types import MappingProxyType
from typing import Any

import msgpack
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdproxy.base.roles import Role
from pdproxy.config import Settings
from pdproxy.ids import parse_address, validate_host
from pdproxy.metrics import Metrics
from pdproxy.pairing.geometry import PairPlan, plan_pair, side_of
from pdproxy.pairing.report import verdict_fields
from pdproxy.registry.auth import AUTH_FIELD, Verifier, canonical, signed
from pdproxy.registry.messages import (
    GEOMETRY_LIMITS,
    MAX_DTYPE_NAME,
    MAX_MODEL_NAME,
    MAX_TP_SIZE,
    MAX_TRANSFER_COUNT,
    MAX_TRANSFERS,
    Announcement,
    Connector,
    Leave,
    Message,
    Reason,
    Rejected,
    Stats,
    TransferOutcome,
    decode_frame,
    unpack_frame,
)
from pdproxy.registry.server import RegistryServer
from pdproxy.registry.table import Instance, RegistryTable, Source, instance_from

# Deterministic, no deadline (CI machines are slow and shared), bounded examples: the whole
# file takes about 15 s of CPU.
PROFILE = settings(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

SECRET = "fuzz-registry-secret-0123"
KEY = SECRET.encode()
WALL_NOW = 1_700_000_000.0
MONOTONIC_NOW = 5_000.0
SKEW = 30.0
SENDER = b"fuzzer"
AUTH_REASONS = frozenset({Reason.UNSIGNED, Reason.BAD_SIGNATURE, Reason.STALE, Reason.REPLAYED})
# Few addresses, so a stream of messages keeps hitting the same instances (refresh, update,
# leave, capacity) instead of registering a fresh one each time.
HOSTS = ("10.0.0.1", "10.0.0.2", "worker-a.svc")
PORTS = (8100, 8101, 21001)
ADDRESS_CIDRS = ("10.0.0.0/8",)
V0_CIDRS = ("10.0.0.1/32",)
STATIC_HTTP = "10.0.0.1:8100"  # one of the fuzzed addresses: announcements collide with it
STATIC_ZMQ = "10.0.0.1:21001"


def pack(value: object) -> bytes:
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


# -- the registry under test ------------------------------------------------------------------


@dataclass
class Registry:
    """A RegistryServer that was never started: handle() is the receive loop's per-message
    step, the clocks are fixed so signatures stay fresh."""

    server: RegistryServer
    table: RegistryTable
    metrics: Metrics
    max_instances: int

    def handle(self, parts: list[bytes]) -> str:
        """Feed one ROUTER message; the label it was counted under ("ok" if accepted)."""
        before = self.counted()
        self.server.handle([SENDER, *parts])
        after = self.counted()
        changed = [label for label, value in after.items() if value != before.get(label, 0.0)]
        assert len(changed) == 1, f"counted under {changed}, expected exactly one label"
        assert after[changed[0]] == before.get(changed[0], 0.0) + 1
        return changed[0]

    def counted(self) -> dict[str, float]:
        """pdproxy_registry_messages_total by reason label ("ok" for accepted)."""
        return {
            sample.labels["reason"]: sample.value
            for metric in self.metrics.registry_messages.collect()
            for sample in metric.samples
            if sample.name.endswith("_total")
        }


def make_registry(
    *, secret: bool = False, max_instances: int = 4, with_static: bool = True
) -> Registry:
    options: dict[str, Any] = {"max_instances": max_instances, "ttl": 60.0}
    if secret:
        options.update(
            registry_secret=SECRET,
            registry_allow_unsigned_v0=True,
            registry_v0_cidrs=list(V0_CIDRS),
            registry_address_cidrs=list(ADDRESS_CIDRS),
            registry_max_skew_seconds=SKEW,
        )
    config = Settings(**options)
    table = RegistryTable(config.ttl, config.max_instances)
    if with_static:
        # An operator's instance: announcements may not move or rename it (STATIC_CONFLICT).
        static = Instance(
            Role.PREFILL, parse_address(STATIC_HTTP), parse_address(STATIC_ZMQ), Source.STATIC
        )
        table.add_static(static, MONOTONIC_NOW)
    metrics = Metrics()
    server = RegistryServer(
        config, table, metrics, clock=lambda: MONOTONIC_NOW, wall_clock=lambda: WALL_NOW
    )
    return Registry(server, table, metrics, max_instances)


# -- invariants -------------------------------------------------------------------------------


def assert_valid_message(message: Message) -> None:
    """What the decoder promises of anything it accepts."""
    if isinstance(message, Leave):
        assert_valid_address_parts(message.http_address.host, message.http_address.port)
        return
    if isinstance(message, Stats):
        assert_valid_stats(message)
        return
    assert message.version in (0, 1)
    assert message.role in (Role.PREFILL, Role.DECODE)
    for address in (message.http_address, message.zmq_address):
        assert_valid_address_parts(address.host, address.port)
    assert isinstance(message.healthy, bool)
    if message.version == 0:
        assert (message.model, message.connector, message.geometry, message.load) == (None,) * 4
        assert message.healthy
    if message.model is not None:
        assert type(message.model) is str and 1 <= len(message.model) <= MAX_MODEL_NAME
    assert message.connector is None or isinstance(message.connector, Connector)
    if message.geometry is not None:
        g = message.geometry
        for name, limit in GEOMETRY_LIMITS.items():
            value = getattr(g, name)
            assert value is None or (type(value) is int and 1 <= value <= limit), (name, value)
        assert g.kv_dtype is None or (type(g.kv_dtype) is str and len(g.kv_dtype) >= 1)
        assert g.kv_dtype is None or len(g.kv_dtype) <= MAX_DTYPE_NAME
        assert g.is_mla in (None, True, False)
        assert g.kv_layout in (None, "NHD", "HND")
    if message.load is not None:
        load = message.load
        for value in (load.running, load.waiting):
            assert value is None or (type(value) is int and value >= 0)
        usage = load.kv_usage
        assert usage is None or (type(usage) is float and 0.0 <= usage <= 1.0)


def assert_valid_stats(message: Stats) -> None:
    assert_valid_address_parts(message.http_address.host, message.http_address.port)
    assert type(message.ranks) is int and 0 <= message.rank < message.ranks <= MAX_TP_SIZE
    assert len(message.transfers) <= MAX_TRANSFERS
    for transfer in message.transfers:
        assert_valid_address_parts(transfer.peer.host, transfer.peer.port)
        for number in (transfer.bytes, transfer.blocks):
            assert type(number) is int and 0 <= number <= MAX_TRANSFER_COUNT
        assert type(transfer.seconds) is float and 0 <= transfer.seconds < math.inf
        assert isinstance(transfer.outcome, TransferOutcome)


def assert_valid_address_parts(host: str, port: int) -> None:
    validate_host(host)  # raises AddressError on a host vLLM's request ids cannot carry
    assert type(port) is int and 1 <= port <= 65535


def assert_valid_table(registry: Registry) -> None:
    table = registry.table
    entries = table.registrations()
    assert len(entries) == len(table) <= registry.max_instances
    for role in Role:
        assert table.count(role) == sum(1 for e in entries if e.instance.role is role)
    for entry in entries:
        instance = entry.instance
        assert entry.first_seen <= entry.last_seen
        assert instance.source in (Source.STATIC, Source.V0, Source.V1)
        assert_valid_message(
            Announcement(
                version=0 if instance.source is Source.V0 else 1,
                role=instance.role,
                http_address=instance.http_address,
                zmq_address=instance.zmq_address,
                model=instance.model,
                connector=instance.connector,
                geometry=instance.geometry,
                load=instance.load,
                healthy=instance.healthy,
            )
        )
    snapshot = table.snapshot()
    healthy = [e.instance for e in entries if e.instance.healthy]
    assert set(snapshot.prefills) == {i for i in healthy if i.role is Role.PREFILL}
    assert set(snapshot.decodes) == {i for i in healthy if i.role is Role.DECODE}


def decoded_or_reason(data: bytes) -> Message | Reason:
    try:
        message = decode_frame(data)
    except Rejected as exc:
        assert isinstance(exc.reason, Reason) and exc.detail
        return exc.reason
    return message


# -- strategies -------------------------------------------------------------------------------

HUGE_INTS = st.sampled_from([-(2**63), -1, 0, 2**31, 2**40, 2**63 - 1, 2**64 - 1])
ODD_FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 5e-324, 1e308, 2.0, 0.5])
ODD_TEXT = st.sampled_from(
    [
        "",
        " ",
        "P\x00",
        "D\n",
        "\u202eP",  # right-to-left override
        "P\u0301",  # combining accent
        "\uff30",  # fullwidth P
        "١٢٧.0.0.1:80",  # Arabic-Indic digits in the host
        "10.0.0.1:٨١٠٠",  # ... and in the port ("isdigit" but not ASCII)
        "10.0.0.1:\uff18\uff11\uff10\uff10",  # fullwidth digits
        "\uff57\uff4f\uff52\uff4b\uff45\uff52:8100",
        "10.0.0.1:8100\x00",
        "10.0.0.1:+8100",
        "10.0.0.1:008100",
        "10.0.0.1:-1",
        "10.0.0.1: 8100",
        "10.0.0.1:1e3",
        "[::1]:8100",
        "a__b:1",
        "x" * 254 + ":1",
        "💥:1",
        "bfloat16\u200b",  # zero-width space
    ]
)
OVERLONG_TEXT = st.integers(MAX_MODEL_NAME - 1, 2000).map(lambda n: "m" * n)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    HUGE_INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    ODD_FLOATS,
    st.text(max_size=16),
    ODD_TEXT,
    st.binary(max_size=16),
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8)),
    st.builds(msgpack.Timestamp, st.integers(-(2**40), 2**40), st.integers(0, 999_999_999)),
)
KEYS = st.one_of(
    st.text(max_size=10),
    st.sampled_from(["v", "op", "type", "auth", "geometry", "tp_size", "load"]),
    st.integers(-(2**63), 2**64 - 1),
    st.binary(max_size=4),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=True),
)
JUNK = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(KEYS, inner, max_size=4)),
    max_leaves=12,
)
NASTY = st.one_of(JUNK, HUGE_INTS, ODD_FLOATS, ODD_TEXT, OVERLONG_TEXT)


def plausible_or_nasty(plausible: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    # Mostly plausible, so that maps get deep into validation before one value trips it.
    return st.one_of(plausible, plausible, NASTY)


def geometry_value(name: str) -> st.SearchStrategy[int]:
    limit = GEOMETRY_LIMITS[name]
    return st.one_of(st.integers(1, 16), st.sampled_from([limit - 1, limit, limit + 1]), HUGE_INTS)


ADDRESSES = st.builds(lambda h, p: f"{h}:{p}", st.sampled_from(HOSTS), st.sampled_from(PORTS))
GEOMETRY_MAPS = st.fixed_dictionaries(
    {},
    optional={
        **{name: plausible_or_nasty(geometry_value(name)) for name in GEOMETRY_LIMITS},
        "kv_dtype": plausible_or_nasty(st.sampled_from(["bfloat16", "fp8", "float32"])),
        "is_mla": plausible_or_nasty(st.booleans()),
        "kv_layout": plausible_or_nasty(st.sampled_from(["NHD", "HND"])),
        "sliding_window": JUNK,
    },
)
LOAD_MAPS = st.fixed_dictionaries(
    {},
    optional={
        "running": plausible_or_nasty(st.integers(0, 100)),
        "waiting": plausible_or_nasty(st.integers(0, 100)),
        "kv_usage": plausible_or_nasty(st.floats(0.0, 1.0)),
    },
)
TRANSFER_IDS = st.sampled_from([f"{n:032x}-0" for n in range(3)])
OUTCOMES = st.sampled_from([o.value for o in TransferOutcome])
TRANSFER_MAPS = st.fixed_dictionaries(
    {},
    optional={
        "id": plausible_or_nasty(TRANSFER_IDS),
        "peer": plausible_or_nasty(ADDRESSES),
        "bytes": plausible_or_nasty(st.integers(0, 10**6)),
        "blocks": plausible_or_nasty(st.integers(0, 64)),
        "seconds": plausible_or_nasty(st.floats(0, 10)),
        "outcome": plausible_or_nasty(OUTCOMES),
    },
)
NEAR_VALID_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "v": plausible_or_nasty(st.sampled_from([0, 1, 1, 1])),
        "op": plausible_or_nasty(st.sampled_from(["announce", "announce", "leave", "stats"])),
        "type": plausible_or_nasty(st.sampled_from(["P", "D"])),
        "http_address": plausible_or_nasty(ADDRESSES),
        "zmq_address": plausible_or_nasty(ADDRESSES),
        "model": plausible_or_nasty(st.sampled_from(["m", "other/model-8B"])),
        "connector": plausible_or_nasty(st.sampled_from([c.value for c in Connector])),
        "geometry": plausible_or_nasty(GEOMETRY_MAPS),
        "load": plausible_or_nasty(LOAD_MAPS),
        "healthy": plausible_or_nasty(st.booleans()),
        "stats": JUNK,
        "rank": plausible_or_nasty(st.integers(0, 2)),
        "ranks": plausible_or_nasty(st.integers(1, 2)),
        "transfers": plausible_or_nasty(st.lists(plausible_or_nasty(TRANSFER_MAPS), max_size=3)),
        "auth": JUNK,
    },
)


def with_extras(fields: dict[Any, Any], extras: dict[Any, Any]) -> dict[Any, Any]:
    # Unknown fields first, so the known ones (the interesting part) win a key collision.
    return {**extras, **fields}


def with_required_coordinates(payload: dict[Any, Any]) -> dict[Any, Any]:
    """A v1 mooncake or nixl_push prefill is valid only with where its connector is reached."""
    if payload.get("v") != 1 or payload["type"] != "P":
        return payload
    connector = payload.get("connector")
    if connector == Connector.MOONCAKE.value:
        return {**payload, "kv_coordinates": {"bootstrap": "10.0.0.9:8998"}}
    if connector == Connector.NIXL_PUSH.value:
        coordinates = {"engine_id": "engine-1", "side_channel": "10.0.0.9:5600"}
        return {**payload, "kv_coordinates": coordinates}
    return payload


NEAR_VALID = st.builds(with_extras, NEAR_VALID_FIELDS, st.dictionaries(KEYS, JUNK, max_size=3))
VALID_MESSAGES = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["P", "D"]),
        "http_address": ADDRESSES,
        "zmq_address": ADDRESSES,
    },
    optional={
        "v": st.just(1),
        "model": st.sampled_from(["m", "other/model-8B"]),
        "connector": st.sampled_from([c.value for c in Connector]),
        "geometry": st.fixed_dictionaries(
            {}, optional={"tp_size": st.integers(1, 8), "kv_layout": st.just("HND")}
        ),
        "load": st.fixed_dictionaries({}, optional={"running": st.integers(0, 5)}),
        "healthy": st.booleans(),
    },
).map(with_required_coordinates)
LEAVES = st.fixed_dictionaries({"v": st.just(1), "op": st.just("leave"), "http_address": ADDRESSES})
STATS = st.fixed_dictionaries(
    {
        "v": st.just(1),
        "op": st.just("stats"),
        "type": st.sampled_from(["P", "D"]),
        "http_address": ADDRESSES,
        "rank": st.just(0),
        "ranks": st.just(1),
        "transfers": st.lists(
            st.fixed_dictionaries(
                {
                    "id": TRANSFER_IDS,
                    "peer": ADDRESSES,
                    "bytes": st.integers(0, 10**6),
                    "blocks": st.integers(0, 64),
                    "seconds": st.floats(0, 10),
                    "outcome": OUTCOMES,
                }
            ),
            max_size=3,
        ),
    }
)

EDIT_KINDS = ("truncate", "overwrite", "insert", "delete")
EDITS = st.lists(
    st.tuples(st.sampled_from(EDIT_KINDS), st.integers(0, 4096), st.binary(min_size=1, max_size=6)),
    min_size=1,
    max_size=4,
)


def garble(frame: bytes, edits: list[tuple[str, int, bytes]]) -> bytes:
    """`frame` with byte-level damage: cut short, overwritten, spliced or punched through."""
    data = bytearray(frame)
    for kind, position, junk in edits:
        at = position % (len(data) + 1)
        if kind == "truncate":
            del data[at:]
        elif kind == "overwrite":
            data[at : at + len(junk)] = junk
        elif kind == "insert":
            data[at:at] = junk
        else:
            del data[at : at + len(junk)]
    return bytes(data)


GARBLED = st.builds(garble, st.one_of(VALID_MESSAGES, NEAR_VALID).map(pack), EDITS)
SINGLE_FRAMES = st.one_of(
    NEAR_VALID.map(pack),
    VALID_MESSAGES.map(pack),
    LEAVES.map(pack),
    STATS.map(pack),
    GARBLED,
    st.binary(max_size=512),
    JUNK.map(pack),
)
# A ROUTER message is [identity, payload]: anything but one payload frame is FRAMING.
MESSAGES = st.one_of(
    SINGLE_FRAMES.map(lambda frame: [frame]),
    SINGLE_FRAMES.map(lambda frame: [frame]),
    st.lists(st.binary(), max_size=0),  # no payload frame at all
    st.lists(SINGLE_FRAMES, min_size=2, max_size=5),
)


# -- the decoder alone ------------------------------------------------------------------------


@settings(PROFILE, max_examples=300)
@given(data=st.binary(max_size=2048))
def test_random_bytes_only_reject(data: bytes) -> None:
    result = decoded_or_reason(data)
    if not isinstance(result, Reason):
        assert_valid_message(result)


@settings(PROFILE, max_examples=200)
@given(data=GARBLED)
def test_garbled_frames_only_reject(data: bytes) -> None:
    result = decoded_or_reason(data)
    if not isinstance(result, Reason):
        assert_valid_message(result)


@settings(PROFILE, max_examples=250)
@given(payload=NEAR_VALID)
def test_near_valid_maps_decode_to_valid_messages_or_reject(payload: dict[Any, Any]) -> None:
    result = decoded_or_reason(pack(payload))
    if isinstance(result, Reason):
        assert result not in AUTH_REASONS | {Reason.FRAMING, Reason.CAPACITY}
        return
    assert_valid_message(result)


@settings(PROFILE, max_examples=150)
@given(value=JUNK)
def test_any_msgpack_value_only_rejects(value: object) -> None:
    result = decoded_or_reason(pack(value))
    if not isinstance(result, Reason):
        assert_valid_message(result)


# -- the whole per-message path: decode, admission, table, counting -------------------------


def accepted_instance(parts: list[bytes]) -> Instance | None:
    """The instance an accepted message announced (None for a leave)."""
    message = decode_frame(parts[0])
    return instance_from(message) if isinstance(message, Announcement) else None


@settings(PROFILE, max_examples=80)
@given(stream=st.lists(MESSAGES, max_size=25))
def test_a_stream_of_messages_keeps_the_table_valid(stream: list[list[bytes]]) -> None:
    registry = make_registry()
    announced: set[Instance] = set()
    for parts in stream:
        label = registry.handle(parts)
        if label == "ok":
            assert len(parts) == 1
            instance = accepted_instance(parts)
            if instance is not None:
                announced.add(instance)
        elif len(parts) != 1:
            assert label == Reason.FRAMING.value
        assert_valid_table(registry)
    # Nothing in the table came from a rejected message: every non-static entry is exactly
    # what an accepted announcement said (a v0 echo keeps the v1 announcement's content).
    for entry in registry.table.registrations():
        if entry.instance.source is not Source.STATIC:
            assert entry.instance in announced
    assert sum(registry.counted().values()) == len(stream)


@settings(PROFILE, max_examples=50)
@given(stream=st.lists(MESSAGES, min_size=1, max_size=25))
def test_the_live_defaults_never_raise_and_count_everything(stream: list[list[bytes]]) -> None:
    # Defaults of `pdproxy serve` (no static instance, the default cap): only handle() itself.
    registry = make_registry(max_instances=4096, with_static=False)
    labels = [registry.handle(parts) for parts in stream]
    assert len(labels) == len(stream)
    assert set(labels) <= {"ok"} | {reason.value for reason in Reason}
    assert_valid_table(registry)


# -- with a registry secret -------------------------------------------------------------------


@dataclass
class Nonces:
    """Fresh nonces for one example (never shared between examples)."""

    counter: Iterator[int] = field(default_factory=count)

    def __call__(self) -> str:
        return f"{next(self.counter):032x}"


def sign(payload: dict[Any, Any], nonce: str, offset: float = 0.0) -> dict[Any, Any]:
    return signed(payload, KEY, WALL_NOW + offset, nonce)


Tamper = Callable[[dict[Any, Any], Nonces], dict[Any, Any]]


def tamper_mac(message: dict[Any, Any], _nonces: Nonces) -> dict[Any, Any]:
    return {**message, AUTH_FIELD: {**message[AUTH_FIELD], "mac": "0" * 64}}


def tamper_body(message: dict[Any, Any], _nonces: Nonces) -> dict[Any, Any]:
    return {**message, "model": f"{message.get('model')!s}-forged"}


def tamper_secret(message: dict[Any, Any], nonces: Nonces) -> dict[Any, Any]:
    return signed(message, b"not-the-registry-secret", WALL_NOW, nonces())


def tamper_stale(message: dict[Any, Any], nonces: Nonces) -> dict[Any, Any]:
    return sign(message, nonces(), offset=-(SKEW + 1))


def tamper_future(message: dict[Any, Any], nonces: Nonces) -> dict[Any, Any]:
    return sign(message, nonces(), offset=1e9)


def strip_auth(message: dict[Any, Any], _nonces: Nonces) -> dict[Any, Any]:
    return {key: value for key, value in message.items() if key != AUTH_FIELD}


# How each way of sending a signed message goes wrong, and the reason it must be refused with
# when the message itself decodes (decoding comes first; a v0 map never needs a signature).
TAMPERINGS: tuple[tuple[Tamper, Reason], ...] = (
    (tamper_mac, Reason.BAD_SIGNATURE),
    (tamper_body, Reason.BAD_SIGNATURE),
    (tamper_secret, Reason.BAD_SIGNATURE),
    (tamper_stale, Reason.STALE),
    (tamper_future, Reason.STALE),
    (strip_auth, Reason.UNSIGNED),
)


def spends_a_nonce(decoded: Message | Reason) -> bool:
    """Whether the verifier judges this message (v1 announce or leave; never v0)."""
    if isinstance(decoded, Leave | Stats):
        return True
    return isinstance(decoded, Announcement) and decoded.version == 1


def in_networks(host: str, cidrs: tuple[str, ...]) -> bool:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return any(ip in ipaddress.ip_network(cidr) for cidr in cidrs)


@settings(PROFILE, max_examples=120)
@given(payload=st.one_of(NEAR_VALID, VALID_MESSAGES), resends=st.integers(1, 4))
def test_a_signed_message_is_accepted_at_most_once(payload: dict[Any, Any], resends: int) -> None:
    registry = make_registry(secret=True)
    frame = pack(sign(payload, Nonces()()))
    first = registry.handle([frame])
    again = [registry.handle([frame]) for _ in range(resends)]
    if spends_a_nonce(decoded_or_reason(frame)):
        # Signer and verifier agree on the canonical form of whatever the map holds, so a
        # correctly signed v1 message always passes the verifier, and only once: later copies
        # are replays (even when the first was refused after it: networks, capacity...).
        assert first not in {reason.value for reason in AUTH_REASONS}
        assert again == [Reason.REPLAYED.value] * resends
    else:  # undecodable, or v0 (unsigned by nature): every copy fares the same
        assert again == [first] * resends
    assert_valid_table(registry)


@settings(PROFILE, max_examples=150)
@given(payload=VALID_MESSAGES, tampering=st.sampled_from(TAMPERINGS))
def test_a_tampered_signed_message_never_registers(
    payload: dict[Any, Any], tampering: tuple[Tamper, Reason]
) -> None:
    registry = make_registry(secret=True, with_static=False)
    nonces = Nonces()
    tamper, reason = tampering
    label = registry.handle([pack(tamper(sign(payload, nonces()), nonces))])
    if spends_a_nonce(decoded_or_reason(pack(payload))):
        assert label == reason.value
        assert len(registry.table) == 0
    else:  # v0 is unsigned by nature: the gate judges it by its networks alone
        assert label in {"ok", Reason.FORBIDDEN_ADDRESS.value}


def signed_if_a_map(parts: list[bytes], nonces: Nonces) -> list[bytes]:
    """The message with its one payload signed, when that payload is a map at all."""
    if len(parts) != 1:
        return parts
    try:
        payload = unpack_frame(parts[0])
    except Rejected:
        return parts
    return [pack(sign(payload, nonces()))] if isinstance(payload, dict) else parts


@settings(PROFILE, max_examples=80)
@given(stream=st.lists(st.tuples(MESSAGES, st.booleans()), max_size=20))
def test_with_a_secret_only_signed_v1_or_v0_from_its_networks_registers(
    stream: list[tuple[list[bytes], bool]],
) -> None:
    registry = make_registry(secret=True, with_static=False)
    nonces = Nonces()
    signed_instances: set[Instance] = set()
    for parts, signing in stream:
        sent = signed_if_a_map(parts, nonces) if signing else parts
        if registry.handle(sent) != "ok":
            continue
        instance = accepted_instance(sent)
        if instance is not None and instance.source is Source.V1:
            payload = unpack_frame(sent[0])
            assert isinstance(payload, dict) and AUTH_FIELD in payload
            signed_instances.add(instance)
    assert_valid_table(registry)
    for entry in registry.table.registrations():
        instance = entry.instance
        for address in (instance.http_address, instance.zmq_address):
            assert in_networks(address.host, ADDRESS_CIDRS)
            if instance.source is Source.V0:
                assert in_networks(address.host, V0_CIDRS)
        if instance.source is Source.V1:
            assert instance in signed_instances


AUTH_MAPS = st.fixed_dictionaries(
    {},
    optional={
        "ts": st.one_of(JUNK, st.just(WALL_NOW)),
        "nonce": st.one_of(JUNK, st.just("0" * 32)),
        "mac": st.one_of(JUNK, st.just("0" * 64)),
    },
)


@settings(PROFILE, max_examples=150)
@given(payload=NEAR_VALID, auth=st.one_of(JUNK, AUTH_MAPS))
def test_the_verifier_only_rejects_with_auth_reasons(payload: dict[Any, Any], auth: Any) -> None:
    verifier = Verifier(KEY, max_skew_s=SKEW)
    message = {**payload, AUTH_FIELD: auth}
    with pytest.raises(Rejected) as info:
        verifier.verify(message, WALL_NOW)
    assert info.value.reason in AUTH_REASONS
    assert verifier.remembered == 0  # a refused message spends no nonce


@settings(PROFILE, max_examples=100)
@given(value=st.dictionaries(KEYS, JUNK, max_size=6))
def test_canonical_is_total_and_order_free(value: dict[Any, Any]) -> None:
    """Signing covers whatever a hostile map holds (ext types, NaN keys, odd nesting), and
    does not depend on the order the keys arrived in."""
    forward = canonical(value)
    assert canonical(dict(reversed(list(value.items())))) == forward


# -- what is accepted stays cheap and serialisable downstream ---------------------------------


def announce(role: str, port: int, geometry: dict[str, Any], connector: str) -> dict[str, Any]:
    return {
        "v": 1,
        "type": role,
        "http_address": f"10.0.0.1:{port}",
        "zmq_address": f"10.0.0.1:{port + 1000}",
        "model": "m",
        "connector": connector,
        "geometry": geometry,
    }


def accepted_geometry_value(name: str) -> st.SearchStrategy[int]:
    """Values the decoder accepts, the largest included (the limits are powers of two, so
    these divide each other as TP sizes and head counts must)."""
    limit = GEOMETRY_LIMITS[name]
    return st.one_of(st.integers(1, 16), st.sampled_from([limit // 4, limit // 2, limit]))


# What belongs to the model (both sides agree on it, as they must to pair) and what belongs to
# each deployment: many generated pairs are compatible, so planning builds the full rank map.
MODEL_GEOMETRY = st.fixed_dictionaries(
    {
        "num_layers": accepted_geometry_value("num_layers"),
        "num_kv_heads": accepted_geometry_value("num_kv_heads"),
        "head_dim": accepted_geometry_value("head_dim"),
        "kv_dtype": st.sampled_from(["float32", "bfloat16", "fp8"]),
        "is_mla": st.booleans(),
        "kv_layout": st.just("HND"),
    }
)
DEPLOYMENT_GEOMETRY = st.fixed_dictionaries(
    {
        "tp_size": accepted_geometry_value("tp_size"),
        "block_size": accepted_geometry_value("block_size"),
    }
)


def plan_and_render(prefill: dict[str, Any], decode: dict[str, Any]) -> dict[str, Any] | None:
    """What /v1/instances/pairs computes for this pair, or None if either is refused."""
    messages = [decoded_or_reason(pack(m)) for m in (prefill, decode)]
    if not all(isinstance(m, Announcement) for m in messages):
        return None
    sides = [side_of(instance_from(m)) for m in messages if isinstance(m, Announcement)]
    verdict = plan_pair(sides[0], sides[1])
    if isinstance(verdict, PairPlan):
        # A pair's rank map has one entry per decode rank: bounded by the TP limit.
        assert len(verdict.reads) == verdict.decode.tp_size <= MAX_TP_SIZE
    fields = verdict_fields(verdict)
    orjson.dumps(fields)  # raises on integers JSON cannot carry (beyond 64 bits)
    return fields


@settings(PROFILE, max_examples=300)
@given(
    model=MODEL_GEOMETRY,
    prefill=DEPLOYMENT_GEOMETRY,
    decode=DEPLOYMENT_GEOMETRY,
    connector=st.sampled_from(["nixl", "p2p_nccl"]),
)
def test_accepted_geometry_plans_cheaply_and_serialises(
    model: dict[str, Any], prefill: dict[str, Any], decode: dict[str, Any], connector: str
) -> None:
    plan_and_render(
        announce("P", 8100, {**model, **prefill}, connector),
        announce("D", 8200, {**model, **decode}, connector),
    )


# -- regressions found by fuzzing -------------------------------------------------------------

# Every field at its limit, the widest dtype: the largest numbers pairing can derive.
WORST_GEOMETRY = MappingProxyType(
    {
        "block_size": GEOMETRY_LIMITS["block_size"],
        "num_layers": GEOMETRY_LIMITS["num_layers"],
        "num_kv_heads": GEOMETRY_LIMITS["num_kv_heads"],
        "head_dim": GEOMETRY_LIMITS["head_dim"],
        "kv_dtype": "float32",
        "is_mla": False,
        "kv_layout": "HND",
    }
)


def test_the_tp_size_that_stalled_the_proxy_is_refused() -> None:
    # One unauthenticated announcement of a decode with tp_size 2**40 pairing with an ordinary
    # prefill made planning build a 2**40-entry rank map: /ready, routing and /health hung.
    decode = announce("D", 8200, {**WORST_GEOMETRY, "tp_size": 2**40}, "nixl")
    assert decoded_or_reason(pack(decode)) is Reason.BAD_GEOMETRY


def test_the_geometry_that_broke_the_pairs_listing_is_refused() -> None:
    # 2**64 - 1 layers and head_dim made KV bytes per token exceed 64 bits: orjson refused
    # them and /v1/instances/pairs answered 500.
    huge = {**WORST_GEOMETRY, "tp_size": 1, "num_layers": 2**64 - 1, "head_dim": 2**64 - 1}
    assert decoded_or_reason(pack(announce("P", 8100, huge, "nixl"))) is Reason.BAD_GEOMETRY


@pytest.mark.parametrize("name", sorted(GEOMETRY_LIMITS))
def test_each_geometry_limit_is_inclusive(name: str) -> None:
    limit = GEOMETRY_LIMITS[name]
    at_limit = decoded_or_reason(pack(announce("P", 8100, {name: limit}, "nixl")))
    assert isinstance(at_limit, Announcement) and at_limit.geometry is not None
    assert getattr(at_limit.geometry, name) == limit
    beyond = decoded_or_reason(pack(announce("P", 8100, {name: limit + 1}, "nixl")))
    assert beyond is Reason.BAD_GEOMETRY


def test_the_largest_accepted_pair_plans_and_serialises() -> None:
    prefill = announce("P", 8100, {**WORST_GEOMETRY, "tp_size": 1}, "nixl")
    decode = announce("D", 8200, {**WORST_GEOMETRY, "tp_size": MAX_TP_SIZE}, "nixl")
    fields = plan_and_render(prefill, decode)
    assert fields is not None and fields["verified"] is True, fields
    assert len(fields["decode_rank_reads"]) == MAX_TP_SIZE
    assert 0 < fields["kv_bytes_per_prefill_block"] < 2**63
