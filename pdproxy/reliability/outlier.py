"""Outlier ejection: a circuit per instance, closed / open / half-open. Pure: `now` is passed in.

Closed: the instance takes traffic; `consecutive_failures` failures in a row open the circuit.
Open: the instance is ejected (left out of routing) for a cool-down that doubles with every
ejection, up to a cap. Half-open: the cool-down ended, the instance takes traffic again on
probation; its first success closes the circuit, its first failure opens it again at once with
a longer cool-down. A long enough healthy spell forgets past ejections.

As in Envoy's outlier detection, at most `max_ejection_percent` of a role is ejected at a time:
ejecting the whole fleet would turn a partial outage into a total one, and retries route
around an instance that stays in rotation while failing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum


class Circuit(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


CIRCUIT_LEVEL = {Circuit.CLOSED: 0, Circuit.HALF_OPEN: 1, Circuit.OPEN: 2}  # a gauge's value


@dataclass(frozen=True, slots=True)
class OutlierPolicy:
    consecutive_failures: int = 5
    base_ejection_seconds: float = 5.0
    max_ejection_seconds: float = 300.0
    max_ejection_percent: int = 50

    def __post_init__(self) -> None:
        if self.consecutive_failures < 1:
            raise ValueError("consecutive_failures must be at least 1")
        if not 0 < self.base_ejection_seconds <= self.max_ejection_seconds:
            raise ValueError("need 0 < base_ejection_seconds <= max_ejection_seconds")
        if not 0 <= self.max_ejection_percent <= 100:
            raise ValueError("max_ejection_percent must be in 0..100")

    def cool_down(self, ejections: int) -> float:
        """How long the `ejections`-th ejection (1-based) lasts."""
        doublings = min(ejections - 1, 32)  # 2**32 times any base is past every sane cap
        return min(self.max_ejection_seconds, self.base_ejection_seconds * 2.0**doublings)


@dataclass(slots=True)
class _Record:
    role: str
    circuit: Circuit = Circuit.CLOSED
    consecutive: int = 0
    ejections: int = 0  # how many times in a row of bad spells; grows the cool-down
    open_until: float = 0.0
    ejected_at: float = float("-inf")
    healthy_since: float = 0.0


@dataclass(frozen=True, slots=True)
class OutlierStatus:
    """What /v1/instances shows about one instance."""

    circuit: Circuit
    consecutive_failures: int
    ejections: int
    ejected_for_seconds: float  # 0 unless open


class OutlierDetector:
    def __init__(self, policy: OutlierPolicy) -> None:
        self.policy = policy
        self._records: dict[str, _Record] = {}
        self._ejected: frozenset[str] = frozenset()
        # Bumped whenever the ejected set changes (for whoever caches on it).
        self.version = 0

    def ejected(self, now: float) -> frozenset[str]:
        """Instances to keep out of routing now; cool-downs that ended turn half-open here."""
        if self._ejected:
            ended = [name for name in self._ejected if self._records[name].open_until <= now]
            for name in ended:
                self._records[name].circuit = Circuit.HALF_OPEN
            if ended:
                self._set_ejected(self._ejected.difference(ended))
        return self._ejected

    def success(self, name: str, role: str, now: float, began: float | None = None) -> None:
        """A leg that `began` at that time ended well (None: it began just now)."""
        record = self._records.get(name)
        if record is None:
            return  # never failed: nothing to remember (state stays bounded by failures)
        if record.circuit is Circuit.OPEN or _before(began, record.ejected_at):
            return  # a leg sent before the ejection proves nothing about the instance now
        if record.circuit is Circuit.HALF_OPEN:
            record.circuit = Circuit.CLOSED
            record.healthy_since = now
        record.consecutive = 0
        if now - record.healthy_since >= self.policy.max_ejection_seconds:
            del self._records[name]  # a long healthy spell: past ejections are forgiven

    def probe_succeeded(self, name: str, now: float) -> None:
        """An active health probe answered: it may close a half-open circuit, but it does not
        clear failures of real requests (an instance can answer /health and fail every
        completion)."""
        record = self._records.get(name)
        if record is not None and record.circuit is Circuit.HALF_OPEN:
            record.circuit = Circuit.CLOSED
            record.consecutive = 0
            record.healthy_since = now

    def failure(
        self, name: str, role: str, now: float, role_size: int, began: float | None = None
    ) -> bool:
        """Count a failure of a leg that `began` then; True when it ejected the instance."""
        record = self._records.get(name)
        if record is None:
            record = self._records[name] = _Record(role, healthy_since=now)
        if record.circuit is Circuit.OPEN or _before(began, record.ejected_at):
            return False  # already out, or a failure the last ejection already paid for
        record.consecutive += 1
        probation = record.circuit is Circuit.HALF_OPEN
        if not probation and record.consecutive < self.policy.consecutive_failures:
            return False
        if not self._room_to_eject(role, role_size):
            return False
        record.ejections += 1
        record.circuit = Circuit.OPEN
        record.ejected_at = now
        record.open_until = now + self.policy.cool_down(record.ejections)
        self._set_ejected(self._ejected | {name})
        return True

    def status(self, name: str, now: float) -> OutlierStatus:
        record = self._records.get(name)
        if record is None:
            return OutlierStatus(Circuit.CLOSED, 0, 0, 0.0)
        left = 0.0
        if record.circuit is Circuit.OPEN:
            # From the ejection's own length, not from open_until: (t + d) - t may exceed d by a
            # rounding error, and an ejection never lasts longer than its cool-down.
            cool_down = self.policy.cool_down(record.ejections)
            left = max(0.0, cool_down - max(0.0, now - record.ejected_at))
        return OutlierStatus(record.circuit, record.consecutive, record.ejections, left)

    def circuits(self) -> dict[str, Circuit]:
        """Every instance whose circuit is not plainly closed and clean (for the state gauge)."""
        return {name: record.circuit for name, record in self._records.items()}

    def retain(self, names: Iterable[str]) -> None:
        """Forget instances that left the registry: state stays bounded by the fleet."""
        keep = set(names)
        for name in [n for n in self._records if n not in keep]:
            del self._records[name]
        if not self._ejected <= keep:
            self._set_ejected(self._ejected & keep)

    def _room_to_eject(self, role: str, role_size: int) -> bool:
        ejected = sum(1 for name in self._ejected if self._records[name].role == role)
        return (ejected + 1) * 100 <= self.policy.max_ejection_percent * role_size

    def _set_ejected(self, ejected: frozenset[str]) -> None:
        self._ejected = ejected
        self.version += 1


def _before(began: float | None, ejected_at: float) -> bool:
    return began is not None and began < ejected_at
