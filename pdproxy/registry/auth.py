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

A frame is verified before it is decoded (Verifier.verify_frame), so that a forged frame costs
a walk over its bytes and one HMAC, however large or deeply nested it is:

- `read_head` walks the top-level map without decoding its values (at most MAX_FIELDS fields),
  and finds where the "auth" field lies and what "v" says;
- the "auth" value (at most MAX_AUTH_BYTES) is decoded, its shape and the timestamp window are
  checked;
- the MAC is computed over the frame's own bytes with the "auth" field cut out and the map
  header counting one field fewer. When the signer sent its fields in canonical order, which
  `signed()` does (keys sorted recursively, "auth" last), those bytes are canonical(message):
  nothing is decoded or re-encoded;
- only when that MAC does not match, and the frame is at most LEGACY_FRAME_BYTES holding at
  most LEGACY_ELEMENTS map and list items, is it decoded and canonicalised to check the MAC
  the old way (decoding stops as soon as it counts too many items).

Compatibility (the wire format is the same for every version; v0 is never signed):
- frames signed by this version verify on earlier proxies, which compute canonical() (the
  same bytes);
- frames signed by earlier pdproxy workers (fields in the order they were built) verify here
  up to LEGACY_FRAME_BYTES and LEGACY_ELEMENTS: every announce and leave. Larger ones (stats
  batches of more than a few transfers) are refused as bad_signature until the worker is
  upgraded.

Only the standard library and msgpack are imported: workers (inside vLLM) import this to sign.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import ipaddress
import math
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack

from pdproxy.registry.messages import (
    Announcement,
    Message,
    Reason,
    Rejected,
    decode_frame,
    message_version,
)

AUTH_FIELD = "auth"
NONCE_HEX = 32
MAC_HEX = 64
DEFAULT_MAX_SKEW_S = 30.0
DEFAULT_NONCE_CAPACITY = 65536
# Top-level fields of a frame walked before it is authenticated: a v1 message has at most 14.
MAX_FIELDS = 64
# The encoded "auth" value: about 130 bytes as signed.
MAX_AUTH_BYTES = 256
# The largest frame whose MAC is also checked over canonical(), for workers of earlier versions
# (see the module's doc)...
LEGACY_FRAME_BYTES = 4096
# ... and holding at most this many maps, lists and their items in all (an announce holds about
# 25, a stats message 8 per transfer): canonicalising costs per item.
LEGACY_ELEMENTS = 512
# With a secret, an unsigned v0 frame larger than this is refused before it is decoded: stock
# vLLM's ping is three short fields.
MAX_V0_FRAME_BYTES = 4096
# A key or "v" value longer than this (encoded) is not one the head looks for.
_SHORT_BYTES = 16

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_T = TypeVar("_T")


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


def _body(message: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in message.items() if key != AUTH_FIELD}


def canonical(message: Mapping[str, Any]) -> bytes:
    """The bytes a MAC covers: msgpack of `message`, keys sorted recursively, "auth" left out."""
    packed: bytes = msgpack.packb(_sorted(_body(message)), use_bin_type=True)
    return packed


def _stamp(ts: object, nonce: object) -> bytes:
    packed: bytes = msgpack.packb([ts, nonce], use_bin_type=True)
    return packed


def _mac(message: Mapping[str, Any], secret: bytes, ts: object, nonce: object) -> str:
    return hmac.new(secret, canonical(message) + _stamp(ts, nonce), hashlib.sha256).hexdigest()


def new_nonce() -> str:
    return secrets.token_hex(NONCE_HEX // 2)


def sign(message: Mapping[str, Any], secret: bytes, now: float, nonce: str) -> dict[str, Any]:
    """The "auth" field for `message` (any "auth" it already has is ignored)."""
    if not secret:
        raise AuthConfigError("empty registry secret")
    ts = float(now)
    return {"ts": ts, "nonce": nonce, "mac": _mac(message, secret, ts, nonce)}


def signed(message: Mapping[str, Any], secret: bytes, now: float, nonce: str) -> dict[str, Any]:
    """`message` with its "auth" field, in canonical order (keys sorted recursively, "auth"
    last): packed with msgpack, its bytes but the "auth" field are canonical(message), which
    lets the proxy check the MAC without decoding the frame first."""
    return {**_sorted(_body(message)), AUTH_FIELD: sign(message, secret, now, nonce)}


def _is_hex(value: object, length: int) -> bool:
    return (
        isinstance(value, str)
        and len(value) == length
        and all(ch in "0123456789abcdef" for ch in value)
    )


# -- a frame's head, read before it is authenticated ----------------------------------------


class _Long:
    """Stands for a key or value too long to be one the head looks for."""

    def __repr__(self) -> str:
        return "<long value>"


_LONG = _Long()


@dataclass(frozen=True, slots=True)
class FrameHead:
    """Where things lie in a frame's top-level map, found without decoding its values."""

    fields: int
    body_start: int  # offset of the first field (just past the map header)
    version: object  # the "v" field's value as sent (0 when absent)
    auth: tuple[int, int, int] | None  # the "auth" field: (key offset, value offset, end)

    def unsigned_parts(self, frame: bytes) -> tuple[bytes, memoryview, memoryview]:
        """The frame without its "auth" field, in pieces: what a canonically ordered
        frame's MAC covers (before the stamp)."""
        assert self.auth is not None
        key_start, _, end = self.auth
        view = memoryview(frame)
        header: bytes = msgpack.Packer().pack_map_header(self.fields - 1)
        return header, view[self.body_start : key_start], view[end:]


def _short(frame: bytes, start: int, end: int) -> object:
    if end - start > _SHORT_BYTES:
        return _LONG
    return msgpack.unpackb(frame[start:end], raw=False, strict_map_key=False)


def read_head(frame: bytes) -> FrameHead:
    """Walk the frame's top-level map (skipping over every value in C, decoding only short
    keys and "v"), or raise Rejected (NOT_MSGPACK, NOT_A_MAP, TOO_LARGE, BAD_SIGNATURE)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(frame) or 1)
    unpacker.feed(frame)
    try:
        fields = unpacker.read_map_header()
    except msgpack.OutOfData:
        raise Rejected(Reason.NOT_MSGPACK, "empty or truncated frame") from None
    except ValueError:  # another type's header, or 0xc1 (which begins none)
        if frame[:1] == b"\xc1":
            raise Rejected(Reason.NOT_MSGPACK, "not a msgpack value") from None
        raise Rejected(Reason.NOT_A_MAP, "expected a map") from None
    if fields > MAX_FIELDS:
        raise Rejected(Reason.TOO_LARGE, f"{fields} top-level fields (at most {MAX_FIELDS})")
    body_start = unpacker.tell()
    version: object = 0
    auth: tuple[int, int, int] | None = None
    try:
        for _ in range(fields):
            key_start = unpacker.tell()
            unpacker.skip()
            value_start = unpacker.tell()
            unpacker.skip()
            end = unpacker.tell()
            key = _short(frame, key_start, value_start)
            if key == AUTH_FIELD:
                if auth is not None:
                    raise Rejected(Reason.BAD_SIGNATURE, "more than one 'auth' field")
                auth = (key_start, value_start, end)
            elif key == "v":
                version = _short(frame, value_start, end)
    except Rejected:
        raise
    except Exception as exc:  # msgpack raises many unrelated types on garbage
        raise Rejected(Reason.NOT_MSGPACK, type(exc).__name__) from None
    if unpacker.tell() != len(frame):
        raise Rejected(Reason.NOT_MSGPACK, "ExtraData")
    return FrameHead(fields, body_start, version, auth)


# -- verification ---------------------------------------------------------------------------


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
        ts, nonce, mac = self._fresh_stamp(message.get(AUTH_FIELD), now)
        try:
            expected = _mac(message, self._secret, ts, nonce)
        except (ValueError, TypeError, OverflowError, RecursionError):
            raise Rejected(Reason.BAD_SIGNATURE, "message cannot be canonicalized") from None
        if not hmac.compare_digest(expected, mac):
            raise Rejected(Reason.BAD_SIGNATURE, "MAC does not match (wrong secret or altered)")
        self._check_unseen(ts, nonce)
        self._remember(ts, nonce)

    def verify_frame(
        self, frame: bytes, head: FrameHead, now: float, decode: Callable[[bytes], _T]
    ) -> _T:
        """verify() for a frame still in bytes, then `decode(frame)`: nothing but the "auth"
        value is decoded before the MAC matched (see the module's doc). The nonce is
        remembered only once `decode` returned, so a signed frame the decoder refuses is
        refused the same way each time it comes."""
        self._forget(now)
        ts, nonce, mac = self._fresh_stamp(_auth_value(frame, head), now)
        if not (
            self._raw_mac_matches(frame, head, ts, nonce, mac)
            or self._legacy_mac_matches(frame, ts, nonce, mac)
        ):
            hint = (
                ""
                if len(frame) <= LEGACY_FRAME_BYTES
                else f"; a worker older than the proxy may only sign up to {LEGACY_FRAME_BYTES}"
                " bytes in any field order"
            )
            raise Rejected(
                Reason.BAD_SIGNATURE, f"MAC does not match (wrong secret or altered{hint})"
            )
        self._check_unseen(ts, nonce)
        decoded = decode(frame)
        self._remember(ts, nonce)
        return decoded

    def _raw_mac_matches(
        self, frame: bytes, head: FrameHead, ts: float, nonce: str, mac: str
    ) -> bool:
        digest = hmac.new(self._secret, digestmod=hashlib.sha256)
        for part in head.unsigned_parts(frame):
            digest.update(part)
        digest.update(_stamp(ts, nonce))
        return hmac.compare_digest(digest.hexdigest(), mac)

    def _legacy_mac_matches(self, frame: bytes, ts: float, nonce: str, mac: str) -> bool:
        if len(frame) > LEGACY_FRAME_BYTES:
            return False
        try:
            payload = _decode_bounded(frame, LEGACY_ELEMENTS)
            expected = _mac(payload, self._secret, ts, nonce)
        except Exception:  # too big, undecodable or not canonicalizable: it cannot match
            return False
        return hmac.compare_digest(expected, mac)

    def _fresh_stamp(self, auth: object, now: float) -> tuple[float, str, str]:
        """(ts, nonce, mac) of a well-formed "auth" value whose timestamp is in the window."""
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
        assert isinstance(nonce, str) and isinstance(mac, str)
        return ts, nonce, mac

    def _check_unseen(self, ts: float, nonce: str) -> None:
        if nonce in self._seen:
            raise Rejected(Reason.REPLAYED, "nonce already seen")
        if ts <= self._floor:
            raise Rejected(Reason.STALE, "older than the replay cache remembers")

    def _remember(self, ts: float, nonce: str) -> None:
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


class _TooManyElements(ValueError):
    pass


def _decode_bounded(frame: bytes, max_elements: int) -> Any:
    """The frame's value, or _TooManyElements as soon as its maps and lists (each counting as
    one, plus its items) pass `max_elements`: canonicalising costs per item, not per byte."""
    seen = 0

    def count(size: int) -> None:
        nonlocal seen
        seen += size
        if seen > max_elements:
            raise _TooManyElements(f"more than {max_elements} elements")

    def as_map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
        count(1 + len(pairs))
        return dict(pairs)

    def as_list(items: list[Any]) -> list[Any]:
        count(1 + len(items))
        return items

    return msgpack.unpackb(
        frame, raw=False, strict_map_key=False, object_pairs_hook=as_map, list_hook=as_list
    )


def _auth_value(frame: bytes, head: FrameHead) -> object:
    """The "auth" field's value (None when there is none), decoded only when it is small."""
    if head.auth is None:
        return None
    _, start, end = head.auth
    if end - start > MAX_AUTH_BYTES:
        raise Rejected(Reason.BAD_SIGNATURE, f"'auth' is over {MAX_AUTH_BYTES} bytes")
    try:
        return msgpack.unpackb(frame[start:end], raw=False, strict_map_key=False)
    except Exception:  # e.g. a map keyed by a list
        raise Rejected(Reason.BAD_SIGNATURE, "'auth' cannot be decoded") from None


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


@dataclass(frozen=True, slots=True)
class Admitted:
    message: Message
    signed: bool  # its signature was verified (never for v0, nor without a secret)


class RegistryGate:
    """The registry's admission policy, applied to a frame as it came off the socket.

    - with a secret, every v1 message (announce, leave and stats) must be signed, and its
      signature is checked before the frame is decoded (Verifier.verify_frame);
    - v0 (stock vLLM, which cannot sign) is accepted without a secret, or with one only when
      `allow_unsigned_v0` (and then only up to MAX_V0_FRAME_BYTES); and when `v0_cidrs` are
      given, only if it was sent from them (the connection's peer address, when known) and its
      addresses fall in them;
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

    def admit(self, frame: bytes, now: float, peer: str | None = None) -> Admitted:
        """The message `frame` holds, if this policy admits it; else Rejected. `now` is wall
        clock seconds, `peer` the sender's IP address when the transport tells it."""
        if self._verifier is None:
            message = decode_frame(frame)
            if _is_v0(message):
                self._check_v0_sender(peer)
            admitted = Admitted(message, signed=False)
        else:
            head = read_head(frame)
            if message_version(head.version) == 0:
                self._check_v0_sender(peer)
                if len(frame) > MAX_V0_FRAME_BYTES:
                    raise Rejected(
                        Reason.TOO_LARGE,
                        f"unsigned v0 frame of {len(frame)} bytes (at most {MAX_V0_FRAME_BYTES})",
                    )
                admitted = Admitted(decode_frame(frame), signed=False)
            else:
                message = self._verifier.verify_frame(frame, head, now, decode_frame)
                admitted = Admitted(message, signed=True)
        self._check_addresses(admitted.message)
        return admitted

    def _check_v0_sender(self, peer: str | None) -> None:
        if not self._allow_v0:
            raise Rejected(Reason.UNSIGNED, "unsigned v0 messages are not allowed")
        if self._v0_cidrs and peer is not None:
            # Unsigned, so only where it comes from vouches for it: the sender's own IP, not
            # just the addresses it claims.
            allowed, why = address_allowed(peer, self._v0_cidrs)
            if not allowed:
                raise Rejected(Reason.FORBIDDEN_ADDRESS, f"v0 sent from {why}")

    def _check_addresses(self, message: Message) -> None:
        if not isinstance(message, Announcement):
            return
        addresses = (("http_address", message.http_address), ("zmq_address", message.zmq_address))
        v0_networks = self._v0_cidrs if _is_v0(message) else ()
        for networks, what in ((v0_networks, "v0"), (self._address_cidrs, "")):
            if not networks:
                continue
            for name, address in addresses:
                allowed, why = address_allowed(address.host, networks)
                if not allowed:
                    scope = f" for {what}" if what else ""
                    raise Rejected(Reason.FORBIDDEN_ADDRESS, f"{name}{scope}: {why}")


def _is_v0(message: Message) -> bool:
    return isinstance(message, Announcement) and message.version == 0
