"""The one protocol every selection policy implements."""

from __future__ import annotations

from typing import Protocol

from pdproxy.pairing.candidates import Candidates
from pdproxy.pairing.features import RequestFeatures
from pdproxy.registry.table import Instance


class Policy(Protocol):
    """Pick one of `candidates` for `request`. `ticket` increases by one per decision of the
    caller's role, so policies without state can still take turns or draw lots. Policies do no
    I/O and read no clock: the same inputs give the same choice."""

    name: str

    def choose(self, candidates: Candidates, request: RequestFeatures, ticket: int) -> Instance: ...
