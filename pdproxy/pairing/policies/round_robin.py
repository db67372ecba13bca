"""Round robin: the reference behaviour of vLLM's example proxy, one cursor per role."""

from __future__ import annotations

from collections.abc import Sequence

from pdproxy.registry.table import Instance


class RoundRobin:
    """Candidates in turn. With `rotate`, every full cycle starts one place further on.

    Two plain cursors over fleets of equal size move in lockstep: with 2 P and 2 D only the
    pairs (P0, D0) and (P1, D1) would ever carry KV. Rotating one role's cycle walks all n x n
    pairs in n x n requests, and each instance still gets exactly one turn per cycle.
    """

    name = "round_robin"

    def __init__(self, rotate: bool = False) -> None:
        self._rotate = rotate

    def choose(self, candidates: Sequence[Instance], ticket: int) -> Instance:
        count = len(candidates)
        if self._rotate:
            ticket += ticket // count
        return candidates[ticket % count]
