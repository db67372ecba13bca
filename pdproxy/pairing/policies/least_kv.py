"""Least KV (for decode): the instance whose KV cache is emptiest, counting the announced
kv_usage plus the tokens of the proxy's legs in flight there (which the next report will show).

A decode instance with a full KV cache queues new requests, so this is what keeps time to
first token flat."""

from __future__ import annotations

from pdproxy.pairing.candidates import Candidates
from pdproxy.pairing.features import RequestFeatures
from pdproxy.pairing.scoreboard import LoadKind
from pdproxy.registry.table import Instance


class LeastKv:
    name = "least_kv"

    def choose(self, candidates: Candidates, request: RequestFeatures, ticket: int) -> Instance:
        return candidates.instances[candidates.board(LoadKind.KV).best()]
