"""The registry's "stats" op: decoding, every way it is refused, and the worker's builder
round-tripping through the proxy's decoder (plain and signed)."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdproxy.base.roles import Role
from pdproxy.ids import Address, parse_address
from pdproxy.registry.auth import RegistryGate, Verifier, new_nonce, signed
from pdproxy.registry.messages import (
    MAX_TP_SIZE,
    MAX_TRANSFER_COUNT,
    MAX_TRANSFERS,
    Reason,
    Rejected,
    Stats,
    TransferOutcome,
    TransferReport,
    decode_frame,
    parse_transfer,
)
from pdproxy.vllm_side.announcement import TransferStat, stats_message

PROFILE = settings(derandomize=True, database=None, deadline=None)
UID = "0123456789abcdef0123456789abcdef"
TRANSFER: dict[str, Any] = {
    "id": f"{UID}-0",
    "peer": "10.0.0.7:8200",
    "bytes": 4096,
    "blocks": 2,
    "seconds": 0.0125,
    "outcome": "ok",
}
STATS: dict[str, Any] = {
    "v": 1,
    "op": "stats",
    "type": "P",
    "http_address": "10.0.0.6:8100",
    "rank": 0,
    "ranks": 2,
    "transfers": [TRANSFER],
}


def frame(value: object) -> bytes:
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


def with_(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**base, **changes}


def without(base: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in base.items() if k != key}


def with_transfer(**changes: Any) -> dict[str, Any]:
    return with_(STATS, transfers=[with_(TRANSFER, **changes)])


def without_transfer_field(key: str) -> dict[str, Any]:
    return with_(STATS, transfers=[without(TRANSFER, key)])


def reason_of(payload: object) -> Reason:
    with pytest.raises(Rejected) as info:
        decode_frame(frame(payload))
    assert info.value.detail
    return info.value.reason


def test_a_stats_message_decodes() -> None:
    assert decode_frame(frame(STATS)) == Stats(
        role=Role.PREFILL,
        http_address=Address("10.0.0.6", 8100),
        rank=0,
        ranks=2,
        transfers=(
            TransferReport(
                f"{UID}-0", Address("10.0.0.7", 8200), 4096, 2, 0.0125, TransferOutcome.OK
            ),
        ),
    )


def test_unknown_fields_are_ignored_at_both_levels() -> None:
    payload = with_(STATS, zmq_address="10.0.0.6:21001", extra={"a": 1}, transfers=[])
    payload["transfers"] = [with_(TRANSFER, layer_count=32, note="x")]
    decoded = decode_frame(frame(payload))
    assert decoded == decode_frame(frame(STATS))


def test_an_empty_report_and_integer_seconds() -> None:
    empty = decode_frame(frame(with_(STATS, transfers=[])))
    assert isinstance(empty, Stats) and empty.transfers == ()
    decoded = decode_frame(frame(with_transfer(seconds=3)))
    assert isinstance(decoded, Stats)
    assert decoded.transfers[0].seconds == 3.0
    assert type(decoded.transfers[0].seconds) is float


@pytest.mark.parametrize("outcome", list(TransferOutcome))
def test_every_outcome(outcome: TransferOutcome) -> None:
    decoded = decode_frame(frame(with_transfer(outcome=outcome.value)))
    assert isinstance(decoded, Stats) and decoded.transfers[0].outcome is outcome


def test_limits_are_inclusive() -> None:
    at_limit = with_(
        STATS,
        rank=MAX_TP_SIZE - 1,
        ranks=MAX_TP_SIZE,
        transfers=[
            with_(
                TRANSFER,
                id=f"{UID}-{'a' * 63}",
                bytes=MAX_TRANSFER_COUNT,
                blocks=MAX_TRANSFER_COUNT,
                seconds=0,
            )
        ]
        * MAX_TRANSFERS,
    )
    decoded = decode_frame(frame(at_limit))
    assert isinstance(decoded, Stats) and len(decoded.transfers) == MAX_TRANSFERS
    assert decode_frame(frame(with_transfer(id=f"{UID}-")))  # an empty suffix is a suffix
    suffixes = f"{UID}-A.z_0-9"
    assert decode_frame(frame(with_transfer(id=suffixes)))


def test_a_peer_may_be_a_host_name() -> None:
    decoded = decode_frame(frame(with_transfer(peer="decode-0.pd.svc:22001")))
    assert isinstance(decoded, Stats)
    assert decoded.transfers[0].peer == Address("decode-0.pd.svc", 22001)


REJECTED: list[tuple[str, dict[str, Any], Reason]] = [
    # the envelope
    ("no type", without(STATS, "type"), Reason.MISSING_FIELD),
    ("type X", with_(STATS, type="X"), Reason.UNKNOWN_TYPE),
    ("type int", with_(STATS, type=1), Reason.WRONG_TYPE),
    ("no http_address", without(STATS, "http_address"), Reason.MISSING_FIELD),
    ("http_address ipv6", with_(STATS, http_address="[::1]:80"), Reason.BAD_ADDRESS),
    ("http_address port 0", with_(STATS, http_address="h:0"), Reason.BAD_ADDRESS),
    ("no rank", without(STATS, "rank"), Reason.MISSING_FIELD),
    ("no ranks", without(STATS, "ranks"), Reason.MISSING_FIELD),
    ("no transfers", without(STATS, "transfers"), Reason.MISSING_FIELD),
    ("ranks 0", with_(STATS, ranks=0, rank=0), Reason.BAD_STATS),
    ("ranks above the TP cap", with_(STATS, ranks=MAX_TP_SIZE + 1), Reason.BAD_STATS),
    ("ranks bool", with_(STATS, ranks=True), Reason.BAD_STATS),
    ("ranks float", with_(STATS, ranks=2.0), Reason.BAD_STATS),
    ("ranks null", with_(STATS, ranks=None), Reason.BAD_STATS),
    ("rank = ranks", with_(STATS, rank=2), Reason.BAD_STATS),
    ("rank negative", with_(STATS, rank=-1), Reason.BAD_STATS),
    ("rank bool", with_(STATS, rank=False), Reason.BAD_STATS),
    ("rank str", with_(STATS, rank="0"), Reason.BAD_STATS),
    ("transfers a map", with_(STATS, transfers={"a": TRANSFER}), Reason.BAD_STATS),
    ("transfers a string", with_(STATS, transfers="x"), Reason.BAD_STATS),
    ("too many transfers", with_(STATS, transfers=[TRANSFER] * 257), Reason.BAD_STATS),
    # one transfer
    ("transfer a list", with_(STATS, transfers=[[1, 2]]), Reason.BAD_TRANSFER),
    ("transfer null", with_(STATS, transfers=[None]), Reason.BAD_TRANSFER),
    ("second transfer bad", with_(STATS, transfers=[TRANSFER, 5]), Reason.BAD_TRANSFER),
    ("no id", without_transfer_field("id"), Reason.BAD_TRANSFER),
    ("id int", with_transfer(id=5), Reason.BAD_TRANSFER),
    ("id uppercase hex", with_transfer(id=f"{UID.upper()}-0"), Reason.BAD_TRANSFER),
    ("id 31 hex", with_transfer(id=f"{UID[:-1]}-0"), Reason.BAD_TRANSFER),
    ("id 33 hex", with_transfer(id=f"{UID}0-0"), Reason.BAD_TRANSFER),
    ("id without dash", with_transfer(id=UID), Reason.BAD_TRANSFER),
    ("id suffix 64", with_transfer(id=f"{UID}-{'a' * 64}"), Reason.BAD_TRANSFER),
    ("id suffix slash", with_transfer(id=f"{UID}-a/b"), Reason.BAD_TRANSFER),
    ("id suffix space", with_transfer(id=f"{UID}-a b"), Reason.BAD_TRANSFER),
    ("id suffix newline", with_transfer(id=f"{UID}-a\n"), Reason.BAD_TRANSFER),
    ("id non-ascii", with_transfer(id=f"{UID}-é"), Reason.BAD_TRANSFER),
    ("id bytes", with_transfer(id=f"{UID}-0".encode()), Reason.BAD_TRANSFER),
    ("no peer", without_transfer_field("peer"), Reason.BAD_TRANSFER),
    ("peer int", with_transfer(peer=8200), Reason.BAD_TRANSFER),
    ("peer without port", with_transfer(peer="10.0.0.7"), Reason.BAD_TRANSFER),
    ("peer ipv6", with_transfer(peer="[::1]:8200"), Reason.BAD_TRANSFER),
    ("peer port 70000", with_transfer(peer="10.0.0.7:70000"), Reason.BAD_TRANSFER),
    ("no bytes", without_transfer_field("bytes"), Reason.BAD_TRANSFER),
    ("bytes negative", with_transfer(bytes=-1), Reason.BAD_TRANSFER),
    ("bytes float", with_transfer(bytes=1.0), Reason.BAD_TRANSFER),
    ("bytes bool", with_transfer(bytes=True), Reason.BAD_TRANSFER),
    ("bytes str", with_transfer(bytes="1"), Reason.BAD_TRANSFER),
    ("bytes above 2**53", with_transfer(bytes=MAX_TRANSFER_COUNT + 1), Reason.BAD_TRANSFER),
    ("bytes uint64 max", with_transfer(bytes=2**64 - 1), Reason.BAD_TRANSFER),
    ("no blocks", without_transfer_field("blocks"), Reason.BAD_TRANSFER),
    ("blocks negative", with_transfer(blocks=-2), Reason.BAD_TRANSFER),
    ("blocks null", with_transfer(blocks=None), Reason.BAD_TRANSFER),
    ("blocks above 2**53", with_transfer(blocks=MAX_TRANSFER_COUNT + 1), Reason.BAD_TRANSFER),
    ("no seconds", without_transfer_field("seconds"), Reason.BAD_TRANSFER),
    ("seconds NaN", with_transfer(seconds=math.nan), Reason.BAD_TRANSFER),
    ("seconds inf", with_transfer(seconds=math.inf), Reason.BAD_TRANSFER),
    ("seconds -inf", with_transfer(seconds=-math.inf), Reason.BAD_TRANSFER),
    ("seconds negative", with_transfer(seconds=-0.001), Reason.BAD_TRANSFER),
    ("seconds bool", with_transfer(seconds=True), Reason.BAD_TRANSFER),
    ("seconds str", with_transfer(seconds="0.1"), Reason.BAD_TRANSFER),
    ("no outcome", without_transfer_field("outcome"), Reason.BAD_TRANSFER),
    ("outcome unknown", with_transfer(outcome="incomplete"), Reason.BAD_TRANSFER),
    ("outcome upper", with_transfer(outcome="OK"), Reason.BAD_TRANSFER),
    ("outcome int", with_transfer(outcome=0), Reason.BAD_TRANSFER),
    ("outcome null", with_transfer(outcome=None), Reason.BAD_TRANSFER),
]


@pytest.mark.parametrize(
    ("payload", "reason"),
    [(p, r) for _, p, r in REJECTED],
    ids=[name for name, _, _ in REJECTED],
)
def test_rejected(payload: dict[str, Any], reason: Reason) -> None:
    assert reason_of(payload) is reason


def test_both_stats_reasons_are_exercised() -> None:
    # UNKNOWN_INSTANCE is the server's (tests/unit/test_registry_stats.py).
    assert {Reason.BAD_STATS, Reason.BAD_TRANSFER} <= {r for _, _, r in REJECTED}


def test_a_bad_transfer_is_named_by_its_index() -> None:
    with pytest.raises(Rejected) as info:
        decode_frame(frame(with_(STATS, transfers=[TRANSFER, TRANSFER, "x"])))
    assert "transfers[2]" in info.value.detail


def test_stats_is_a_v1_op_only() -> None:
    # Without "v" a map is v0, which has no op: the stats fields make it an incomplete v0.
    assert reason_of(without(STATS, "v")) is Reason.MISSING_FIELD  # no zmq_address
    assert reason_of(with_(STATS, v=2)) is Reason.UNSUPPORTED_VERSION
    assert reason_of(with_(STATS, op="Stats")) is Reason.UNKNOWN_OP


# -- hostile input ------------------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=70),
    st.binary(max_size=8),
)


def _maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(strategy, scalars, st.lists(scalars, max_size=2))


near_valid_transfer = st.fixed_dictionaries(
    {},
    optional={
        "id": _maybe(st.sampled_from([f"{UID}-0", f"{UID}-chat", UID])),
        "peer": _maybe(st.sampled_from(["10.0.0.7:8200", "h:1", "[::1]:1"])),
        "bytes": _maybe(st.integers(0, MAX_TRANSFER_COUNT)),
        "blocks": _maybe(st.integers(0, 1000)),
        "seconds": _maybe(st.floats(0, 100)),
        "outcome": _maybe(st.sampled_from([o.value for o in TransferOutcome])),
    },
)
near_valid = st.fixed_dictionaries(
    {"v": st.just(1), "op": st.just("stats")},
    optional={
        "type": _maybe(st.sampled_from(["P", "D"])),
        "http_address": _maybe(st.just("10.0.0.6:8100")),
        "rank": _maybe(st.integers(0, 8)),
        "ranks": _maybe(st.integers(1, 8)),
        "transfers": _maybe(st.lists(_maybe(near_valid_transfer), max_size=4)),
    },
)


@settings(PROFILE, max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(payload=near_valid)
def test_near_valid_stats_decode_to_valid_values_or_reject(payload: dict[str, Any]) -> None:
    try:
        message = decode_frame(frame(payload))
    except Rejected as exc:
        assert isinstance(exc.reason, Reason) and exc.detail
        return
    assert isinstance(message, Stats)
    assert 0 <= message.rank < message.ranks <= MAX_TP_SIZE
    assert len(message.transfers) <= MAX_TRANSFERS
    for transfer in message.transfers:
        assert type(transfer.bytes) is int and 0 <= transfer.bytes <= MAX_TRANSFER_COUNT
        assert type(transfer.blocks) is int and 0 <= transfer.blocks <= MAX_TRANSFER_COUNT
        assert type(transfer.seconds) is float and math.isfinite(transfer.seconds)
        assert transfer.seconds >= 0
        assert isinstance(transfer.outcome, TransferOutcome)
        assert transfer.transfer_id.startswith(UID + "-")


# -- the worker's builder -----------------------------------------------------------------------

stats_entries = st.builds(
    TransferStat,
    transfer_id=st.from_regex(r"[0-9a-f]{32}-[A-Za-z0-9_.-]{0,63}", fullmatch=True),
    peer=st.sampled_from(["10.0.0.7:8200", "decode-3.svc:22001", "127.0.0.1:1"]),
    bytes=st.integers(0, MAX_TRANSFER_COUNT),
    blocks=st.integers(0, MAX_TRANSFER_COUNT),
    seconds=st.floats(0, 1e6) | st.integers(0, 10),
    outcome=st.sampled_from(["ok", "timeout", "error", "missing", "dropped"]),
)


@settings(PROFILE, max_examples=200)
@given(
    role=st.sampled_from(Role),
    ranks=st.integers(1, MAX_TP_SIZE),
    data=st.data(),
    entries=st.lists(stats_entries, max_size=12),
)
def test_the_builder_round_trips(
    role: Role, ranks: int, data: st.DataObject, entries: list[TransferStat]
) -> None:
    rank = data.draw(st.integers(0, ranks - 1))
    message = stats_message(role, "worker-1.svc:8100", rank, ranks, entries)
    decoded = decode_frame(frame(message))
    assert decoded == Stats(
        role,
        Address("worker-1.svc", 8100),
        rank,
        ranks,
        tuple(
            TransferReport(
                e.transfer_id,
                parse_address(e.peer),
                e.bytes,
                e.blocks,
                float(e.seconds),
                TransferOutcome(e.outcome),
            )
            for e in entries
        ),
    )
    for entry in entries:  # what the reporter checks each entry with
        assert parse_transfer(entry.as_map()).transfer_id == entry.transfer_id


def test_the_builder_refuses_what_no_entry_could_fix() -> None:
    entry = TransferStat(f"{UID}-0", "10.0.0.7:8200", 1, 1, 0.1)
    with pytest.raises(ValueError, match="rank"):
        stats_message(Role.PREFILL, "h:1", 2, 2, [entry])
    with pytest.raises(ValueError, match="rank"):
        stats_message(Role.PREFILL, "h:1", 0, MAX_TP_SIZE + 1, [entry])
    with pytest.raises(ValueError, match="transfers"):
        stats_message(Role.PREFILL, "h:1", 0, 1, [entry] * (MAX_TRANSFERS + 1))
    assert (
        len(stats_message(Role.PREFILL, "h:1", 0, 1, [entry] * MAX_TRANSFERS)["transfers"]) == 256
    )


def test_a_signed_report_passes_the_gate_and_a_forged_one_does_not() -> None:
    key = b"stats-secret-0123456789"
    gate = RegistryGate(Verifier(key))
    message = stats_message(
        Role.DECODE, "10.0.0.8:8200", 0, 1, [TransferStat(f"{UID}-0", "h:1", 1, 1, 0)]
    )
    sealed = frame(signed(message, key, 1000.0, new_nonce()))
    assert gate.admit(sealed, 1000.0).message == decode_frame(sealed)
    with pytest.raises(Rejected) as info:
        gate.admit(frame(message), 1000.0)
    assert info.value.reason is Reason.UNSIGNED
    forged = signed(message, key, 1000.0, new_nonce())
    forged["transfers"][0]["bytes"] = 10**9  # more bytes than were signed for
    with pytest.raises(Rejected) as info:
        gate.admit(frame(forged), 1000.0)
    assert info.value.reason is Reason.BAD_SIGNATURE
