"""pdproxy.registry.auth: signing, verification, replay cache, address policy."""

from __future__ import annotations

import hmac
import ipaddress
from typing import Any

import msgpack
import pytest

from pdproxy.base.roles import Role
from pdproxy.registry import auth
from pdproxy.registry.auth import (
    RegistryGate,
    Verifier,
    address_allowed,
    canonical,
    parse_cidrs,
    read_head,
    sign,
    signed,
)
from pdproxy.registry.messages import Reason, Rejected, decode_frame, parse_message
from pdproxy.vllm_side.announcement import WorkerIdentity, announce_message, leave_message

SECRET = b"0123456789abcdef-unit"
NOW = 1_700_000_000.0
IDENTITY = WorkerIdentity(
    Role.DECODE, "10.0.0.6:20002", "10.0.0.6:22001", model="m", connector="nixl"
)
MESSAGE = announce_message(IDENTITY)


def nonce(i: int = 0) -> str:
    return f"{i:032x}"


def rejected(verifier: Verifier, message: dict[str, Any], now: float = NOW) -> Reason:
    with pytest.raises(Rejected) as info:
        verifier.verify(message, now)
    return info.value.reason


def test_canonical_ignores_key_order_and_auth() -> None:
    a = {"b": 1, "a": {"y": [1, {"q": 2, "p": 3}], "x": 2}}
    b = {"a": {"x": 2, "y": [1, {"p": 3, "q": 2}]}, "b": 1}
    assert canonical(a) == canonical(b) == canonical({**b, "auth": {"mac": "x"}})
    assert canonical(a) != canonical({**a, "b": 2})


def test_round_trip_through_the_wire() -> None:
    frame = msgpack.packb(signed(MESSAGE, SECRET, NOW, nonce()))
    payload = msgpack.unpackb(frame, raw=False)
    Verifier(SECRET).verify(payload, NOW + 1)
    assert decode_frame(frame) == parse_message(MESSAGE)  # "auth" is ignored by the decoder
    value = payload["auth"]
    assert set(value) == {"ts", "nonce", "mac"} and isinstance(value["ts"], float)
    assert len(value["mac"]) == 64 and value["nonce"] == nonce()


def test_leave_round_trip() -> None:
    Verifier(SECRET).verify(signed(leave_message(IDENTITY), SECRET, NOW, nonce()), NOW)


def test_new_nonce_is_32_hex() -> None:
    first, second = auth.new_nonce(), auth.new_nonce()
    assert len(first) == 32 and int(first, 16) >= 0 and first != second


@pytest.mark.parametrize(
    ("field", "value"),
    [("http_address", "10.0.0.7:20002"), ("type", "P"), ("model", "other"), ("extra", 1)],
)
def test_a_tampered_field_is_refused(field: str, value: Any) -> None:
    message = {**signed(MESSAGE, SECRET, NOW, nonce()), field: value}
    assert rejected(Verifier(SECRET), message) is Reason.BAD_SIGNATURE


@pytest.mark.parametrize("key", ["ts", "nonce"])
def test_a_tampered_stamp_is_refused(key: str) -> None:
    message = signed(MESSAGE, SECRET, NOW, nonce())
    value = NOW + 1 if key == "ts" else nonce(9)
    message["auth"] = {**message["auth"], key: value}
    assert rejected(Verifier(SECRET), message) is Reason.BAD_SIGNATURE


def test_a_wrong_secret_is_refused() -> None:
    message = signed(MESSAGE, b"another-secret-of-16", NOW, nonce())
    assert rejected(Verifier(SECRET), message) is Reason.BAD_SIGNATURE


@pytest.mark.parametrize(
    "value",
    [
        "not a map",
        {"ts": NOW, "nonce": nonce()},
        {"ts": "now", "nonce": nonce(), "mac": "0" * 64},
        {"ts": True, "nonce": nonce(), "mac": "0" * 64},
        {"ts": float("nan"), "nonce": nonce(), "mac": "0" * 64},
        {"ts": NOW, "nonce": "xyz", "mac": "0" * 64},
        {"ts": NOW, "nonce": nonce(), "mac": "0" * 63},
        {"ts": NOW, "nonce": nonce(), "mac": "G" * 64},
    ],
)
def test_a_malformed_auth_is_refused(value: Any) -> None:
    assert rejected(Verifier(SECRET), {**MESSAGE, "auth": value}) is Reason.BAD_SIGNATURE


def test_unsigned_is_refused() -> None:
    assert rejected(Verifier(SECRET), MESSAGE) is Reason.UNSIGNED


@pytest.mark.parametrize("offset", [-30.5, 30.5, -3600.0, 1e9])
def test_stale_and_future_timestamps_are_refused(offset: float) -> None:
    message = signed(MESSAGE, SECRET, NOW + offset, nonce())
    assert rejected(Verifier(SECRET, max_skew_s=30), message) is Reason.STALE


@pytest.mark.parametrize("offset", [-29.9, 29.9])
def test_timestamps_within_the_skew_pass(offset: float) -> None:
    Verifier(SECRET, max_skew_s=30).verify(signed(MESSAGE, SECRET, NOW + offset, nonce()), NOW)


def test_a_replay_is_accepted_once() -> None:
    verifier = Verifier(SECRET, max_skew_s=30)
    message = signed(MESSAGE, SECRET, NOW, nonce())
    verifier.verify(message, NOW)
    assert rejected(verifier, message, NOW + 1) is Reason.REPLAYED
    assert rejected(verifier, message, NOW + 29) is Reason.REPLAYED
    assert rejected(verifier, message, NOW + 31) is Reason.STALE  # and then forgotten
    assert verifier.remembered == 0


def test_a_forged_message_does_not_burn_its_nonce() -> None:
    verifier = Verifier(SECRET)
    good = signed(MESSAGE, SECRET, NOW, nonce())
    forged = {**good, "auth": {**good["auth"], "mac": "0" * 64}}
    assert rejected(verifier, forged) is Reason.BAD_SIGNATURE
    verifier.verify(good, NOW)


def test_the_nonce_cache_is_bounded_and_evicted_by_time() -> None:
    verifier = Verifier(SECRET, max_skew_s=30, nonce_capacity=3)
    messages = [signed(MESSAGE, SECRET, NOW + i, nonce(i)) for i in range(5)]
    for i, message in enumerate(messages):
        verifier.verify(message, NOW + i)
        assert verifier.remembered <= 3
    # The two forgotten early are not replayable: anything that old is now refused.
    assert rejected(verifier, messages[0], NOW + 5) is Reason.STALE
    assert rejected(verifier, messages[1], NOW + 5) is Reason.STALE
    assert rejected(verifier, messages[4], NOW + 5) is Reason.REPLAYED
    verifier.verify(signed(MESSAGE, SECRET, NOW + 40, nonce(7)), NOW + 40)
    assert verifier.remembered == 1  # the others left the window


def test_the_mac_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str]] = []
    real = hmac.compare_digest

    def spy(a: str, b: str) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    Verifier(SECRET).verify(signed(MESSAGE, SECRET, NOW, nonce()), NOW)
    assert len(calls) == 1


def test_a_deeply_nested_message_is_refused_not_crashed() -> None:
    deep: Any = 1
    for _ in range(5000):
        deep = [deep]
    message = {**MESSAGE, "deep": deep, "auth": {"ts": NOW, "nonce": nonce(), "mac": "0" * 64}}
    assert rejected(Verifier(SECRET), message) is Reason.BAD_SIGNATURE


def test_the_secret_is_not_in_repr() -> None:
    assert "0123456789" not in repr(Verifier(SECRET))


def test_sign_refuses_an_empty_secret() -> None:
    with pytest.raises(auth.AuthConfigError):
        sign(MESSAGE, b"", NOW, nonce())
    with pytest.raises(auth.AuthConfigError):
        Verifier(b"")


# -- addresses ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "cidrs", "allowed"),
    [
        ("10.1.2.3", ["10.0.0.0/8"], True),
        ("11.1.2.3", ["10.0.0.0/8"], False),
        ("192.168.1.1", ["10.0.0.0/8", "192.168.0.0/16"], True),
        ("fd00::5", ["fd00::/8"], True),
        ("fe80::1", ["fd00::/8"], False),
        ("10.1.2.3", ["fd00::/8"], False),
        ("169.254.169.254", ["10.0.0.0/8"], False),
    ],
)
def test_address_in_cidrs(host: str, cidrs: list[str], allowed: bool) -> None:
    assert address_allowed(host, parse_cidrs(cidrs))[0] is allowed


def test_a_host_name_is_refused_with_a_reason() -> None:
    allowed, why = address_allowed("metadata.internal", parse_cidrs(["0.0.0.0/0"]))
    assert not allowed and "host name" in why and "IP literal" in why


@pytest.mark.parametrize("text", ["10.0.0.1/8", "nonsense", "10.0.0.0/33", ""])
def test_bad_cidrs_are_named(text: str) -> None:
    with pytest.raises(auth.AuthConfigError, match="bad CIDR"):
        parse_cidrs([text])


def test_parse_cidrs() -> None:
    assert parse_cidrs([" 10.0.0.0/8", "fd00::/8"]) == (
        ipaddress.ip_network("10.0.0.0/8"),
        ipaddress.ip_network("fd00::/8"),
    )


# -- the gate -------------------------------------------------------------------------------

V0 = {"type": "P", "http_address": "10.0.0.5:20001", "zmq_address": "10.0.0.5:21001"}


def check(gate: RegistryGate, payload: dict[str, Any], now: float = NOW) -> Reason | None:
    try:
        admitted = gate.admit(msgpack.packb(payload), now)
    except Rejected as exc:
        return exc.reason
    assert admitted.message == parse_message(payload)
    return None


def test_without_a_secret_everything_passes() -> None:
    gate = RegistryGate()
    assert check(gate, V0) is None and check(gate, MESSAGE) is None


def test_with_a_secret_v1_must_be_signed_and_v0_needs_allowance() -> None:
    strict = RegistryGate(Verifier(SECRET))
    assert check(strict, MESSAGE) is Reason.UNSIGNED
    assert check(strict, leave_message(IDENTITY)) is Reason.UNSIGNED
    assert check(strict, V0) is Reason.UNSIGNED
    assert check(strict, signed(MESSAGE, SECRET, NOW, nonce())) is None
    lenient = RegistryGate(Verifier(SECRET), allow_unsigned_v0=True)
    assert check(lenient, V0) is None


def test_v0_cidrs() -> None:
    gate = RegistryGate(Verifier(SECRET), True, v0_cidrs=parse_cidrs(["10.0.0.0/24"]))
    assert check(gate, V0) is None
    outside = {**V0, "zmq_address": "10.0.1.5:21001"}
    assert check(gate, outside) is Reason.FORBIDDEN_ADDRESS
    # v1 is not held to the v0 networks
    moved = {**MESSAGE, "http_address": "10.9.0.6:20002"}
    assert check(gate, signed(moved, SECRET, NOW, nonce())) is None


def test_address_cidrs_apply_to_every_announcement() -> None:
    gate = RegistryGate(None, address_cidrs=parse_cidrs(["10.0.0.0/8"]))
    assert check(gate, V0) is None and check(gate, MESSAGE) is None
    assert check(gate, {**V0, "http_address": "169.254.169.254:80"}) is Reason.FORBIDDEN_ADDRESS
    assert check(gate, {**MESSAGE, "zmq_address": "evil.example:1"}) is Reason.FORBIDDEN_ADDRESS
    assert check(gate, {**leave_message(IDENTITY), "http_address": "8.8.8.8:1"}) is None


# -- frames: the MAC is checked before the frame is decoded ---------------------------------


def admit(gate: RegistryGate, frame: bytes, now: float = NOW) -> Reason | None:
    try:
        gate.admit(frame, now)
    except Rejected as exc:
        return exc.reason
    return None


def old_signed(message: dict[str, Any], secret: bytes = SECRET, i: int = 0) -> bytes:
    """What workers before canonical ordering sent: fields as built, "auth" last."""
    frame: bytes = msgpack.packb({**message, "auth": sign(message, secret, NOW, nonce(i))})
    return frame


def test_a_signed_frame_is_canonical_but_for_its_auth_field() -> None:
    """So an earlier proxy, which re-encodes canonically, verifies what this signer sends."""
    frame = msgpack.packb(signed(MESSAGE, SECRET, NOW, nonce()))
    head = read_head(frame)
    assert b"".join(head.unsigned_parts(frame)) == canonical(MESSAGE)
    assert list(msgpack.unpackb(frame))[-1] == "auth"
    Verifier(SECRET).verify(msgpack.unpackb(frame), NOW)  # the dict-level (old) check agrees


class DecodeSpy:
    """Records the size of everything msgpack decodes or encodes whole (not the head's walk,
    which skips over values without building them)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.decoded: list[int] = []
        self.encoded: list[int] = []
        unpackb, packb = msgpack.unpackb, msgpack.packb

        def spy_unpackb(data: bytes, *args: Any, **kwargs: Any) -> Any:
            self.decoded.append(len(data))
            return unpackb(data, *args, **kwargs)

        def spy_packb(value: Any, *args: Any, **kwargs: Any) -> Any:
            packed = packb(value, *args, **kwargs)
            self.encoded.append(len(packed))
            return packed

        monkeypatch.setattr(msgpack, "unpackb", spy_unpackb)
        monkeypatch.setattr(msgpack, "packb", spy_packb)


def big_message(items: int = 20_000) -> dict[str, Any]:
    return {**MESSAGE, "extra": [{}] * items}  # ~20 KiB of empty maps: dear to canonicalise


def test_a_forged_frame_is_refused_without_decoding_its_body(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate = RegistryGate(Verifier(SECRET))
    forged = msgpack.packb(signed(big_message(), b"not-the-registry-secret", NOW, nonce()))
    assert len(forged) > 20_000
    spy = DecodeSpy(monkeypatch)
    assert admit(gate, forged) is Reason.BAD_SIGNATURE
    # Only short keys, "v" and the "auth" value were decoded; nothing was re-encoded but the
    # 44-byte stamp.
    assert spy.decoded and max(spy.decoded) <= auth.MAX_AUTH_BYTES
    assert max(spy.encoded) <= 64


def test_a_large_signed_frame_is_decoded_once_and_never_reencoded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate = RegistryGate(Verifier(SECRET))
    frame = msgpack.packb(signed(big_message(), SECRET, NOW, nonce()))
    spy = DecodeSpy(monkeypatch)
    admitted = gate.admit(frame, NOW)
    assert admitted.signed and admitted.message == parse_message(MESSAGE)
    assert [size for size in spy.decoded if size > auth.MAX_AUTH_BYTES] == [len(frame)]
    assert max(spy.encoded) <= 64


def test_the_auth_field_may_stand_anywhere_in_the_frame() -> None:
    message = signed(MESSAGE, SECRET, NOW, nonce())
    first = {"auth": message.pop("auth"), **message}
    assert admit(RegistryGate(Verifier(SECRET)), msgpack.packb(first)) is None


def test_frames_of_earlier_signers_verify_up_to_the_legacy_bounds() -> None:
    gate = RegistryGate(Verifier(SECRET))
    frame = old_signed(MESSAGE)
    head = read_head(frame)
    assert b"".join(head.unsigned_parts(frame)) != canonical(MESSAGE)  # not canonical order
    assert admit(gate, frame) is None
    assert admit(gate, frame) is Reason.REPLAYED
    # Beyond LEGACY_ELEMENTS items, or LEGACY_FRAME_BYTES, only canonical order verifies.
    many = {**MESSAGE, "extra": [0] * auth.LEGACY_ELEMENTS}
    assert len(old_signed(many, i=1)) <= auth.LEGACY_FRAME_BYTES
    assert admit(gate, old_signed(many, i=1)) is Reason.BAD_SIGNATURE
    assert admit(gate, msgpack.packb(signed(many, SECRET, NOW, nonce(2)))) is None
    large = {**MESSAGE, "extra": "x" * auth.LEGACY_FRAME_BYTES}
    with pytest.raises(Rejected, match="older than the proxy"):
        gate.admit(old_signed(large, i=3), NOW)
    assert admit(gate, msgpack.packb(signed(large, SECRET, NOW, nonce(4)))) is None


def test_a_signed_frame_the_decoder_refuses_keeps_its_nonce() -> None:
    """Refused the same way each time, as when decoding came first."""
    gate = RegistryGate(Verifier(SECRET))
    frame = msgpack.packb(signed({**MESSAGE, "type": "X"}, SECRET, NOW, nonce()))
    assert admit(gate, frame) is Reason.UNKNOWN_TYPE
    assert admit(gate, frame) is Reason.UNKNOWN_TYPE


def test_forged_auth_values_are_refused_before_any_mac() -> None:
    gate = RegistryGate(Verifier(SECRET))
    stale = msgpack.packb(signed(big_message(), b"not-the-registry-secret", NOW - 60, nonce()))
    assert admit(gate, stale) is Reason.STALE
    padded = {"ts": NOW, "nonce": nonce(), "mac": "0" * 64, "pad": "x" * auth.MAX_AUTH_BYTES}
    with pytest.raises(Rejected, match="'auth' is over") as info:
        gate.admit(msgpack.packb({**MESSAGE, "auth": padded}), NOW)
    assert info.value.reason is Reason.BAD_SIGNATURE


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (b"", Reason.NOT_MSGPACK),
        (b"\xc1", Reason.NOT_MSGPACK),
        (msgpack.packb([1, 2]), Reason.NOT_A_MAP),
        (msgpack.packb(MESSAGE) + b"\x00", Reason.NOT_MSGPACK),
        (msgpack.packb(MESSAGE)[:-3], Reason.NOT_MSGPACK),
        (msgpack.packb({f"k{i}": i for i in range(auth.MAX_FIELDS + 1)}), Reason.TOO_LARGE),
        # Two "auth" fields: which one a decoder keeps is not for a forger to choose.
        (b"\x82\xa4auth\x01\xa4auth\x02", Reason.BAD_SIGNATURE),
        (msgpack.packb({**MESSAGE, "v": "1" * 40}), Reason.UNSUPPORTED_VERSION),
        (msgpack.packb({**MESSAGE, "v": 2}), Reason.UNSUPPORTED_VERSION),
    ],
)
def test_the_head_refuses_what_it_cannot_walk(frame: bytes, reason: Reason) -> None:
    assert admit(RegistryGate(Verifier(SECRET)), frame) is reason


def test_the_head_finds_auth_and_version() -> None:
    frame = msgpack.packb(signed(MESSAGE, SECRET, NOW, nonce()))
    head = read_head(frame)
    assert head.fields == len(MESSAGE) + 1 and head.version == 1
    assert head.auth is not None and head.auth[2] == len(frame)  # "auth" is last
    assert msgpack.unpackb(frame[head.auth[1] :])["nonce"] == nonce()
    assert read_head(msgpack.packb(V0)) == auth.FrameHead(3, 1, 0, None)


def test_with_a_secret_a_large_v0_frame_is_refused_before_it_is_decoded() -> None:
    large = {**V0, "extra": "x" * auth.MAX_V0_FRAME_BYTES}
    lenient = RegistryGate(Verifier(SECRET), allow_unsigned_v0=True)
    assert admit(lenient, msgpack.packb(large)) is Reason.TOO_LARGE
    assert admit(lenient, msgpack.packb(V0)) is None
    assert admit(RegistryGate(), msgpack.packb(large)) is None  # no secret: as ever


def test_admitted_says_whether_it_was_signed() -> None:
    gate = RegistryGate(Verifier(SECRET), allow_unsigned_v0=True)
    assert gate.admit(msgpack.packb(signed(MESSAGE, SECRET, NOW, nonce())), NOW).signed
    assert not gate.admit(msgpack.packb(V0), NOW).signed
    assert not RegistryGate().admit(msgpack.packb(MESSAGE), NOW).signed
