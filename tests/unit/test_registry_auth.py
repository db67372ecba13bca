"""pdproxy.registry.auth: signing, verification, replay cache, address policy."""

from __future__ import annotations

import hmac
import ipaddress
from typing import Any

import msgpack
import pytest

from pdproxy.registry import auth
from pdproxy.registry.auth import (
    RegistryGate,
    Verifier,
    address_allowed,
    canonical,
    parse_cidrs,
    sign,
    signed,
)
from pdproxy.registry.messages import Reason, Rejected, decode_frame, parse_message
from pdproxy.worker.announcement import WorkerIdentity, announce_message, leave_message

SECRET = b"0123456789abcdef-unit"
NOW = 1_700_000_000.0
IDENTITY = WorkerIdentity("D", "10.0.0.6:20002", "10.0.0.6:22001", model="m", connector="nixl")
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
        gate.check(payload, parse_message(payload), now)
    except Rejected as exc:
        return exc.reason
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
