"""The one protocol every selection policy implements."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pdproxy.registry.table import Instance


class Policy(Protocol):
    """Pick one of `candidates` (never empty). `ticket` increases by one per decision of the
    caller's role, so stateless policies can still take turns; policies do no I/O."""

    name: str

    def choose(self, candidates: Sequence[Instance], ticket: int) -> Instance: ...
