"""Round robin: the reference behaviour of vLLM's example proxy, one cursor per role."""

from __future__ import annotations

from collections.abc import Sequence

from pdproxy.registry.table import Instance


class RoundRobin:
    name = "round_robin"

    def choose(self, candidates: Sequence[Instance], ticket: int) -> Instance:
        return candidates[ticket % len(candidates)]
