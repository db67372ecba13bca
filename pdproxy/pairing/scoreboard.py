"""Load scores of one candidate set, kept exact as legs start and end. Pure.

A min tree over the candidates: the least loaded instance is read in O(1) and one instance's
change costs O(log n), where a linear scan per request would spend a whole decision's budget
(docs/performance.md, "Pairing decisions").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from pdproxy.ids import Address
from pdproxy.pairing.inflight import Busy, InFlight, Report, requests_in
from pdproxy.registry.table import Instance


class LoadKind(StrEnum):
    REQUESTS = "requests"  # requests in flight or queued
    KV = "kv"  # a decode instance's KV cache, as a fraction of its capacity
    PREFILL_WORK = "prefill_work"  # prompt tokens in flight, less what was probably cached


@dataclass(frozen=True, slots=True)
class Scoring:
    """A load as two parts: what the proxy's own legs in flight put on an instance (exact,
    current) and what the instance last announced (up to a second old, all clients included).
    With `scaled`, the announcement is not added per instance: it tells what share of the
    candidates' requests the proxy holds, and the own part is scaled up to the whole. With
    `announced_work`, the others' part is the prefills' own announced work (InFlight.others_work),
    updated as each report arrives."""

    own: Callable[[Busy], float]
    announced: Callable[[Instance], float]
    scaled: bool = False
    announced_work: bool = False


def announced_requests(instance: Instance) -> float:
    return float(requests_in(instance.load))


def own_requests(busy: Busy) -> float:
    return float(busy.requests)


def own_tokens(busy: Busy) -> float:
    return float(busy.tokens)


def announced_kv(instance: Instance) -> float:
    load = instance.load
    return 0.0 if load is None or load.kv_usage is None else load.kv_usage


def scoring(
    kind: LoadKind,
    kv_capacity_tokens: int,
    instances: Sequence[Instance] = (),
    inflight: InFlight | None = None,
) -> Scoring:
    if kind is LoadKind.REQUESTS:
        return Scoring(own_requests, announced_requests)
    if kind is LoadKind.PREFILL_WORK:
        # Prefills that announce their work, followed as it arrives, tell the others' part
        # exactly; otherwise the own work is scaled by the replicas' share of the requests.
        if (
            inflight is not None
            and inflight.follows_work
            and all(inflight.others_work(i.http_address, i.load) is not None for i in instances)
        ):
            return Scoring(own_tokens, announced_requests, announced_work=True)
        return Scoring(own_tokens, announced_requests, scaled=True)
    return Scoring(lambda busy: busy.tokens / kv_capacity_tokens, announced_kv)


def fleet_scale(reports: Sequence[Report]) -> float:
    """1 + (others' requests / the proxy's own), both averaged over the reports: about the
    number of proxy replicas sharing the traffic (1.0 alone, or before any report)."""
    own = math.fsum(report.own_requests for report in reports)
    others = math.fsum(report.others_requests for report in reports)
    return 1.0 + others / own if own > 0 else 1.0


def scaled_own(own: Callable[[Busy], float], scale: float) -> Callable[[Busy], float]:
    if scale == 1.0:
        return own
    return lambda busy: scale * own(busy)


class ScoreBoard:
    """Score = own legs now + others' load, where others' load is the announcement minus the
    own legs in flight when that announcement was first seen (InFlight.report): it already
    includes the proxy's own legs that had reached the instance, and adding both would count
    them twice (docs/performance.md, "Pairing decisions"); taking only one would ignore other
    proxy replicas and direct clients. A `scaled` scoring instead multiplies the own legs by
    fleet_scale (others' load: 0). A board lives for one snapshot, rebuilt when load reports
    arrive."""

    def __init__(self, instances: Sequence[Instance], scoring: Scoring, inflight: InFlight) -> None:
        self.instances = instances
        self._inflight = inflight
        self._positions: dict[Address, int] = {
            instance.http_address: i for i, instance in enumerate(instances)
        }
        size = 1
        while size < len(instances):
            size *= 2
        self._size = size
        reports = [inflight.report(i.http_address, i.load) for i in instances]
        self._announced_work = scoring.announced_work
        if scoring.scaled:
            self.scale = fleet_scale(reports)
            self._own = scaled_own(scoring.own, self.scale)
            self.others = [0.0] * len(instances)
        elif scoring.announced_work:
            self.scale = 1.0
            self._own = scoring.own
            self.others = [inflight.others_work(i.http_address, i.load) or 0.0 for i in instances]
        else:
            self.scale = 1.0
            self._own = scoring.own
            self.others = [
                max(0.0, scoring.announced(i) - scoring.own(r.own))
                for i, r in zip(instances, reports, strict=True)
            ]
        owns = [self._own(inflight.get(i.http_address)) for i in instances]
        self.values = [own + other for own, other in zip(owns, self.others, strict=True)]
        self.total = math.fsum(self.values)
        # _best[node]: index of the least loaded candidate under `node` (-1: empty leaf).
        self._best = [-1] * (2 * size)
        for i in range(len(instances)):
            self._best[size + i] = i
        for node in range(size - 1, 0, -1):
            self._best[node] = self._better(self._best[2 * node], self._best[2 * node + 1])

    def _better(self, a: int, b: int) -> int:
        if a < 0:
            return b
        if b < 0:
            return a
        # Ties go to the lower position: deterministic, and the fleet's order spreads them.
        return b if self.values[b] < self.values[a] else a

    def best(self) -> int:
        """Position of the least loaded candidate."""
        return self._best[1]

    def value_of(self, position: int) -> float:
        return self.values[position]

    def changed(self, address: Address, busy: Busy) -> None:
        """InFlight listener: rescore one candidate, if it is one of ours; `busy`: its own legs
        now."""
        position = self._positions.get(address)
        if position is None:
            return
        values = self.values
        if self._announced_work:
            self.others[position] = (
                self._inflight.others_work(address, self.instances[position].load) or 0.0
            )
        new = self._own(busy) + self.others[position]
        self.total += new - values[position]
        values[position] = new
        best = self._best
        node = (self._size + position) // 2
        while node:
            # The min of two children, inlined: this loop runs on every leg start and end.
            a, b = best[2 * node], best[2 * node + 1]
            if a < 0 or (b >= 0 and values[b] < values[a]):
                a = b
            if best[node] == a and a != position:
                break  # nothing above changes: this subtree's best is the same instance
            best[node] = a
            node //= 2
