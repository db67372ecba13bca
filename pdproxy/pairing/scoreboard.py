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
from pdproxy.pairing.inflight import Busy, InFlight
from pdproxy.registry.table import Instance


class LoadKind(StrEnum):
    REQUESTS = "requests"  # requests in flight or queued
    KV = "kv"  # a decode instance's KV cache, as a fraction of its capacity
    PREFILL_WORK = "prefill_work"  # prompt tokens in flight, less what was probably cached


@dataclass(frozen=True, slots=True)
class Scoring:
    """A load as two parts: what the proxy's own legs in flight put on an instance (exact,
    current) and what the instance last announced (seconds old, all clients included)."""

    own: Callable[[Busy], float]
    announced: Callable[[Instance], float]


def announced_requests(instance: Instance) -> float:
    load = instance.load
    return 0.0 if load is None else float((load.running or 0) + (load.waiting or 0))


def own_requests(busy: Busy) -> float:
    return float(busy.requests)


def announced_kv(instance: Instance) -> float:
    load = instance.load
    return 0.0 if load is None or load.kv_usage is None else load.kv_usage


def scoring(kind: LoadKind, kv_capacity_tokens: int) -> Scoring:
    if kind is LoadKind.REQUESTS:
        return Scoring(own_requests, announced_requests)
    if kind is LoadKind.PREFILL_WORK:
        return Scoring(lambda busy: float(busy.tokens), lambda instance: 0.0)
    return Scoring(lambda busy: busy.tokens / kv_capacity_tokens, announced_kv)


class ScoreBoard:
    """Score = own legs now + others' load, where others' load is the announcement minus the
    own legs in flight when the board was built (a board lives for one snapshot, which is
    rebuilt when load reports arrive). The announcement already includes the proxy's own legs
    that reached the instance, seconds late: adding both would count them twice and steer by
    stale reports (docs/performance.md, "Pairing decisions"); taking only one would ignore
    other proxy replicas and direct clients."""

    def __init__(self, instances: Sequence[Instance], scoring: Scoring, inflight: InFlight) -> None:
        self.instances = instances
        self._own = scoring.own
        self._inflight = inflight
        self._positions: dict[Address, int] = {
            instance.http_address: i for i, instance in enumerate(instances)
        }
        size = 1
        while size < len(instances):
            size *= 2
        self._size = size
        owns = [scoring.own(inflight.get(i.http_address)) for i in instances]
        self.others = [
            max(0.0, scoring.announced(i) - own) for i, own in zip(instances, owns, strict=True)
        ]
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

    def changed(self, address: Address) -> None:
        """InFlight listener: rescore one candidate, if it is one of ours."""
        position = self._positions.get(address)
        if position is None:
            return
        values = self.values
        new = self._own(self._inflight.get(address)) + self.others[position]
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
