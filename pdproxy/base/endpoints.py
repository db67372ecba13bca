"""Registry endpoints as people write them, one syntax for every command: `HOST:PORT` or
`tcp://HOST:PORT`, an IPv6 literal in brackets. Not judged by the request-id rules
(`pdproxy.ids`): a registry address never travels in a request id."""

from __future__ import annotations

from dataclasses import dataclass

EXAMPLE = "tcp://10.0.0.5:30001"
_SYNTAX = f"expected [tcp://]HOST:PORT, e.g. {EXAMPLE} (an IPv6 address in brackets)"


class EndpointError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str  # without brackets
    port: int

    @property
    def ipv6(self) -> bool:
        return ":" in self.host

    def zmq(self) -> str:
        """What ZMQ binds or connects to."""
        return f"tcp://[{self.host}]:{self.port}" if self.ipv6 else f"tcp://{self.host}:{self.port}"

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if self.ipv6 else f"{self.host}:{self.port}"


def parse_endpoint(text: object, *, wildcard: bool = False) -> Endpoint:
    """`wildcard`: a bind address may say `*` for every interface."""
    if not isinstance(text, str):
        raise EndpointError(f"a registry address is a string: {_SYNTAX}")
    rest = text.strip()
    scheme, separator, after = rest.partition("://")
    if separator:
        if scheme.lower() != "tcp":
            raise EndpointError(f"{text!r}: only tcp:// is supported; {_SYNTAX}")
        rest = after
    if rest.startswith("["):
        host, closed, tail = rest[1:].partition("]")
        if not closed or not tail.startswith(":"):
            raise EndpointError(f"{text!r}: {_SYNTAX}")
        port_text = tail[1:]
    else:
        host, colon, port_text = rest.rpartition(":")
        if not colon:
            raise EndpointError(f"{text!r} has no port: {_SYNTAX}")
        if ":" in host:
            raise EndpointError(f"{text!r}: {_SYNTAX}")
    if not host or any(ch.isspace() or ch in "/[]@?#" for ch in host):
        raise EndpointError(f"{text!r} has no valid host: {_SYNTAX}")
    if host == "*" and not wildcard:
        raise EndpointError(f"{text!r}: '*' is only for a bind address; {_SYNTAX}")
    if not (port_text.isascii() and port_text.isdigit() and 1 <= int(port_text) <= 65535):
        raise EndpointError(f"{text!r}: the port must be a number from 1 to 65535; {_SYNTAX}")
    return Endpoint(host, int(port_text))
