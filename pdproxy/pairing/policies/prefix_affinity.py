"""Prefix affinity (for prefill): requests whose prompts start alike go to the same instance,
whose prefix cache then skips that part of the prefill.

The prompt's leading block(s) hash onto a consistent-hash ring of the candidates, so adding or
removing one of N instances moves only about 1/N of the prefixes. Bounded load (Mirrokni,
Thorup and Zadimoghaddam, "Consistent Hashing with Bounded Loads", 2018), on prefill work
rather than on request counts: an instance that would hold more than `load_factor` times the
mean is passed over for the next one on the ring, so a hot prefix spills to a few neighbours
instead of swamping one instance.

Prefill work is the prompt tokens of the proxy's own legs in flight, less what each instance
probably holds cached (see prefix_cache.py), scaled up by the share of the fleet's requests the
other proxy replicas and clients hold, as the instances announce it (scoreboard.py,
LoadKind.PREFILL_WORK): a replica that holds a third of the legs bounds the fleet's load, not a
third of it. The announced queues themselves are not added per instance: they are up to 1.5 s
old, prefills turn over in tens of milliseconds, and every replica reading the same stale
queues made the same choices at once (docs/performance.md, "Several replicas").
"""

from __future__ import annotations

import bisect
import hashlib
import sys
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from pdproxy.ids import Address
from pdproxy.pairing.candidates import Candidates
from pdproxy.pairing.features import RequestFeatures
from pdproxy.pairing.scoreboard import LoadKind
from pdproxy.registry.table import Instance

# Points per instance: enough that each instance's share of the ring is within a few percent
# of 1/N. Rings are built once per membership, on the first request after an instance joins
# or leaves.
VIRTUAL_NODES = 64
_RINGS_KEPT = 16  # memberships remembered (one per prefill candidate set: model, geometry)
# Ring points visited before giving up on the prefix's neighbourhood: bounds the decision.
MAX_WALK = 8


@dataclass(frozen=True, slots=True)
class Ring:
    points: list[int]  # sorted 64-bit positions
    owners: list[int]  # owners[k]: candidate position owning points[k]


def instance_points(address: Address) -> array[int]:
    """The instance's VIRTUAL_NODES ring positions: one extendable-output hash per instance, not
    one hash call per point (docs/performance.md, "Pairing decisions")."""
    stream = hashlib.shake_128(str(address).encode()).digest(8 * VIRTUAL_NODES)
    points = array("Q", stream)
    if sys.byteorder == "big":
        points.byteswap()  # little-endian words everywhere: every replica builds the same ring
    return points


def build_ring(addresses: tuple[Address, ...]) -> Ring:
    points: list[int] = []
    owners: list[int] = []
    for position, address in enumerate(addresses):
        points.extend(instance_points(address))
        owners.extend([position] * VIRTUAL_NODES)
    order = sorted(range(len(points)), key=points.__getitem__)
    return Ring([points[k] for k in order], [owners[k] for k in order])


class PrefixAffinity:
    name = "prefix_affinity"

    def __init__(self, load_factor: float = 1.25) -> None:
        if load_factor < 1:
            raise ValueError("load_factor must be at least 1")
        self._load_factor = load_factor
        self._rings: OrderedDict[tuple[Address, ...], Ring] = OrderedDict()

    def choose(self, candidates: Candidates, request: RequestFeatures, ticket: int) -> Instance:
        board = candidates.board(LoadKind.PREFILL_WORK)
        least = board.best()
        if request.prefix_key is None or len(candidates) == 1:
            return candidates.instances[least]
        ring = candidates.derived(self.name, self._ring_for)
        # Load is prefill work in flight (the fleet's: scaled). An instance may take the request
        # if it then holds at most load_factor x the mean, or no more than the least loaded one
        # would (so an evenly loaded fleet always honours the prefix, whatever the prompt's
        # size). Its work for this request is the part of the prompt it probably does not hold
        # already.
        full = max(1, request.prompt_tokens)
        values = board.values
        cap = max(self._load_factor * (board.total + full) / len(candidates), values[least] + full)
        cache = candidates.prefix_cache
        windows = request.prefix_windows
        owners = ring.owners
        start = bisect.bisect_left(ring.points, request.prefix_key)
        for step in range(min(len(owners), MAX_WALK)):
            owner = owners[(start + step) % len(owners)]
            load = values[owner]
            if load + 1 > cap:
                continue  # full whatever it holds: no need to ask the cache
            if load + full > cap:
                address = candidates.instances[owner].http_address
                if load + max(1, full - cache.cached_tokens(windows, address)) > cap:
                    continue
            return candidates.instances[owner]
        # Every neighbour is busy: the prefix spills to the least loaded instance.
        return candidates.instances[least]

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
