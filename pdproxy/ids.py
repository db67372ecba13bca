"""Request-id codec for vLLM's P2pNcclConnector addressing (DESIGN.md section 2).

    ___prefill_addr_{P_HOST}:{P_PORT}___decode_addr_{D_HOST}:{D_PORT}_{32 lowercase hex}

vLLM finds the peer with two greedy regexes (`VLLM_PREFILL_SIDE` on the prefill worker,
`VLLM_DECODE_SIDE` on the decode worker). Greedy `.*` means a host that contains `:` or a run of
underscores can make them capture the wrong span, so hosts are validated strictly here, before
an address can ever reach an id. Pure: no I/O, no randomness (the caller supplies the uid).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# The exact patterns vLLM's P2pNcclConnector uses; the prefill worker looks for the decode
# address, the decode worker for the prefill address.
VLLM_PREFILL_SIDE = re.compile(r"___decode_addr_(.*):(\d+)")
VLLM_DECODE_SIDE = re.compile(r"___prefill_addr_(.*):(\d+)___")

PREFILL_TAG = "___prefill_addr_"
DECODE_TAG = "___decode_addr_"
UID_HEX_LENGTH = 32
MAX_HOST_LENGTH = 253

_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?", re.ASCII)
_HEX_DIGITS = "0123456789abcdef"
_TAGGED = re.compile(
    r"___prefill_addr_(?P<ph>[^:\s]+):(?P<pp>\d+)"
    r"___decode_addr_(?P<dh>[^:\s]+):(?P<dp>\d+)_(?P<uid>[0-9a-f]{32})",
    re.ASCII,
)


class AddressError(ValueError):
    """An address that vLLM's id regexes (or its engine) cannot carry."""


@dataclass(frozen=True, slots=True)
class Address:
    host: str
    port: int
    # "host:port" and the hash, made once: every request names instances by their address and
    # looks them up by it (docs/performance.md, "Addresses").
    _text: str = field(init=False, repr=False, compare=False)
    _hash: int = field(init=False, repr=False, compare=False)
    # Whether a request id may carry it, judged once: every request id checks both addresses.
    id_safe: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_text", f"{self.host}:{self.port}")
        object.__setattr__(self, "_hash", hash((self.host, self.port)))
        object.__setattr__(self, "id_safe", _host_ok(self.host) and _port_ok(self.port))

    def __str__(self) -> str:
        return self._text

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[type[Address], tuple[str, int]]:
        # Rebuilt, never copied: a str's hash differs from process to process (hash
        # randomisation), and addresses cross to the workers and the registry process.
        return (Address, (self.host, self.port))


def _host_ok(host: str) -> bool:
    """The hosts validate_host accepts, in one test."""
    return bool(_HOST.fullmatch(host)) and "__" not in host and len(host) <= MAX_HOST_LENGTH


def validate_host(host: str) -> None:
    """Raise AddressError unless `host` survives vLLM's greedy regexes unchanged."""
    if _host_ok(host):
        return  # the checks below only find the message for a rejected host
    if not host:
        raise AddressError("empty host")
    if ":" in host or host.startswith("["):
        raise AddressError(
            f"host {host!r} looks like an IPv6 literal or contains ':'; vLLM's request-id "
            "addressing cannot carry it (use an IPv4 address or a DNS name)"
        )
    if any(ch.isspace() for ch in host):
        raise AddressError(f"host {host!r} contains whitespace")
    if "___" in host:
        raise AddressError(f"host {host!r} contains '___', the request-id field separator")
    if "__" in host:
        # "__" at either end of a host can join a neighbouring "_" into a false "___" separator.
        raise AddressError(f"host {host!r} contains '__', which can fake a '___' separator")
    if len(host) > MAX_HOST_LENGTH:
        raise AddressError(f"host is longer than {MAX_HOST_LENGTH} characters")
    if not _HOST.fullmatch(host):
        raise AddressError(
            f"host {host!r} must be an IPv4 address or DNS name "
            "(letters, digits, '.', '-', '_'; starting and ending with a letter or digit)"
        )


def _port_ok(port: int) -> bool:
    return 1 <= port <= 65535


def validate_port(port: int) -> None:
    if not _port_ok(port):
        raise AddressError(f"port {port} is outside 1..65535")


def make_address(host: str, port: int) -> Address:
    validate_host(host)
    validate_port(port)
    return Address(host, port)


def parse_address(text: object) -> Address:
    """Parse and validate "host:port". Takes any object: it also checks what registry messages
    and configuration files carry."""
    if not isinstance(text, str):
        raise AddressError(f"address must be a string 'host:port', got {type(text).__name__}")
    host, sep, port_text = text.rpartition(":")
    if not sep:
        raise AddressError(f"address {text!r} has no ':port'")
    if not port_text.isascii() or not port_text.isdigit() or len(port_text) > 5:
        raise AddressError(f"address {text!r} has a port that is not a number")
    return make_address(host, int(port_text))


@dataclass(frozen=True, slots=True)
class TaggedId:
    prefill: Address
    decode: Address
    uid: str


def build_request_id(prefill: Address, decode: Address, uid: str) -> str:
    """The id both legs carry as X-Request-Id. Addresses are KV (zmq) addresses."""
    # strip() leaves nothing exactly when every character is a lowercase hex digit.
    if len(uid) != UID_HEX_LENGTH or uid.strip(_HEX_DIGITS):
        raise ValueError(f"uid must be {UID_HEX_LENGTH} lowercase hex characters")
    if not (prefill.id_safe and decode.id_safe):  # raise with the reason
        for address in (prefill, decode):
            validate_host(address.host)
            validate_port(address.port)
    return f"{PREFILL_TAG}{prefill}{DECODE_TAG}{decode}_{uid}"


def parse_request_id(text: str) -> TaggedId | None:
    """Find a tagged id anywhere in `text` (engine ids wrap it in prefixes and suffixes)."""
    match = _TAGGED.search(text)
    if match is None:
        return None
    try:
        prefill = make_address(match["ph"], int(match["pp"]))
        decode = make_address(match["dh"], int(match["dp"]))
    except AddressError:
        return None
    return TaggedId(prefill, decode, match["uid"])


def vllm_decode_address(engine_id: str) -> Address | None:
    """What a vLLM prefill worker extracts from an engine request id (its peer: decode)."""
    match = VLLM_PREFILL_SIDE.search(engine_id)
    return None if match is None else Address(match[1], int(match[2]))


def vllm_prefill_address(engine_id: str) -> Address | None:
    """What a vLLM decode worker extracts from an engine request id (its peer: prefill)."""
    match = VLLM_DECODE_SIDE.search(engine_id)
    return None if match is None else Address(match[1], int(match[2]))
