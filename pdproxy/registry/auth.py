"""Registry authentication (DESIGN.md section 3, the v1 "auth" field). Pure: no clock, no I/O.

A v1 message is signed with a secret shared by the proxy and its workers:

    "auth": {"ts": <unix seconds, float>, "nonce": <32 hex>, "mac": <64 hex>}

where mac = HMAC-SHA256(secret, canonical(message) + msgpack([ts, nonce])): the MAC covers
every field of the message but "auth", plus the timestamp (a float64) and the nonce.
canonical() is msgpack of the map without "auth", keys sorted recursively (by their msgpack
bytes), so a worker and the proxy agree whatever order their maps were built in.

The proxy rejects a message whose timestamp is more than `max_skew_s` away from its wall clock
(STALE), whose MAC does not match (BAD_SIGNATURE), or whose nonce it saw already (REPLAYED).
Nonces are remembered only while their timestamp is within the window, in a cache of bounded
size: when it is full the oldest is forgotten and anything not newer than it is refused as STALE,
so a forgotten nonce cannot be replayed.

Only the standard library and msgpack are imported: workers (inside vLLM) import this to sign.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import ipaddress
import math
import secrets
from collections.abc import Iterable, Mapping
from typing import Any

import msgpack

from pdproxy.registry.messages import Announcement, Message, Reason, Rejected

AUTH_FIELD = "auth"
NONCE_HEX = 32
MAC_HEX = 64
DEFAULT_MAX_SKEW_S = 30.0
DEFAULT_NONCE_CAPACITY = 65536
MIN_SECRET_BYTES = 16

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class AuthConfigError(ValueError):
    pass


def _sort_key(item: tuple[Any, Any]) -> bytes:
    packed: bytes = msgpack.packb(item[0])
    return packed


def _sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _sorted(item) for key, item in sorted(value.items(), key=_sort_key)}
    if isinstance(value, list | tuple):
        return [_sorted(item) for item in value]
    return value


def canonical(message: Mapping[str, Any]) -> bytes:
    """The bytes a MAC covers: msgpack of `message`, keys sorted recursively, "auth" left out."""
    body = {key: value for key, value in message.items() if key != AUTH_FIELD}
    packed: bytes = msgpack.packb(_sorted(body), use_bin_type=True)
    return packed


def _mac(message: Mapping[str, Any], secret: bytes, ts: object, nonce: object) -> str:
    stamp: bytes = msgpack.packb([ts, nonce], use_bin_type=True)
    return hmac.new(secret, canonical(message) + stamp, hashlib.sha256).hexdigest()


def new_nonce() -> str:
    return secrets.token_hex(NONCE_HEX // 2)


def sign(message: Mapping[str, Any], secret: bytes, now: float, nonce: str) -> dict[str, Any]:
    """The "auth" field for `message` (any "auth" it already has is ignored)."""
    if not secret:
        raise AuthConfigError("empty registry secret")
    ts = float(now)
    return {"ts": ts, "nonce": nonce, "mac": _mac(message, secret, ts, nonce)}


def signed(message: Mapping[str, Any], secret: bytes, now: float, nonce: str) -> dict[str, Any]:
    """`message` with its "auth" field."""
    return {**message, AUTH_FIELD: sign(message, secret, now, nonce)}


def _is_hex(value: object, length: int) -> bool:
    return (
        isinstance(value, str)
        and len(value) == length
        and all(ch in "0123456789abcdef" for ch in value)
    )


class Verifier:
    """Checks the "auth" field of v1 messages; remembers nonces to refuse replays."""

    def __init__(
        self,
        secret: bytes,
        max_skew_s: float = DEFAULT_MAX_SKEW_S,
        nonce_capacity: int = DEFAULT_NONCE_CAPACITY,
    ) -> None:
        if not secret:
            raise AuthConfigError("empty registry secret")
        if not max_skew_s > 0 or nonce_capacity < 1:
            raise AuthConfigError("max_skew_s and nonce_capacity must be positive")
        self._secret = secret
        self._skew = max_skew_s
        self._capacity = nonce_capacity
        self._seen: set[str] = set()
        self._by_time: list[tuple[float, str]] = []  # heap of (ts, nonce)
        # Nonces with a timestamp at or before this were forgotten early (cache full).
        self._floor = -math.inf

    def __repr__(self) -> str:  # never the secret
        return f"Verifier(max_skew_s={self._skew}, nonces={len(self._seen)})"

    @property
    def remembered(self) -> int:
        return len(self._seen)

    def verify(self, message: Mapping[str, Any], now: float) -> None:
        """Raise Rejected unless `message` carries a valid, fresh, first-seen signature."""
        self._forget(now)
        auth = message.get(AUTH_FIELD)
        if auth is None:
            raise Rejected(Reason.UNSIGNED, "no 'auth' field (a registry secret is required)")
        if not isinstance(auth, dict):
            raise Rejected(Reason.BAD_SIGNATURE, "'auth' must be a map")
        ts, nonce, mac = auth.get("ts"), auth.get("nonce"), auth.get("mac")
        if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
            raise Rejected(Reason.BAD_SIGNATURE, "auth.ts must be a number")
        if not _is_hex(nonce, NONCE_HEX) or not _is_hex(mac, MAC_HEX):
            raise Rejected(Reason.BAD_SIGNATURE, "auth.nonce or auth.mac is malformed")
        if abs(now - ts) > self._skew:
            where = "in the past" if ts < now else "in the future"
            raise Rejected(
                Reason.STALE, f"timestamp {abs(now - ts):.1f}s {where} (max {self._skew:g}s)"
            )
        try:
            expected = _mac(message, self._secret, ts, nonce)
        except (ValueError, TypeError, OverflowError, RecursionError):
            raise Rejected(Reason.BAD_SIGNATURE, "message cannot be canonicalized") from None
        if not hmac.compare_digest(expected, str(mac)):
            raise Rejected(Reason.BAD_SIGNATURE, "MAC does not match (wrong secret or altered)")
        assert isinstance(nonce, str)
        if nonce in self._seen:
            raise Rejected(Reason.REPLAYED, "nonce already seen")
        if ts <= self._floor:
            raise Rejected(Reason.STALE, "older than the replay cache remembers")
        self._seen.add(nonce)
        heapq.heappush(self._by_time, (float(ts), nonce))
        while len(self._seen) > self._capacity:
            oldest, gone = heapq.heappop(self._by_time)
            self._seen.discard(gone)
            self._floor = max(self._floor, oldest)

    def _forget(self, now: float) -> None:
        """Drop nonces whose timestamp left the window: they would be refused as STALE."""
        horizon = now - self._skew
        while self._by_time and self._by_time[0][0] < horizon:
            _, gone = heapq.heappop(self._by_time)
            self._seen.discard(gone)


# -- addresses ------------------------------------------------------------------------------


def parse_cidrs(texts: Iterable[str]) -> tuple[Network, ...]:
    """Networks from "10.0.0.0/8"-style strings; AuthConfigError names a bad one."""
    networks = []
    for text in texts:
        try:
            networks.append(ipaddress.ip_network(text.strip(), strict=True))
        except ValueError as exc:
            raise AuthConfigError(f"bad CIDR {text!r}: {exc}") from None
    return tuple(networks)


def address_allowed(host: str, networks: Iterable[Network]) -> tuple[bool, str]:
    """Whether `host` (an IP literal) falls in one of `networks`, and why not if it does not.

    A host name is refused: it may resolve anywhere (and differently later), so only IP
    literals can be checked against CIDRs.
    """
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False, f"{host[:64]!r} is a host name, not an IP literal (CIDRs are configured)"
    if any(ip in network for network in networks):
        return True, ""
    return False, f"{ip} is outside the allowed networks"


class RegistryGate:
    """The registry's admission policy, applied to a decoded message and its raw map.

    - with a secret, every v1 message (announce, leave and stats) must be signed;
    - v0 (stock vLLM, which cannot sign) is accepted without a secret, or with one only when
      `allow_unsigned_v0`; and when `v0_cidrs` are given, only if it was sent from them (the
      connection's peer address, when known) and its addresses fall in them;
    - when `address_cidrs` are given, every announced http and zmq address must fall in them.
    """

    def __init__(
        self,
        verifier: Verifier | None = None,
        allow_unsigned_v0: bool = False,
        v0_cidrs: Iterable[Network] = (),
        address_cidrs: Iterable[Network] = (),
    ) -> None:
        self._verifier = verifier
        self._allow_v0 = verifier is None or allow_unsigned_v0
        self._v0_cidrs = tuple(v0_cidrs)
        self._address_cidrs = tuple(address_cidrs)

    def check(
        self, payload: Mapping[str, Any], message: Message, now: float, peer: str | None = None
    ) -> None:
        is_v0 = isinstance(message, Announcement) and message.version == 0
        if is_v0:
            if not self._allow_v0:
                raise Rejected(Reason.UNSIGNED, "unsigned v0 messages are not allowed")
            if self._v0_cidrs and peer is not None:
                # Unsigned, so only where it comes from vouches for it: the sender's own IP,
                # not just the addresses it claims.
                allowed, why = address_allowed(peer, self._v0_cidrs)
                if not allowed:
                    raise Rejected(Reason.FORBIDDEN_ADDRESS, f"v0 sent from {why}")
        elif self._verifier is not None:
            self._verifier.verify(payload, now)
        if not isinstance(message, Announcement):
            return
        addresses = (("http_address", message.http_address), ("zmq_address", message.zmq_address))
        for networks, what in ((self._v0_cidrs if is_v0 else (), "v0"), (self._address_cidrs, "")):
            if not networks:
                continue
            for name, address in addresses:
                allowed, why = address_allowed(address.host, networks)
                if not allowed:
                    scope = f" for {what}" if what else ""
                    raise Rejected(Reason.FORBIDDEN_ADDRESS, f"{name}{scope}: {why}")
