"""pdproxy.vllm_side.announcement against the proxy's decoder: what a worker sends is what the
registry reads (DESIGN.md section 3), and `healthy` keeps an instance known but unrouted."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.base.roles import Role
from pdproxy.ids import Address
from pdproxy.registry.messages import (
    GEOMETRY_LIMITS,
    Announcement,
    Connector,
    Geometry,
    KvCoordinates,
    Leave,
    Load,
    Message,
    Reason,
    Rejected,
    decode_frame,
)
from pdproxy.registry.table import Change, RegistryTable, Source
from pdproxy.vllm_side.announcement import (
    WorkerIdentity,
    announce_message,
    leave_message,
    v0_message,
)

# Deterministic and load-tolerant, as in test_messages.py.
PROFILE = settings(derandomize=True, database=None, deadline=None)

LLAMA_GEOMETRY = Geometry(
    tp_size=2,
    block_size=16,
    num_layers=32,
    num_kv_heads=8,
    head_dim=128,
    kv_dtype="bfloat16",
    is_mla=False,
    kv_layout="HND",
)

DECODE = WorkerIdentity(
    role=Role.DECODE,
    http_address="decode-0.pd.svc:8200",
    zmq_address="decode-0.pd.svc:22001",
    model="meta-llama/Llama-3.1-8B-Instruct",
    connector="nixl",
    geometry=LLAMA_GEOMETRY,
)

COORDINATES = KvCoordinates(Address("10.0.0.5", 8998), "engine-0", Address("10.0.0.5", 5600))

PREFILL = WorkerIdentity(
    role=Role.PREFILL, http_address="10.0.0.5:8100", zmq_address="10.0.0.5:21001"
)


def roundtrip(message: dict[str, Any]) -> Message:
    frame: bytes = msgpack.packb(message)
    return decode_frame(frame)


def announced(message: dict[str, Any]) -> Announcement:
    decoded = roundtrip(message)
    assert isinstance(decoded, Announcement)
    return decoded


def geometry_fields(geometry: object) -> dict[str, Any]:
    assert dataclasses.is_dataclass(geometry) and not isinstance(geometry, type)
    return dataclasses.asdict(geometry)


def assert_same(identity: WorkerIdentity, decoded: Announcement) -> None:
    """The decoded announcement carries exactly what the identity said."""
    assert decoded.version == 1
    assert decoded.role is identity.role
    assert str(decoded.http_address) == identity.http_address
    assert str(decoded.zmq_address) == identity.zmq_address
    assert decoded.model == identity.model
    if identity.connector is None:
        assert decoded.connector is None
    else:
        assert decoded.connector is Connector(identity.connector)
    assert decoded.coordinates == identity.coordinates
    if identity.geometry is None:
        assert decoded.geometry is None
    else:
        assert decoded.geometry is not None
        assert geometry_fields(decoded.geometry) == geometry_fields(identity.geometry)


# --- announce ------------------------------------------------------------------------------------


def test_full_announcement_round_trips() -> None:
    load = Load(running=3, waiting=1, kv_usage=0.25)
    decoded = announced(announce_message(DECODE, load))
    assert_same(DECODE, decoded)
    assert decoded.http_address == Address("decode-0.pd.svc", 8200)
    assert decoded.role is Role.DECODE and decoded.connector is Connector.NIXL
    assert decoded.load is not None
    assert (decoded.load.running, decoded.load.waiting, decoded.load.kv_usage) == (3, 1, 0.25)
    assert decoded.healthy is True


def test_minimal_announcement_round_trips() -> None:
    message = announce_message(PREFILL)
    assert message == {
        "v": 1,
        "op": "announce",
        "type": "P",
        "http_address": "10.0.0.5:8100",
        "zmq_address": "10.0.0.5:21001",
    }
    decoded = announced(message)
    assert_same(PREFILL, decoded)
    assert decoded.load is None and decoded.healthy is True


@pytest.mark.parametrize("connector", [c.value for c in Connector])
def test_every_connector_kind_decodes(connector: str) -> None:
    identity = dataclasses.replace(PREFILL, connector=connector, coordinates=COORDINATES)
    assert announced(announce_message(identity)).connector is Connector(connector)


def test_unknown_geometry_fields_are_omitted() -> None:
    partial = Geometry(tp_size=4, num_layers=61, is_mla=True)
    identity = dataclasses.replace(PREFILL, geometry=partial)
    message = announce_message(identity)
    assert message["geometry"] == {"tp_size": 4, "num_layers": 61, "is_mla": True}
    decoded = announced(message)
    assert decoded.geometry is not None
    assert geometry_fields(decoded.geometry) == geometry_fields(partial)
    assert decoded.geometry.block_size is None and decoded.geometry.kv_layout is None


def test_all_unknown_geometry_is_an_empty_map_not_nulls() -> None:
    message = announce_message(dataclasses.replace(PREFILL, geometry=Geometry()))
    assert message["geometry"] == {}
    decoded = announced(message)
    assert decoded.geometry is not None
    assert all(value is None for value in geometry_fields(decoded.geometry).values())


def test_is_mla_false_is_sent_not_dropped() -> None:
    # False is a value, not "unknown": only None is omitted.
    message = announce_message(dataclasses.replace(PREFILL, geometry=Geometry(is_mla=False)))
    assert message["geometry"] == {"is_mla": False}
    decoded = announced(message)
    assert decoded.geometry is not None and decoded.geometry.is_mla is False


def test_unknown_load_fields_are_omitted() -> None:
    message = announce_message(PREFILL, Load(waiting=0))
    assert message["load"] == {"waiting": 0}
    decoded = announced(message)
    assert decoded.load is not None
    assert (decoded.load.running, decoded.load.waiting, decoded.load.kv_usage) == (None, 0, None)


def test_no_load_sends_no_load_key() -> None:
    assert "load" not in announce_message(DECODE, None)


def test_healthy_true_is_the_default_and_not_sent() -> None:
    message = announce_message(DECODE, Load(running=1), healthy=True)
    assert "healthy" not in message
    assert announced(message).healthy is True


def test_unhealthy_announcement_round_trips() -> None:
    message = announce_message(DECODE, None, healthy=False)
    assert message["healthy"] is False
    decoded = announced(message)
    assert decoded.healthy is False
    assert_same(DECODE, decoded)


# --- leave and v0 --------------------------------------------------------------------------------


@pytest.mark.parametrize("identity", [DECODE, PREFILL])
def test_leave_decodes_to_leave(identity: WorkerIdentity) -> None:
    decoded = roundtrip(leave_message(identity))
    assert isinstance(decoded, Leave)
    assert str(decoded.http_address) == identity.http_address


def test_leave_carries_no_announcement_payload() -> None:
    message = leave_message(DECODE)
    assert message["op"] == "leave" and message["v"] == 1
    assert not {"model", "connector", "geometry", "load", "healthy"} & message.keys()


def test_v0_message_is_exactly_the_stock_map() -> None:
    message = v0_message(DECODE)
    stock = {
        "type": "D",
        "http_address": "decode-0.pd.svc:8200",
        "zmq_address": "decode-0.pd.svc:22001",
    }
    assert message == stock
    assert list(message) == ["type", "http_address", "zmq_address"]
    # Byte for byte what P2pNcclEngine.ping() sends: msgpack.dumps of that literal.
    assert msgpack.packb(message) == msgpack.dumps(stock)


def test_v0_message_decodes_as_v0_without_extras() -> None:
    decoded = announced(v0_message(DECODE))
    assert decoded.version == 0
    assert decoded.role is Role.DECODE
    assert str(decoded.http_address) == DECODE.http_address
    assert str(decoded.zmq_address) == DECODE.zmq_address
    assert (decoded.model, decoded.connector, decoded.geometry, decoded.load) == (
        None,
        None,
        None,
        None,
    )
    assert decoded.healthy is True


# --- the decoder's side of `healthy` -------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 1, "false", "true", None, 0.0, [], {}])
def test_non_bool_healthy_is_rejected(value: object) -> None:
    message = {**announce_message(DECODE), "healthy": value}
    with pytest.raises(Rejected) as info:
        roundtrip(message)
    assert info.value.reason is Reason.WRONG_TYPE


def test_healthy_is_ignored_in_v0() -> None:
    # Stock vLLM never sends it; a v0 frame that does is still plain v0.
    decoded = announced({**v0_message(PREFILL), "healthy": "junk"})
    assert decoded.version == 0 and decoded.healthy is True


def test_healthy_is_not_read_on_leave() -> None:
    decoded = roundtrip({**leave_message(PREFILL), "healthy": "junk"})
    assert isinstance(decoded, Leave)


# --- the table -----------------------------------------------------------------------------------


def snapshot_names(table: RegistryTable, now: float | None = None) -> set[str]:
    snap = table.snapshot(now)
    return {i.name for i in (*snap.prefills, *snap.decodes)}


def entry_names(table: RegistryTable) -> set[str]:
    return {e.instance.name for e in table.registrations()}


def test_unhealthy_instance_stays_listed_but_leaves_the_snapshot() -> None:
    table = RegistryTable(ttl=10.0, max_instances=16)
    load = Load(running=2, waiting=0, kv_usage=0.5)
    change, instance = table.announce(announced(announce_message(DECODE, load)), now=0.0)
    assert change is Change.REGISTERED and instance.source is Source.V1
    assert snapshot_names(table, now=0.0) == {DECODE.http_address}

    # Same load, only the health flips: membership must not lag like a load change may.
    change, instance = table.announce(
        announced(announce_message(DECODE, load, healthy=False)), now=0.01
    )
    assert change is Change.UPDATED
    assert instance.healthy is False
    assert entry_names(table) == {DECODE.http_address}
    assert snapshot_names(table, now=0.01) == set()
    assert table.snapshot().decodes == ()
    assert table.count(Role.DECODE) == 1

    change, instance = table.announce(announced(announce_message(DECODE, load)), now=0.02)
    assert change is Change.UPDATED  # not LOAD: routing sees it again at once
    assert instance.healthy is True
    assert snapshot_names(table, now=0.02) == {DECODE.http_address}


def test_sidecar_style_flip_with_load_lost_and_regained() -> None:
    # What `pdproxy announce` sends: no load while the server is down, a load once it is back.
    table = RegistryTable(ttl=10.0, max_instances=16)
    table.announce(announced(announce_message(DECODE, Load(running=1))), now=0.0)
    change, _ = table.announce(announced(announce_message(DECODE, None, healthy=False)), now=1.0)
    assert change is Change.UPDATED
    assert snapshot_names(table, now=1.0) == set()
    change, instance = table.announce(announced(announce_message(DECODE, Load(running=4))), now=1.1)
    assert change is Change.UPDATED
    assert instance.load is not None and instance.load.running == 4
    assert snapshot_names(table, now=1.1) == {DECODE.http_address}


def test_repeated_unhealthy_announcements_only_refresh() -> None:
    table = RegistryTable(ttl=10.0, max_instances=16)
    message = announced(announce_message(DECODE, None, healthy=False))
    assert table.announce(message, now=0.0)[0] is Change.REGISTERED
    assert table.announce(message, now=5.0)[0] is Change.REFRESHED
    # Still refreshed by its heartbeats: it does not expire while the sidecar speaks.
    assert table.expire(now=12.0) == []
    assert entry_names(table) == {DECODE.http_address}
    assert snapshot_names(table) == set()


def test_new_instance_registered_unhealthy_is_never_routed() -> None:
    table = RegistryTable(ttl=10.0, max_instances=16)
    table.announce(announced(announce_message(PREFILL)), now=0.0)
    change, instance = table.announce(
        announced(announce_message(DECODE, None, healthy=False)), now=0.0
    )
    assert change is Change.REGISTERED and instance.healthy is False
    snap = table.snapshot(now=0.0)
    assert [i.name for i in snap.prefills] == [PREFILL.http_address]
    assert snap.decodes == ()


def test_leave_removes_an_unhealthy_instance() -> None:
    table = RegistryTable(ttl=10.0, max_instances=16)
    table.announce(announced(announce_message(DECODE, None, healthy=False)), now=0.0)
    leave = roundtrip(leave_message(DECODE))
    assert isinstance(leave, Leave)
    gone = table.remove(leave.http_address)
    assert gone is not None and gone.name == DECODE.http_address
    assert table.registrations() == []


# --- property: every value the decoder accepts survives the trip (strategies shared with
# test_wire_round_trip) ---------------------------------

_hosts = st.from_regex(
    r"[a-z]([a-z0-9-]{0,8}[a-z0-9])?(\.[a-z]([a-z0-9-]{0,8}[a-z0-9])?){0,2}", fullmatch=True
)
_addresses = st.builds(lambda host, port: f"{host}:{port}", _hosts, st.integers(1, 65535))


def _in_limits(name: str) -> st.SearchStrategy[int | None]:
    return st.none() | st.integers(1, GEOMETRY_LIMITS[name])


GEOMETRIES = st.builds(
    Geometry,
    tp_size=_in_limits("tp_size"),
    block_size=_in_limits("block_size"),
    num_layers=_in_limits("num_layers"),
    num_kv_heads=_in_limits("num_kv_heads"),
    head_dim=_in_limits("head_dim"),
    kv_dtype=st.none() | st.text(min_size=1, max_size=32),
    is_mla=st.none() | st.booleans(),
    kv_layout=st.none() | st.sampled_from(["NHD", "HND"]),
)
LOADS = st.builds(
    Load,
    running=st.none() | st.integers(0, 2**63 - 1),
    waiting=st.none() | st.integers(0, 2**63 - 1),
    kv_usage=st.none() | st.floats(0.0, 1.0, allow_nan=False),
)
_identities = st.builds(
    WorkerIdentity,
    role=st.sampled_from(Role),
    http_address=_addresses,
    zmq_address=_addresses,
    model=st.none() | st.text(min_size=1, max_size=256),
    connector=st.none() | st.sampled_from([c.value for c in Connector]),
    geometry=st.none() | GEOMETRIES,
    coordinates=st.just(COORDINATES),  # what every kind's prefill may need
)


@PROFILE
@given(identity=_identities, load=st.none() | LOADS, healthy=st.booleans())
def test_property_announcements_round_trip(
    identity: WorkerIdentity, load: Load | None, healthy: bool
) -> None:
    decoded = announced(announce_message(identity, load, healthy))
    assert_same(identity, decoded)
    assert decoded.healthy is healthy
    if load is None:
        assert decoded.load is None
    else:
        assert decoded.load is not None
        assert (decoded.load.running, decoded.load.waiting, decoded.load.kv_usage) == (
            load.running,
            load.waiting,
            load.kv_usage,
        )
    leave = roundtrip(leave_message(identity))
    assert isinstance(leave, Leave)
    assert str(leave.http_address) == identity.http_address
