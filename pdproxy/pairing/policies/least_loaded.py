"""Least loaded: fewest requests, counting the proxy's own legs in flight and the announced
running and waiting requests."""

from __future__ import annotations

from pdproxy.pairing.candidates import Candidates
from pdproxy.pairing.features import RequestFeatures
from pdproxy.pairing.scoreboard import LoadKind
from pdproxy.registry.table import Instance


class LeastLoaded:
    name = "least_loaded"

    def choose(self, candidates: Candidates, request: RequestFeatures, ticket: int) -> Instance:
        return candidates.instances[candidates.board(LoadKind.REQUESTS).best()]
