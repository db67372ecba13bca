"""Registry messages to every proxy replica a name resolves to, one ZMQ DEALER per address.

`proxy_ip` (the connector) and `--registry` (`pdproxy announce`, the fake worker's `--proxy`)
may be a DNS name: on Kubernetes a headless Service, one address per proxy pod. The name is
looked up again every period (bounded: pdproxy.base.resolve); an address that appears gets a
socket, and so the next announcement, which is the whole of what the registry keeps; one that
disappears has its socket closed at once. A failed lookup keeps the sockets there are: a DNS
hiccup must not make the fleet vanish from every replica.

Each socket has its own tiny send queue and every send is non-blocking, so a replica that is
down or slow loses its own messages and never delays the others.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import msgpack
import zmq

from pdproxy.base.endpoints import Endpoint, parse_endpoint
from pdproxy.base.resolve import DEFAULT_RESOLVE_TIMEOUT_S, BoundedResolver, ResolveError, is_ip
from pdproxy.vllm_side.registry_client import registry_socket

log = logging.getLogger("pdproxy.vllm_side")


def announce_resolver(interval_s: float) -> BoundedResolver:
    """Lookups bounded by the announce period too: a slow DNS server must not stretch it (a
    lookup that takes longer is waited for again the next period, not started again)."""
    return BoundedResolver(timeout_s=min(DEFAULT_RESOLVE_TIMEOUT_S, interval_s))


def endpoint(address: str, port: int) -> str:
    return Endpoint(address, port).zmq()


class FanOutClient:
    """What an announcer sends through. resolve() may run on any thread; use(), send() and
    close() on the one thread that owns the sockets (a ZMQ socket is not thread-safe)."""

    def __init__(
        self, registry: str, identity: str, resolver: BoundedResolver | None = None
    ) -> None:
        target = parse_endpoint(registry)  # ValueError (EndpointError) on a malformed one
        self._name = target.host
        self._port = target.port
        self._identity = identity
        self._resolver = resolver or BoundedResolver()
        self._context: zmq.Context[Any] = zmq.Context()
        self._sockets: dict[str, zmq.Socket[Any]] = {}  # by endpoint
        self._closed = False
        if is_ip(self._name):  # nothing to look up, ever: connect now
            self.use((self._name,))

    @property
    def registry(self) -> str:
        return str(Endpoint(self._name, self._port))

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(self._sockets)

    def resolve(self) -> tuple[str, ...] | None:
        """The name's addresses now; None when the lookup failed (keep what there is)."""
        try:
            return self._resolver.resolve(self._name)
        except ResolveError as exc:
            log.warning("registry %s: %s; keeping %d address(es)", self.registry, exc, len(self))
            return None

    def use(self, addresses: Iterable[str] | None) -> None:
        """Connect to each address not connected yet, close the sockets of the others."""
        if addresses is None or self._closed:
            return
        wanted = {endpoint(address, self._port) for address in addresses}
        for gone in sorted(set(self._sockets) - wanted):
            # Linger 0: what is still queued for a replica that went away is of no use.
            self._sockets.pop(gone).close(0)
            log.info("registry %s: %s dropped", self.registry, gone)
        for new in sorted(wanted - set(self._sockets)):
            self._sockets[new] = registry_socket(self._context, new, self._identity)
            log.info("registry %s: announcing to %s", self.registry, new)

    def refresh(self) -> None:
        self.use(self.resolve())

    def __len__(self) -> int:
        return len(self._sockets)

    def send(self, message: dict[str, Any]) -> bool:
        """Queue `message` on every socket without waiting; True when every one (at least
        one) took it. A full queue drops it for that replica only."""
        frame = msgpack.packb(message)
        taken = 0
        for where, sock in self._sockets.items():
            try:
                sock.send(frame, flags=zmq.NOBLOCK)
            except zmq.Again:
                log.debug("registry %s not reachable: %s dropped", where, message.get("op"))
                continue
            taken += 1
        return taken == len(self._sockets) > 0

    def close(self) -> None:
        """Close every socket; what is queued (a final `leave`) has the linger to get out."""
        self._closed = True
        for sock in self._sockets.values():
            sock.close()  # the linger set on it
        self._sockets.clear()
        self._context.term()
