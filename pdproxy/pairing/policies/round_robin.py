"""Round robin: the reference behaviour of vLLM's example proxy, one cursor per role."""

from __future__ import annotations

from pdproxy.pairing.candidates import Candidates
from pdproxy.pairing.features import RequestFeatures
from pdproxy.registry.table import Instance


class RoundRobin:
    name = "round_robin"

    def choose(self, candidates: Candidates, request: RequestFeatures, ticket: int) -> Instance:
        return candidates.instances[ticket % len(candidates)]
