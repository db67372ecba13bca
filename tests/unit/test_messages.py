"""pdproxy.registry.messages: v0/v1 registry frames in, Announcement/Leave or Rejected out."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdproxy.base.roles import Role
from pdproxy.ids import Address, validate_host
from pdproxy.registry.messages import (
    MAX_MODEL_LEN,
    MAX_TP_SIZE,
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
    parse_message,
    to_map,
)

# Deterministic and load-tolerant: same examples every run, no deadline, no example database.
PROFILE = settings(derandomize=True, database=None, deadline=None)

# Exactly what stock vLLM's P2pNcclEngine sends (DESIGN.md section 3).
V0 = {"type": "P", "http_address": "10.0.0.5:8100", "zmq_address": "10.0.0.5:21001"}

V1_FULL: dict[str, Any] = {
    "v": 1,
    "op": "announce",
    "type": "D",
    "http_address": "decode-0.pd.svc:8200",
    "zmq_address": "decode-0.pd.svc:22001",
    "model": "meta-llama/Llama-3.1-8B-Instruct",
    "connector": "nixl",
    "geometry": {
        "tp_size": 2,
        "block_size": 16,
        "num_layers": 32,
        "num_kv_heads": 8,
        "head_dim": 128,
        "kv_dtype": "bfloat16",
        "is_mla": False,
        "kv_layout": "HND",
    },
    "load": {"running": 3, "waiting": 1, "kv_usage": 0.25},
    "stats": {"rank0": {"sent_bytes": 123, "recv_bytes": 456}},
    "auth": "token",
}

V1_MINIMAL = {
    "v": 1,
    "type": "P",
    "http_address": "10.0.0.6:8100",
    "zmq_address": "10.0.0.6:21001",
}


def frame(value: object) -> bytes:
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


def with_(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = dict(base)
    out.update(changes)
    return out


def without(base: dict[str, Any], key: str) -> dict[str, Any]:
    out = dict(base)
    del out[key]
    return out


def reason_of(data: bytes) -> Reason:
    with pytest.raises(Rejected) as info:
        decode_frame(data)
    assert str(info.value).startswith(f"{info.value.reason.value}: ")
    assert info.value.detail
    return info.value.reason


# ---------------------------------------------------------------------------------------------
# accepted messages


def test_stock_vllm_v0_announcement() -> None:
    assert decode_frame(frame(V0)) == Announcement(
        version=0,
        role=Role.PREFILL,
        http_address=Address("10.0.0.5", 8100),
        zmq_address=Address("10.0.0.5", 21001),
        model=None,
        connector=None,
        geometry=None,
        load=None,
    )


def test_explicit_v0_is_v0_and_float_versions_are_refused() -> None:
    assert isinstance(parse_message({**V0, "v": 0}), Announcement)
    assert parse_message({**V0, "v": 0}).version == 0  # type: ignore[union-attr]
    for version in (1.0, 0.0, True):
        with pytest.raises(Rejected) as info:
            parse_message({**V0, "v": version})
        assert info.value.reason is Reason.UNSUPPORTED_VERSION


def test_v0_decode_role() -> None:
    message = decode_frame(frame(with_(V0, type="D")))
    assert isinstance(message, Announcement)
    assert message.role is Role.DECODE
    assert message.version == 0


def test_v0_ignores_unknown_and_v1_only_fields() -> None:
    # Without "v" the message is v0: extra fields are not read.
    message = decode_frame(frame(with_(V0, model="m", extra=[1, 2], load={"running": -5})))
    assert message == Announcement(
        0, Role.PREFILL, Address("10.0.0.5", 8100), Address("10.0.0.5", 21001)
    )


def test_v1_with_every_field() -> None:
    assert decode_frame(frame(V1_FULL)) == Announcement(
        version=1,
        role=Role.DECODE,
        http_address=Address("decode-0.pd.svc", 8200),
        zmq_address=Address("decode-0.pd.svc", 22001),
        model="meta-llama/Llama-3.1-8B-Instruct",
        connector=Connector.NIXL,
        geometry=Geometry(
            tp_size=2,
            block_size=16,
            num_layers=32,
            num_kv_heads=8,
            head_dim=128,
            kv_dtype="bfloat16",
            is_mla=False,
            kv_layout="HND",
        ),
        load=Load(running=3, waiting=1, kv_usage=0.25),
    )


def test_v1_minimal() -> None:
    assert decode_frame(frame(V1_MINIMAL)) == Announcement(
        1, Role.PREFILL, Address("10.0.0.6", 8100), Address("10.0.0.6", 21001)
    )


def test_v1_explicit_nulls_are_absent() -> None:
    message = decode_frame(
        frame(with_(V1_MINIMAL, model=None, connector=None, geometry=None, load=None))
    )
    assert message == Announcement(
        1, Role.PREFILL, Address("10.0.0.6", 8100), Address("10.0.0.6", 21001)
    )


def test_v1_partial_geometry_and_load() -> None:
    message = decode_frame(
        frame(with_(V1_MINIMAL, geometry={"tp_size": 4, "is_mla": True}, load={"waiting": 0}))
    )
    assert isinstance(message, Announcement)
    assert message.geometry == Geometry(tp_size=4, is_mla=True)
    assert message.load == Load(running=None, waiting=0, kv_usage=None)
    assert message.model is None and message.connector is None


def test_v1_load_carries_a_prefills_work() -> None:
    message = decode_frame(frame(with_(V1_MINIMAL, load={"running": 1, "prefill_tokens": 4096})))
    assert isinstance(message, Announcement)
    assert message.load == Load(running=1, prefill_tokens=4096)
    # and back: what the connector sends is what the registry reads
    assert decode_frame(frame(to_map(message))) == message


def test_v1_empty_geometry_and_load_maps() -> None:
    message = decode_frame(frame(with_(V1_MINIMAL, geometry={}, load={})))
    assert isinstance(message, Announcement)
    assert message.geometry == Geometry()
    assert message.load == Load()


def test_v1_unknown_fields_are_ignored() -> None:
    payload = with_(
        V1_FULL,
        future_field={"a": [1, 2, 3]},
        geometry=with_(V1_FULL["geometry"], sliding_window=4096, extra="x"),
        load=with_(V1_FULL["load"], gpu_temp=71.5),
    )
    assert decode_frame(frame(payload)) == decode_frame(frame(V1_FULL))


def test_v1_op_defaults_to_announce() -> None:
    assert decode_frame(frame(without(V1_FULL, "op"))) == decode_frame(frame(V1_FULL))


COORDINATES = {"bootstrap": "10.0.0.6:8998", "engine_id": "e-1", "side_channel": "10.0.0.6:5600"}
COORDINATES_READ = KvCoordinates(Address("10.0.0.6", 8998), "e-1", Address("10.0.0.6", 5600))


@pytest.mark.parametrize("connector", list(Connector))
def test_every_connector(connector: Connector) -> None:
    announced = with_(V1_MINIMAL, connector=connector.value, kv_coordinates=COORDINATES)
    message = decode_frame(frame(announced))
    assert isinstance(message, Announcement)
    assert message.connector is connector


def test_coordinates_are_read_and_written() -> None:
    message = decode_frame(
        frame(with_(V1_MINIMAL, connector="mooncake", kv_coordinates=COORDINATES))
    )
    assert isinstance(message, Announcement)
    assert message.coordinates == COORDINATES_READ
    assert to_map(message)["kv_coordinates"] == COORDINATES


@pytest.mark.parametrize(
    ("connector", "missing"),
    [("mooncake", "bootstrap"), ("nixl_push", "engine_id, side_channel")],
)
def test_a_prefill_of_a_peer_naming_kind_must_announce_its_coordinates(
    connector: str, missing: str
) -> None:
    with pytest.raises(
        Rejected, match=f"a {connector} prefill must announce kv_coordinates {missing}"
    ):
        decode_frame(frame(with_(V1_MINIMAL, connector=connector)))
    # The decode's leg names the prefill, never the decode: a decode needs none.
    decode = decode_frame(frame(with_(V1_MINIMAL, type="D", connector=connector)))
    assert isinstance(decode, Announcement) and decode.coordinates is None


@pytest.mark.parametrize(
    "coordinates",
    [
        "10.0.0.6:8998",
        {"bootstrap": "no-port"},
        {"side_channel": 5600},
        {"engine_id": ""},
        {"engine_id": "x" * 129},
        {"engine_id": "a\nb"},
    ],
)
def test_bad_coordinates_are_refused(coordinates: object) -> None:
    with pytest.raises(Rejected):
        decode_frame(frame(with_(V1_MINIMAL, kv_coordinates=coordinates)))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_both_layouts(layout: str) -> None:
    message = decode_frame(frame(with_(V1_MINIMAL, geometry={"kv_layout": layout})))
    assert isinstance(message, Announcement)
    assert message.geometry == Geometry(kv_layout=layout)


@pytest.mark.parametrize(
    ("usage", "expected"), [(0, 0.0), (1, 1.0), (0.0, 0.0), (1.0, 1.0), (0.5, 0.5)]
)
def test_kv_usage_bounds_and_int_becomes_float(usage: float, expected: float) -> None:
    message = decode_frame(frame(with_(V1_MINIMAL, load={"kv_usage": usage})))
    assert isinstance(message, Announcement)
    assert message.load is not None
    assert message.load.kv_usage == expected
    assert type(message.load.kv_usage) is float


def test_model_length_limit_is_inclusive() -> None:
    message = decode_frame(frame(with_(V1_MINIMAL, model="m" * 256)))
    assert isinstance(message, Announcement)
    assert message.model == "m" * 256


def test_leave() -> None:
    payload = {"v": 1, "op": "leave", "http_address": "10.0.0.5:8100"}
    assert decode_frame(frame(payload)) == Leave(Address("10.0.0.5", 8100))


def test_leave_ignores_announcement_fields() -> None:
    payload = with_(V1_FULL, op="leave", type="bogus", zmq_address=7)
    assert decode_frame(frame(payload)) == Leave(Address("decode-0.pd.svc", 8200))


def test_parse_message_takes_python_values() -> None:
    assert parse_message(dict(V0)) == decode_frame(frame(V0))


def test_rejected_carries_reason_and_detail() -> None:
    exc = Rejected(Reason.CAPACITY, "full")
    assert isinstance(exc, ValueError)
    assert exc.reason is Reason.CAPACITY
    assert exc.detail == "full"
    assert str(exc) == "capacity: full"


# ---------------------------------------------------------------------------------------------
# rejected messages: one case per reason and shape

REJECTED_BYTES: list[tuple[str, bytes, Reason]] = [
    ("empty", b"", Reason.NOT_MSGPACK),
    ("never-used byte", b"\xc1", Reason.NOT_MSGPACK),
    ("random bytes", b"\xc1\xff\x00\x13\x37garbage\x00\x9a", Reason.NOT_MSGPACK),
    ("http request", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", Reason.NOT_MSGPACK),
    ("truncated", frame(V0)[:-3], Reason.NOT_MSGPACK),
    ("truncated header", frame(V0)[:1], Reason.NOT_MSGPACK),
    ("trailing data", frame(V0) + b"\x00", Reason.NOT_MSGPACK),
    ("two messages", frame(V0) + frame(V0), Reason.NOT_MSGPACK),
    ("invalid utf-8 str", b"\x81\xa4type\xa2\xff\xfe", Reason.NOT_MSGPACK),
    ("map with array key", b"\x81\x91\x01\x01", Reason.NOT_MSGPACK),
    ("nesting too deep", b"\x91" * 2000 + b"\x00", Reason.NOT_MSGPACK),
]


@pytest.mark.parametrize(
    ("data", "reason"),
    [(d, r) for _, d, r in REJECTED_BYTES],
    ids=[name for name, _, _ in REJECTED_BYTES],
)
def test_rejected_bytes(data: bytes, reason: Reason) -> None:
    assert reason_of(data) is reason


REJECTED: list[tuple[str, object, Reason]] = [
    # not a map
    ("list", [V0], Reason.NOT_A_MAP),
    ("empty list", [], Reason.NOT_A_MAP),
    ("int", 7, Reason.NOT_A_MAP),
    ("string", "P", Reason.NOT_A_MAP),
    ("nil", None, Reason.NOT_A_MAP),
    ("bool", True, Reason.NOT_A_MAP),
    ("float", 1.5, Reason.NOT_A_MAP),
    ("bin", b"\x80", Reason.NOT_A_MAP),
    # missing field
    ("empty map", {}, Reason.MISSING_FIELD),
    ("v0 no type", without(V0, "type"), Reason.MISSING_FIELD),
    ("v0 no http_address", without(V0, "http_address"), Reason.MISSING_FIELD),
    ("v0 no zmq_address", without(V0, "zmq_address"), Reason.MISSING_FIELD),
    ("v1 no type", without(V1_FULL, "type"), Reason.MISSING_FIELD),
    ("v1 no http_address", without(V1_FULL, "http_address"), Reason.MISSING_FIELD),
    ("v1 no zmq_address", without(V1_FULL, "zmq_address"), Reason.MISSING_FIELD),
    ("leave no http_address", {"v": 1, "op": "leave"}, Reason.MISSING_FIELD),
    ("int keys only", {1: "P", 2: "10.0.0.5:8100"}, Reason.MISSING_FIELD),
    # wrong type
    ("type int", with_(V0, type=1), Reason.WRONG_TYPE),
    ("type nil", with_(V0, type=None), Reason.WRONG_TYPE),
    ("type bin", with_(V0, type=b"P"), Reason.WRONG_TYPE),
    ("type list", with_(V0, type=["P"]), Reason.WRONG_TYPE),
    ("http_address int", with_(V0, http_address=8100), Reason.WRONG_TYPE),
    ("http_address bin", with_(V0, http_address=b"10.0.0.5:8100"), Reason.WRONG_TYPE),
    ("zmq_address list", with_(V0, zmq_address=["10.0.0.5", 21001]), Reason.WRONG_TYPE),
    ("zmq_address map", with_(V0, zmq_address={"host": "h"}), Reason.WRONG_TYPE),
    ("v1 type int", with_(V1_MINIMAL, type=68), Reason.WRONG_TYPE),
    ("model int", with_(V1_MINIMAL, model=7), Reason.WRONG_TYPE),
    ("model empty", with_(V1_MINIMAL, model=""), Reason.WRONG_TYPE),
    ("model too long", with_(V1_MINIMAL, model="m" * 257), Reason.WRONG_TYPE),
    ("model list", with_(V1_MINIMAL, model=["m"]), Reason.WRONG_TYPE),
    ("model bin", with_(V1_MINIMAL, model=b"m"), Reason.WRONG_TYPE),
    ("connector int", with_(V1_MINIMAL, connector=3), Reason.WRONG_TYPE),
    ("leave http_address int", {"v": 1, "op": "leave", "http_address": 1}, Reason.WRONG_TYPE),
    # unknown type
    ("type X", with_(V0, type="X"), Reason.UNKNOWN_TYPE),
    ("type p", with_(V0, type="p"), Reason.UNKNOWN_TYPE),
    ("type d", with_(V0, type="d"), Reason.UNKNOWN_TYPE),
    ("type empty", with_(V0, type=""), Reason.UNKNOWN_TYPE),
    ("type PD", with_(V0, type="PD"), Reason.UNKNOWN_TYPE),
    ("type prefill", with_(V0, type="prefill"), Reason.UNKNOWN_TYPE),
    ("v1 type X", with_(V1_FULL, type="X"), Reason.UNKNOWN_TYPE),
    # unknown op
    ("op join", with_(V1_FULL, op="join"), Reason.UNKNOWN_OP),
    ("op LEAVE", with_(V1_FULL, op="LEAVE"), Reason.UNKNOWN_OP),
    ("op empty", with_(V1_FULL, op=""), Reason.UNKNOWN_OP),
    ("op int", with_(V1_FULL, op=1), Reason.UNKNOWN_OP),
    ("op nil", with_(V1_FULL, op=None), Reason.UNKNOWN_OP),
    ("op list", with_(V1_FULL, op=["leave"]), Reason.UNKNOWN_OP),
    # unsupported version
    ("v=2", with_(V1_FULL, v=2), Reason.UNSUPPORTED_VERSION),
    ("v='1'", with_(V1_FULL, v="1"), Reason.UNSUPPORTED_VERSION),
    ("v=True", with_(V1_FULL, v=True), Reason.UNSUPPORTED_VERSION),
    ("v=-1", with_(V1_FULL, v=-1), Reason.UNSUPPORTED_VERSION),
    ("v=1.5", with_(V1_FULL, v=1.5), Reason.UNSUPPORTED_VERSION),
    ("v=nil", with_(V1_FULL, v=None), Reason.UNSUPPORTED_VERSION),
    ("v=[1]", with_(V1_FULL, v=[1]), Reason.UNSUPPORTED_VERSION),
    ("v=2**64-1", with_(V1_FULL, v=2**64 - 1), Reason.UNSUPPORTED_VERSION),
    ("v=2 leave", {"v": 2, "op": "leave", "http_address": "h:1"}, Reason.UNSUPPORTED_VERSION),
    # bad address
    ("http empty", with_(V0, http_address=""), Reason.BAD_ADDRESS),
    ("http empty host", with_(V0, http_address=":8100"), Reason.BAD_ADDRESS),
    ("http ipv6", with_(V0, http_address="[::1]:8100"), Reason.BAD_ADDRESS),
    ("http bare ipv6", with_(V0, http_address="::1:8100"), Reason.BAD_ADDRESS),
    ("zmq ipv6", with_(V0, zmq_address="fe80::1:21001"), Reason.BAD_ADDRESS),
    ("zmq ___", with_(V0, zmq_address="a___b:21001"), Reason.BAD_ADDRESS),
    ("zmq __", with_(V0, zmq_address="a__b:21001"), Reason.BAD_ADDRESS),
    ("zmq port 0", with_(V0, zmq_address="10.0.0.5:0"), Reason.BAD_ADDRESS),
    ("zmq port 70000", with_(V0, zmq_address="10.0.0.5:70000"), Reason.BAD_ADDRESS),
    ("http port 0", with_(V0, http_address="10.0.0.5:0"), Reason.BAD_ADDRESS),
    ("http no port", with_(V0, http_address="10.0.0.5"), Reason.BAD_ADDRESS),
    ("http empty port", with_(V0, http_address="10.0.0.5:"), Reason.BAD_ADDRESS),
    ("http space", with_(V0, http_address="10.0.0 .5:8100"), Reason.BAD_ADDRESS),
    ("http leading dash", with_(V0, http_address="-h:8100"), Reason.BAD_ADDRESS),
    ("http non-ascii", with_(V0, http_address="héllo:8100"), Reason.BAD_ADDRESS),
    ("v1 http ipv6", with_(V1_FULL, http_address="[::1]:8100"), Reason.BAD_ADDRESS),
    ("v1 zmq port 0", with_(V1_FULL, zmq_address="h:0"), Reason.BAD_ADDRESS),
    ("leave ipv6", {"v": 1, "op": "leave", "http_address": "[::1]:8100"}, Reason.BAD_ADDRESS),
    ("leave port 0", {"v": 1, "op": "leave", "http_address": "h:0"}, Reason.BAD_ADDRESS),
    # bad geometry
    ("geometry list", with_(V1_MINIMAL, geometry=[2, 16]), Reason.BAD_GEOMETRY),
    ("geometry str", with_(V1_MINIMAL, geometry="tp=2"), Reason.BAD_GEOMETRY),
    ("tp negative", with_(V1_MINIMAL, geometry={"tp_size": -1}), Reason.BAD_GEOMETRY),
    ("tp zero", with_(V1_MINIMAL, geometry={"tp_size": 0}), Reason.BAD_GEOMETRY),
    ("tp bool", with_(V1_MINIMAL, geometry={"tp_size": True}), Reason.BAD_GEOMETRY),
    ("tp float", with_(V1_MINIMAL, geometry={"tp_size": 2.0}), Reason.BAD_GEOMETRY),
    ("tp str", with_(V1_MINIMAL, geometry={"tp_size": "2"}), Reason.BAD_GEOMETRY),
    ("block_size zero", with_(V1_MINIMAL, geometry={"block_size": 0}), Reason.BAD_GEOMETRY),
    ("num_layers neg", with_(V1_MINIMAL, geometry={"num_layers": -32}), Reason.BAD_GEOMETRY),
    ("heads bool", with_(V1_MINIMAL, geometry={"num_kv_heads": False}), Reason.BAD_GEOMETRY),
    ("head_dim str", with_(V1_MINIMAL, geometry={"head_dim": "128"}), Reason.BAD_GEOMETRY),
    ("layout XYZ", with_(V1_MINIMAL, geometry={"kv_layout": "XYZ"}), Reason.BAD_GEOMETRY),
    ("layout lower", with_(V1_MINIMAL, geometry={"kv_layout": "nhd"}), Reason.BAD_GEOMETRY),
    ("layout int", with_(V1_MINIMAL, geometry={"kv_layout": 1}), Reason.BAD_GEOMETRY),
    ("layout list", with_(V1_MINIMAL, geometry={"kv_layout": ["NHD"]}), Reason.BAD_GEOMETRY),
    ("is_mla yes", with_(V1_MINIMAL, geometry={"is_mla": "yes"}), Reason.BAD_GEOMETRY),
    ("is_mla 1", with_(V1_MINIMAL, geometry={"is_mla": 1}), Reason.BAD_GEOMETRY),
    ("dtype empty", with_(V1_MINIMAL, geometry={"kv_dtype": ""}), Reason.BAD_GEOMETRY),
    ("dtype int", with_(V1_MINIMAL, geometry={"kv_dtype": 16}), Reason.BAD_GEOMETRY),
    ("dtype long", with_(V1_MINIMAL, geometry={"kv_dtype": "x" * 33}), Reason.BAD_GEOMETRY),
    # bad load
    ("load list", with_(V1_MINIMAL, load=[1, 2]), Reason.BAD_LOAD),
    ("load int", with_(V1_MINIMAL, load=3), Reason.BAD_LOAD),
    ("kv_usage 1.5", with_(V1_MINIMAL, load={"kv_usage": 1.5}), Reason.BAD_LOAD),
    ("kv_usage NaN", with_(V1_MINIMAL, load={"kv_usage": math.nan}), Reason.BAD_LOAD),
    ("kv_usage inf", with_(V1_MINIMAL, load={"kv_usage": math.inf}), Reason.BAD_LOAD),
    ("kv_usage -inf", with_(V1_MINIMAL, load={"kv_usage": -math.inf}), Reason.BAD_LOAD),
    ("kv_usage negative", with_(V1_MINIMAL, load={"kv_usage": -0.01}), Reason.BAD_LOAD),
    ("kv_usage 2", with_(V1_MINIMAL, load={"kv_usage": 2}), Reason.BAD_LOAD),
    ("kv_usage bool", with_(V1_MINIMAL, load={"kv_usage": True}), Reason.BAD_LOAD),
    ("kv_usage str", with_(V1_MINIMAL, load={"kv_usage": "0.5"}), Reason.BAD_LOAD),
    ("kv_usage huge int", with_(V1_MINIMAL, load={"kv_usage": 2**64 - 1}), Reason.BAD_LOAD),
    ("running negative", with_(V1_MINIMAL, load={"running": -1}), Reason.BAD_LOAD),
    ("running bool", with_(V1_MINIMAL, load={"running": True}), Reason.BAD_LOAD),
    ("running float", with_(V1_MINIMAL, load={"running": 1.0}), Reason.BAD_LOAD),
    ("waiting negative", with_(V1_MINIMAL, load={"waiting": -3}), Reason.BAD_LOAD),
    ("waiting str", with_(V1_MINIMAL, load={"waiting": "3"}), Reason.BAD_LOAD),
    ("prefill_tokens negative", with_(V1_MINIMAL, load={"prefill_tokens": -1}), Reason.BAD_LOAD),
    ("prefill_tokens float", with_(V1_MINIMAL, load={"prefill_tokens": 5.0}), Reason.BAD_LOAD),
    ("prefill_tokens bool", with_(V1_MINIMAL, load={"prefill_tokens": False}), Reason.BAD_LOAD),
    ("prefill_tokens str", with_(V1_MINIMAL, load={"prefill_tokens": "4096"}), Reason.BAD_LOAD),
    # unknown connector
    ("connector nccl", with_(V1_MINIMAL, connector="nccl"), Reason.UNKNOWN_CONNECTOR),
    ("connector NIXL", with_(V1_MINIMAL, connector="NIXL"), Reason.UNKNOWN_CONNECTOR),
    ("connector empty", with_(V1_MINIMAL, connector=""), Reason.UNKNOWN_CONNECTOR),
    ("connector class", with_(V1_MINIMAL, connector="P2pNccl"), Reason.UNKNOWN_CONNECTOR),
]


@pytest.mark.parametrize(
    ("payload", "reason"),
    [(p, r) for _, p, r in REJECTED],
    ids=[name for name, _, _ in REJECTED],
)
def test_rejected(payload: object, reason: Reason) -> None:
    assert reason_of(frame(payload)) is reason


AUTH_REASONS = {
    Reason.UNSIGNED,
    Reason.BAD_SIGNATURE,
    Reason.STALE,
    Reason.REPLAYED,
    Reason.FORBIDDEN_ADDRESS,
    Reason.TOO_LARGE,
}


def test_every_decode_reason_is_exercised() -> None:
    # FRAMING is the server's (frame count), CAPACITY, UNSIGNED_CAPACITY, SIGNED_INSTANCE,
    # STATIC_CONFLICT and DISCOVERY_CONFLICT the table's, the authentication reasons
    # pdproxy.registry.auth's (tests/unit/test_registry_auth.py), the stats op's
    # tests/unit/test_stats_messages.py's.
    exercised = {r for _, _, r in REJECTED} | {r for _, _, r in REJECTED_BYTES}
    others = {Reason.FRAMING, Reason.CAPACITY, Reason.STATIC_CONFLICT} | AUTH_REASONS
    others |= {Reason.DISCOVERY_CONFLICT}
    others |= {Reason.UNSIGNED_CAPACITY, Reason.SIGNED_INSTANCE}
    others |= {Reason.BAD_STATS, Reason.BAD_TRANSFER, Reason.UNKNOWN_INSTANCE}
    assert exercised == set(Reason) - others


def test_type_is_checked_before_addresses() -> None:
    payload = {"type": "X", "http_address": "[::1]:1", "zmq_address": 5}
    assert reason_of(frame(payload)) is Reason.UNKNOWN_TYPE


def test_reason_details_are_short_for_huge_values() -> None:
    with pytest.raises(Rejected) as info:
        decode_frame(frame(with_(V1_FULL, op="x" * 100_000)))
    assert info.value.reason is Reason.UNKNOWN_OP
    assert len(str(info.value)) < 200


def _nested_array(depth: int) -> bytes:
    return b"\x91" * depth + b"\x00"  # [[[...[0]...]]], built by hand: packb refuses the depth


@pytest.mark.parametrize("key", ["v", "op"])
def test_deeply_nested_value_is_rejected_not_recursion_error(key: str) -> None:
    # msgpack itself accepts 1024 levels; the reason detail must not recurse through them.
    head = b"\x82\xa1v\x01\xa2op" if key == "op" else b"\x81\xa1v"
    data = head + _nested_array(1020)
    expected = Reason.UNKNOWN_OP if key == "op" else Reason.UNSUPPORTED_VERSION
    assert reason_of(data) is expected


# ---------------------------------------------------------------------------------------------
# properties: nothing but Rejected ever escapes


def _check_message(message: Message) -> None:
    if isinstance(message, Leave):
        validate_host(message.http_address.host)
        return
    assert isinstance(message, Announcement)
    assert message.version in (0, 1)
    assert message.role in (Role.PREFILL, Role.DECODE)
    for address in (message.http_address, message.zmq_address):
        validate_host(address.host)
        assert 1 <= address.port <= 65535
    if message.version == 0:
        assert (message.model, message.connector, message.geometry, message.load) == (None,) * 4
    if message.geometry is not None:
        g = message.geometry
        for value in (g.tp_size, g.block_size, g.num_layers, g.num_kv_heads, g.head_dim):
            assert value is None or (type(value) is int and value >= 1)
        assert g.kv_layout in (None, "NHD", "HND")
        assert g.is_mla in (None, True, False)
    if message.load is not None:
        assert message.load.kv_usage is None or 0.0 <= message.load.kv_usage <= 1.0
        for count in (message.load.running, message.load.waiting):
            assert count is None or (type(count) is int and count >= 0)


def _decode_or_reason(data: bytes) -> None:
    try:
        message = decode_frame(data)
    except Rejected as exc:
        assert isinstance(exc.reason, Reason)
        return
    _check_message(message)


@settings(PROFILE, max_examples=500)
@given(data=st.binary(max_size=256))
def test_arbitrary_bytes_only_reject(data: bytes) -> None:
    _decode_or_reason(data)


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=20),
    st.sampled_from(["P", "D", "announce", "leave", "10.0.0.5:8100", "h:0", "[::1]:1", "nixl"]),
)
values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(
            st.one_of(st.text(max_size=8), st.integers(-(2**63), 2**64 - 1)),
            children,
            max_size=4,
        ),
    ),
    max_leaves=20,
)


@settings(PROFILE, max_examples=250, suppress_health_check=[HealthCheck.too_slow])
@given(value=values)
def test_arbitrary_msgpack_values_only_reject(value: object) -> None:
    _decode_or_reason(frame(value))


def _maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(strategy, values)


# Near-valid v1 maps: each field either plausible or arbitrary, each optional.
near_valid = st.fixed_dictionaries(
    {},
    optional={
        "v": _maybe(st.just(1)),
        "op": _maybe(st.sampled_from(["announce", "leave"])),
        "type": _maybe(st.sampled_from(["P", "D"])),
        "http_address": _maybe(st.just("10.0.0.5:8100")),
        "zmq_address": _maybe(st.just("10.0.0.5:21001")),
        "model": _maybe(st.text(min_size=1, max_size=10)),
        "connector": _maybe(st.sampled_from([c.value for c in Connector])),
        "geometry": _maybe(
            st.fixed_dictionaries(
                {},
                optional={
                    "tp_size": _maybe(st.integers(1, 8)),
                    "block_size": _maybe(st.integers(1, 64)),
                    "num_layers": _maybe(st.integers(1, 80)),
                    "num_kv_heads": _maybe(st.integers(1, 64)),
                    "head_dim": _maybe(st.integers(1, 256)),
                    "kv_dtype": _maybe(st.sampled_from(["bfloat16", "fp8"])),
                    "is_mla": _maybe(st.booleans()),
                    "kv_layout": _maybe(st.sampled_from(["NHD", "HND"])),
                },
            )
        ),
        "load": _maybe(
            st.fixed_dictionaries(
                {},
                optional={
                    "running": _maybe(st.integers(0, 100)),
                    "waiting": _maybe(st.integers(0, 100)),
                    "kv_usage": _maybe(st.floats(0.0, 1.0)),
                },
            )
        ),
    },
)


@settings(PROFILE, max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(payload=near_valid)
def test_near_valid_maps_only_reject(payload: dict[str, Any]) -> None:
    _decode_or_reason(frame(payload))


valid_geometry = st.builds(
    Geometry,
    tp_size=st.none() | st.integers(1, MAX_TP_SIZE),
    block_size=st.none() | st.integers(1, 1024),
    num_layers=st.none() | st.integers(1, 200),
    num_kv_heads=st.none() | st.integers(1, 256),
    head_dim=st.none() | st.integers(1, 1024),
    kv_dtype=st.none() | st.text(min_size=1, max_size=32),
    is_mla=st.none() | st.booleans(),
    kv_layout=st.none() | st.sampled_from(["NHD", "HND"]),
)
valid_load = st.builds(
    Load,
    running=st.none() | st.integers(0, 2**32),
    waiting=st.none() | st.integers(0, 2**32),
    kv_usage=st.none() | st.floats(0.0, 1.0),
)


def _present(value: Geometry | Load) -> dict[str, Any]:
    items = ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
    return {name: item for name, item in items if item is not None}


@settings(PROFILE, max_examples=300)
@given(
    role=st.sampled_from(Role),
    http_port=st.integers(1, 65535),
    zmq_port=st.integers(1, 65535),
    model=st.none() | st.text(min_size=1, max_size=256),
    connector=st.none() | st.sampled_from(Connector),
    geometry=st.none() | valid_geometry,
    load=st.none() | valid_load,
)
def test_valid_v1_round_trips(
    role: Role,
    http_port: int,
    zmq_port: int,
    model: str | None,
    connector: Connector | None,
    geometry: Geometry | None,
    load: Load | None,
) -> None:
    payload: dict[str, Any] = {
        "v": 1,
        "type": role.wire,
        "http_address": f"worker-1.svc:{http_port}",
        "zmq_address": f"10.1.2.3:{zmq_port}",
    }
    if model is not None:
        payload["model"] = model
    if connector is not None:
        payload["connector"] = connector.value
        payload["kv_coordinates"] = COORDINATES
    if geometry is not None:
        payload["geometry"] = _present(geometry)
    if load is not None:
        payload["load"] = _present(load)
    assert decode_frame(frame(payload)) == Announcement(
        version=1,
        role=role,
        http_address=Address("worker-1.svc", http_port),
        zmq_address=Address("10.1.2.3", zmq_port),
        model=model,
        connector=connector,
        geometry=geometry,
        load=load,
        coordinates=None if connector is None else COORDINATES_READ,
    )


# ---------------------------------------------------------------------------------------------
# max_model_len: the context length an instance runs its model with (optional, v1 only)


@pytest.mark.parametrize("value", [1, 512, 131072, MAX_MODEL_LEN])
def test_v1_max_model_len(value: int) -> None:
    message = decode_frame(frame(with_(V1_FULL, max_model_len=value)))
    assert isinstance(message, Announcement)
    assert message.max_model_len == value


def test_max_model_len_absent_or_null_is_unknown_and_v0_never_has_one() -> None:
    for payload in (V1_FULL, with_(V1_FULL, max_model_len=None)):
        message = decode_frame(frame(payload))
        assert isinstance(message, Announcement) and message.max_model_len is None
    message = decode_frame(frame(with_(V0, max_model_len=4096)))
    assert isinstance(message, Announcement) and message.max_model_len is None


@pytest.mark.parametrize(
    "value", [0, -1, MAX_MODEL_LEN + 1, 2**64 - 1, True, 4096.0, "4096", [4096], {"n": 1}]
)
def test_bad_max_model_len_is_refused(value: object) -> None:
    with pytest.raises(Rejected) as info:
        decode_frame(frame(with_(V1_MINIMAL, max_model_len=value)))
    assert info.value.reason is Reason.WRONG_TYPE
    assert "max_model_len" in info.value.detail
