"""Power of two choices: draw two candidates, send to the less loaded. Nearly as even as least
loaded, without every proxy replica herding onto the same instance."""

from __future__ import annotations

from pdproxy.pairing.candidates import Candidates
from pdproxy.pairing.features import RequestFeatures
from pdproxy.pairing.scoreboard import LoadKind
from pdproxy.registry.table import Instance

_MASK = (1 << 64) - 1


def mix64(value: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit value from a counter (no RNG state)."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


class PowerOfTwo:
    name = "power_of_two"

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed

    def choose(self, candidates: Candidates, request: RequestFeatures, ticket: int) -> Instance:
        n = len(candidates)
        if n == 1:
            return candidates.instances[0]
        draw = mix64(ticket ^ self._seed)
        first = draw % n
        second = (draw >> 32) % (n - 1)
        if second >= first:
            second += 1  # two distinct candidates
        values = candidates.board(LoadKind.REQUESTS).values
        return candidates.instances[second if values[second] < values[first] else first]
