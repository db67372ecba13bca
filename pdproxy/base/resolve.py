"""A name to its addresses (A and AAAA), never waiting longer than a bound.

The announcers and the proxy's peer calls look a name up every period; getaddrinfo cannot be
interrupted, so it runs on a thread of its own and the caller waits at most `timeout_s`. A call
that hangs keeps its one thread: the next lookup waits for that same call again instead of
starting another, so a dead DNS server never piles up threads.
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import logging
import socket
import threading
from collections.abc import Callable, Sequence

log = logging.getLogger("pdproxy.resolve")

# name -> its addresses, as text ("10.0.0.7", "fd00::7"): getaddrinfo, or a test's own table.
Resolver = Callable[[str], Sequence[str]]

DEFAULT_RESOLVE_TIMEOUT_S = 2.0


class ResolveError(Exception):
    """The name could not be looked up now (no answer in time, or the resolver failed)."""


def system_resolver(name: str) -> tuple[str, ...]:
    """Every address the system resolver gives `name` (A and AAAA), without repeats, in its
    order; socket.gaierror when it gives none."""
    found = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    return tuple(dict.fromkeys(str(entry[4][0]) for entry in found))


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class BoundedResolver:
    """Looks names up through `resolver`, at most one call in flight, each wait bounded."""

    def __init__(
        self, resolver: Resolver = system_resolver, timeout_s: float = DEFAULT_RESOLVE_TIMEOUT_S
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("the resolve timeout must be positive")
        self._resolver = resolver
        self._timeout = timeout_s
        self._lock = threading.Lock()
        self._pending: dict[str, concurrent.futures.Future[Sequence[str]]] = {}

    def resolve(self, name: str) -> tuple[str, ...]:
        """`name`'s addresses (an IP address is its own); ResolveError when there are none now.
        Safe from any thread."""
        if is_ip(name):
            return (name,)
        with self._lock:
            future = self._pending.get(name)
            if future is None:
                future = concurrent.futures.Future()
                self._pending[name] = future
                threading.Thread(
                    target=self._look_up, args=(name, future), name="pdproxy-resolve", daemon=True
                ).start()
        try:
            addresses = future.result(self._timeout)
        except concurrent.futures.TimeoutError:
            raise ResolveError(f"{name}: no answer within {self._timeout:g}s") from None
        except Exception as exc:  # the resolver's own failure (gaierror, a test's error)
            raise ResolveError(f"{name}: {exc}") from None
        valid = tuple(address for address in addresses if is_ip(address))
        if not valid:
            raise ResolveError(f"{name}: no address")
        return valid

    def _look_up(self, name: str, future: concurrent.futures.Future[Sequence[str]]) -> None:
        try:
            addresses: tuple[str, ...] | None = tuple(self._resolver(name))
            failure: Exception | None = None
        except Exception as exc:
            addresses, failure = None, exc
        # Forgotten before it is answered: a lookup that starts once this one has answered
        # asks the resolver again instead of reading this answer.
        with self._lock:
            if self._pending.get(name) is future:
                del self._pending[name]
        if failure is not None:
            future.set_exception(failure)
        else:
            future.set_result(addresses or ())
