"""Prefix affinity (for prefill): requests whose prompts start alike go to the same instance,
whose prefix cache then skips that part of the prefill.

The prompt's leading block(s) hash onto a consistent-hash ring of the candidates, so adding or
removing one of N instances moves only about 1/N of the prefixes. Bounded load (Mirrokni,
Thorup and Zadimoghaddam, "Consistent Hashing with Bounded Loads", 2018): an instance already
holding more than `load_factor` times the average load is passed over for the next one on the
ring, so a hot prefix spills to a few neighbours instead of swamping one instance.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass

from pdproxy.ids import Address
from pdproxy.pairing.candidates import Candidates
from pdproxy.pairing.features import RequestFeatures
from pdproxy.pairing.scoreboard import LoadKind
from pdproxy.registry.table import Instance

# Points per instance: enough that each instance's share of the ring is within a few percent
# of 1/N; a ring of 1,000 instances still builds in tens of milliseconds.
VIRTUAL_NODES = 64
_RINGS_KEPT = 4  # memberships remembered: load-only snapshot changes reuse the ring


@dataclass(frozen=True, slots=True)
class Ring:
    points: list[int]  # sorted 64-bit positions
    owners: list[int]  # owners[k]: candidate position owning points[k]


def point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def build_ring(addresses: tuple[Address, ...]) -> Ring:
    placed = sorted(
        (point(f"{address}#{v}"), position)
        for position, address in enumerate(addresses)
        for v in range(VIRTUAL_NODES)
    )
    return Ring([p for p, _ in placed], [owner for _, owner in placed])


class PrefixAffinity:
    name = "prefix_affinity"

    def __init__(self, load_factor: float = 1.25) -> None:
        if load_factor < 1:
            raise ValueError("load_factor must be at least 1")
        self._load_factor = load_factor
        self._rings: OrderedDict[tuple[Address, ...], Ring] = OrderedDict()

    def choose(self, candidates: Candidates, request: RequestFeatures, ticket: int) -> Instance:
        board = candidates.board(LoadKind.REQUESTS)
        if request.prefix_key is None or len(candidates) == 1:
            return candidates.instances[board.best()]
        ring = candidates.derived(self.name, self._ring_for)
        # With the request placed, no instance may exceed load_factor x the mean: some
        # instance is always below that, so the walk ends.
        cap = math.ceil(self._load_factor * (board.total + 1) / len(candidates))
        values = board.values
        owners = ring.owners
        start = bisect.bisect_left(ring.points, request.prefix_key)
        for step in range(len(owners)):
            owner = owners[(start + step) % len(owners)]
            if values[owner] + 1 <= cap:
                return candidates.instances[owner]
        return candidates.instances[board.best()]  # unreachable: kept as a safe answer

    def _ring_for(self, instances: tuple[Instance, ...]) -> Ring:
        addresses = tuple(instance.http_address for instance in instances)
        ring = self._rings.get(addresses)
        if ring is None:
            ring = build_ring(addresses)
            self._rings[addresses] = ring
            while len(self._rings) > _RINGS_KEPT:
                self._rings.popitem(last=False)
        else:
            self._rings.move_to_end(addresses)
        return ring
