"""The proxy's own legs in flight, per instance: the load no announcement has shown yet. Pure.

Announced load lags by a report period (up to a second); without this count every request of a
burst would go to the instance that looked idle at the last report. To read a report net of
the proxy's own legs (what is left is other replicas' and clients' load), the own legs at the
moment the report was first seen are kept with it (`report`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pdproxy.ids import Address
from pdproxy.registry.messages import Load


@dataclass(slots=True)
class Busy:
    requests: int = 0
    tokens: int = 0


_IDLE = Busy()

# How far each new report moves the averages in Report (a report a second: about 4 s memory).
REPORT_SMOOTHING = 0.25


def requests_in(load: Load | None) -> int:
    return 0 if load is None else (load.running or 0) + (load.waiting or 0)


@dataclass(frozen=True, slots=True)
class Report:
    """An instance's announced load as this proxy first saw it: `own`, its own legs there at
    that moment (the part of the announcement that is its own); and, averaged over the reports
    seen, the requests announced beyond those legs and those legs themselves."""

    load: Load | None
    own: Busy
    others_requests: float
    own_requests: float


# Told the instance and its own legs there now (the Busy is read-only to listeners).
Listener = Callable[[Address, Busy], None]


class InFlight:
    def __init__(self) -> None:
        self._busy: dict[Address, Busy] = {}
        # Score boards of the current fleet index, told of every change to an instance they
        # hold, so they stay exact without rescanning their candidates.
        self._listeners: dict[Address, list[Listener]] = {}
        self._listener_count = 0
        # The latest report seen per instance; kept to the current fleet by keep_reports.
        self._reports: dict[Address, Report] = {}
        # Prefill work announced beyond the own legs, per instance, as each report arrives
        # (follow_work); kept to the current fleet by keep_reports too.
        self._work: dict[Address, float] = {}
        self.follows_work = False

    def get(self, address: Address) -> Busy:
        return self._busy.get(address, _IDLE)

    def add(self, address: Address, tokens: int) -> Busy:
        """Count a leg in; returns the instance's own legs now (read-only)."""
        busy = self._busy.get(address)
        if busy is None:
            busy = self._busy[address] = Busy()
        busy.requests += 1
        busy.tokens += tokens
        self._notify(address, busy)
        return busy

    def remove(self, address: Address, tokens: int) -> Busy:
        """Count a leg out; returns the instance's own legs now (read-only)."""
        busy = self._busy.get(address)
        if busy is None:
            raise ValueError(f"no leg in flight on {address}")
        busy.requests -= 1
        busy.tokens -= tokens
        if busy.requests == 0:
            # Bounded by what is in flight, not by every instance ever seen.
            del self._busy[address]
            busy = _IDLE
        self._notify(address, busy)
        return busy

    def total_requests(self) -> int:
        return sum(busy.requests for busy in self._busy.values())

    def report(self, address: Address, load: Load | None) -> Report:
        """`load` as first seen: the first call with a load unequal to the last one takes the
        own legs now, later calls get the same Report. Score boards are rebuilt with every
        snapshot, mostly for other instances' reports: taking the own legs anew each time
        would read the legs placed since the report as already in it, and others' load would
        shrink to nothing between reports. (Two equal reports in a row read as one.)"""
        known = self._reports.get(address)
        if known is not None and (known.load is load or known.load == load):
            return known
        busy = self._busy.get(address, _IDLE)
        others = float(max(0, requests_in(load) - busy.requests))
        own = float(busy.requests)
        if known is not None:
            others = known.others_requests + REPORT_SMOOTHING * (others - known.others_requests)
            own = known.own_requests + REPORT_SMOOTHING * (own - known.own_requests)
        report = Report(load, Busy(busy.requests, busy.tokens), others, own)
        self._reports[address] = report
        return report

    def keep_reports(self, addresses: Iterable[Address]) -> None:
        """Forget the reports of instances not in `addresses` (bounded by the fleet)."""
        keep = set(addresses)
        self._reports = {a: r for a, r in self._reports.items() if a in keep}
        self._work = {a: w for a, w in self._work.items() if a in keep}

    def follow_work(self) -> None:
        """From now on every announced prefill work is handed to `announced_work` as it
        arrives (the registry's listener): score boards may then rely on it."""
        self.follows_work = True

    def announced_work(self, address: Address, prefill_tokens: int) -> None:
        """A prefill announced its work: what is not the own legs there now is the other
        replicas' and clients'. The boards that hold the instance rescore it at once, with no
        rebuild: reports come every few milliseconds."""
        busy = self.get(address)
        self._work[address] = float(max(0, prefill_tokens - busy.tokens))
        self._notify(address, busy)

    def others_work(self, address: Address, load: Load | None) -> float | None:
        """The prefill work beyond the own legs: the latest announcement's as it arrived,
        else the snapshot's (net of the own legs when it was first seen); None if unknown."""
        work = self._work.get(address)
        if work is not None:
            return work
        if load is None or load.prefill_tokens is None:
            return None
        return float(max(0, load.prefill_tokens - self.report(address, load).own.tokens))

    def listen(self, addresses: Iterable[Address], listener: Listener) -> None:
        for address in addresses:
            self._listeners.setdefault(address, []).append(listener)
        self._listener_count += 1

    def listener_count(self) -> int:
        return self._listener_count

    def clear_listeners(self) -> None:
        self._listeners.clear()
        self._listener_count = 0

    def _notify(self, address: Address, busy: Busy) -> None:
        # Handed the Busy: a listener would otherwise look it up again (a request's legs start
        # and end four times; docs/performance.md, "Calls on the request path").
        for listener in self._listeners.get(address, ()):
            listener(address, busy)
