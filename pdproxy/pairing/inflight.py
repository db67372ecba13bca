"""The proxy's own legs in flight, per instance: the load no announcement has shown yet. Pure.

Announced load lags by a report period (seconds); without this count every request of a burst
would go to the instance that looked idle at the last report.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pdproxy.ids import Address


@dataclass(slots=True)
class Busy:
    requests: int = 0
    tokens: int = 0


_IDLE = Busy()

Listener = Callable[[Address], None]


class InFlight:
    def __init__(self) -> None:
        self._busy: dict[Address, Busy] = {}
        # Score boards of the current fleet index, told of every change to an instance they
        # hold, so they stay exact without rescanning their candidates.
        self._listeners: dict[Address, list[Listener]] = {}
        self._listener_count = 0

    def get(self, address: Address) -> Busy:
        return self._busy.get(address, _IDLE)

    def add(self, address: Address, tokens: int) -> None:
        busy = self._busy.get(address)
        if busy is None:
            busy = self._busy[address] = Busy()
        busy.requests += 1
        busy.tokens += tokens
        self._notify(address)

    def remove(self, address: Address, tokens: int) -> None:
        busy = self._busy.get(address)
        if busy is None:
            raise ValueError(f"no leg in flight on {address}")
        busy.requests -= 1
        busy.tokens -= tokens
        if busy.requests == 0:
            # Bounded by what is in flight, not by every instance ever seen.
            del self._busy[address]
        self._notify(address)

    def total_requests(self) -> int:
        return sum(busy.requests for busy in self._busy.values())

    def listen(self, addresses: Iterable[Address], listener: Listener) -> None:
        for address in addresses:
            self._listeners.setdefault(address, []).append(listener)
        self._listener_count += 1

    def listener_count(self) -> int:
        return self._listener_count

    def clear_listeners(self) -> None:
        self._listeners.clear()
        self._listener_count = 0

    def _notify(self, address: Address) -> None:
        for listener in self._listeners.get(address, ()):
            listener(address)
