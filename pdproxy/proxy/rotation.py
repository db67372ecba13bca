"""Which instances take new legs: the planner's choice among those in rotation, and the
bookkeeping that keeps the rotation true.

Out of rotation are instances the outlier detector ejected, instances an operator drained, and
instances at their in-flight cap. A request that finds every compatible instance at its cap
waits (bounded, and in the admission queue) until a leg ends. Each chosen leg is a lease
(proxy/lease.py): its end goes once through `release`, its outcome once through `succeeded` /
`failed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from pdproxy.base.roles import Role
from pdproxy.config import Settings
from pdproxy.ids import Address
from pdproxy.metrics import Metrics
from pdproxy.pairing.features import RequestFeatures
from pdproxy.pairing.planner import Direct, NoPair, Pair, Planner, Unpaired
from pdproxy.proxy.admission import Admission
from pdproxy.proxy.errors import ProxyError
from pdproxy.registry.table import Instance, RegistryTable, Snapshot
from pdproxy.reliability.outlier import OutlierDetector

log = logging.getLogger("pdproxy.rotation")

# While requests wait for an instance below its cap, they look again at least this often
# (an ejection may have ended without any leg ending).
_CAPACITY_RECHECK_SECONDS = 0.25


class Rotation:
    def __init__(
        self,
        settings: Settings,
        table: RegistryTable,
        planner: Planner,
        outliers: OutlierDetector,
        admission: Admission,
        metrics: Metrics,
        clock: Callable[[], float],
    ) -> None:
        self._settings = settings
        self._table = table
        self._planner = planner
        self._outliers = outliers
        self._admission = admission
        self.metrics = metrics  # the legs' leases count with it too
        self._clock = clock
        # The time legs are stamped with when they begin (the clock itself, not a method
        # calling it: two legs per request).
        self.now: Callable[[], float] = clock
        # Instances an operator drained: no new legs; those in flight finish.
        self.drained: frozenset[str] = frozenset()
        self._capacity_freed = asyncio.Event()
        self._retained_version = -1
        self.retry_after = ((b"retry-after", str(settings.retry_after_seconds).encode()),)

    def set_drained(self, drained: frozenset[str]) -> None:
        """The operator's drained set, from whoever owns it (pdproxy.registry.control)."""
        self.drained = drained

    def out_of_rotation(self, now: float) -> frozenset[str]:
        """Instances that are not healthy to route to: ejected or drained (readiness)."""
        ejected = self._outliers.ejected(now)
        return ejected | self.drained if self.drained else ejected

    def snapshot(self, now: float) -> Snapshot:
        snapshot = self._table.snapshot(now)
        if snapshot.version != self._retained_version:
            # Membership may have changed: forget the health of instances that left (those
            # announced unhealthy are still registered and keep theirs).
            self._outliers.retain(e.instance.name for e in self._table.registrations())
            self._retained_version = snapshot.version
        return snapshot

    async def wait_for_pair(self, features: RequestFeatures, avoid: frozenset[str]) -> Pair:
        """A pair once a busy instance has room (`plan` found none free): the wait, bounded
        by --queue-timeout, while every compatible instance is at its cap."""
        # Waiting for a busy instance takes a place in the one bounded queue.
        with self._admission.queued():
            wait_until = asyncio.get_running_loop().time() + self._settings.queue_timeout
            while True:
                await self._wait_for_capacity(wait_until)
                pair = self.plan(features, avoid)
                if pair is not None:
                    return pair

    def plan(self, features: RequestFeatures, avoid: frozenset[str]) -> Pair | None:
        """A pair now, or None while busy instances are all that stands in the way; raises
        when no compatible pair could serve even if they were free."""
        now = self._clock()
        snapshot = self.snapshot(now)
        excluded = self.out_of_rotation(now)
        busy = self._planner.full
        choice = self._planner.plan(snapshot, features, excluded=excluded, avoid=avoid, busy=busy)
        if isinstance(choice, Pair):
            return choice
        blocked = self._planner.index(snapshot, excluded).view(features.model)
        if not busy or blocked.prefills is None:
            raise self._unknown_model(features.model) or self._unpaired(choice, excluded)
        return None

    async def choose_one(self, role: Role, model: str | None, avoid: frozenset[str]) -> Instance:
        """One instance of `role` serving `model` (None: any) for a request that needs no
        pair (a passed-through path), waiting (bounded) as `wait_for_pair` does while every
        one of them is at its cap."""
        instance = self._plan_one(role, model, avoid)
        if instance is not None:
            return instance
        with self._admission.queued():
            wait_until = asyncio.get_running_loop().time() + self._settings.queue_timeout
            while True:
                await self._wait_for_capacity(wait_until)
                instance = self._plan_one(role, model, avoid)
                if instance is not None:
                    return instance

    def _plan_one(self, role: Role, model: str | None, avoid: frozenset[str]) -> Instance | None:
        now = self._clock()
        snapshot = self.snapshot(now)
        excluded = self.out_of_rotation(now)
        busy = self._planner.full
        chosen = self._planner.plan_one(
            snapshot, role, model, excluded=excluded, avoid=avoid, busy=busy
        )
        if chosen is not None:
            return chosen
        if not busy or self._planner.index(snapshot, excluded).members(role, model) is None:
            kind = Unpaired.NO_PREFILL if role is Role.PREFILL else Unpaired.NO_DECODE
            served = "any model" if model is None else f"model {model!r}"
            unknown = None if model is None else self._unknown_model(model)
            raise unknown or self._unpaired(
                NoPair(kind, f"no {role} instance serves {served}"), excluded
            )
        return None

    def choose_direct(self, features: RequestFeatures, avoid: frozenset[str]) -> Direct | None:
        now = self._clock()
        return self._planner.plan_direct(
            self.snapshot(now),
            features,
            excluded=self.out_of_rotation(now),
            avoid=avoid,
            busy=self._planner.full,
        )

    def release(self, address: Address, tokens: int) -> None:
        full = self._planner.full
        name = str(address) if full else ""
        self._planner.release(address, tokens)
        if name in full and name not in self._planner.full:
            # Wake every waiter: each plans again (bounded by the queue's size).
            self._capacity_freed.set()
            self._capacity_freed = asyncio.Event()

    def succeeded(self, role: Role, instance: Instance, began: float) -> None:
        self._outliers.success(instance.name, role, self._clock(), began)

    def failed(self, role: Role, instance: Instance, began: float) -> None:
        now = self._clock()
        if not self._outliers.failure(instance.name, role, now, self._serving(role), began):
            return
        self.metrics.ejections.labels(role).inc()
        status = self._outliers.status(instance.name, now)
        log.warning(
            "%s instance %s ejected for %.1fs after %d failures in a row (ejection %d)",
            role,
            instance.name,
            status.ejected_for_seconds,
            status.consecutive_failures,
            status.ejections,
        )

    def _serving(self, role: Role) -> int:
        """Instances of `role` that take traffic at all (routable: not announced unhealthy,
        not an unready or annotated pod; not drained): the ejection cap is a share of these."""
        snapshot = self._table.snapshot()
        members = snapshot.prefills if role is Role.PREFILL else snapshot.decodes
        return sum(1 for i in members if i.name not in self.drained)

    def _unknown_model(self, model: str) -> ProxyError | None:
        """vLLM's 404 for a model that no registered instance serves (in rotation or not,
        healthy or not) while some are registered: waiting would not help, so no Retry-After.
        An empty registry (a fleet still starting) stays a 503."""
        registered = [entry.instance for entry in self._table.registrations()]
        if not registered or any(instance.serves(model) for instance in registered):
            return None
        self.metrics.unpaired.labels(Unpaired.NO_INSTANCE.value).inc()
        return ProxyError(
            404, f"The model `{model}` does not exist.", code="model_not_found", param="model"
        )

    def _unpaired(self, choice: NoPair, excluded: frozenset[str]) -> ProxyError:
        self.metrics.unpaired.labels(choice.kind.value).inc()
        reason = choice.reason
        if excluded:
            reason += f" ({len(excluded)} instance(s) out of rotation: ejected or drained)"
        return ProxyError(503, reason, code="no_instance", headers=self.retry_after)

    async def _wait_for_capacity(self, wait_until: float) -> None:
        left = wait_until - asyncio.get_running_loop().time()
        if left <= 0:
            cap = self._settings.instance_max_inflight
            raise ProxyError(
                503,
                f"every compatible instance stayed at its cap of {cap} legs in flight for "
                f"{self._settings.queue_timeout:g}s",
                code="instances_busy",
                headers=self.retry_after,
            )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(left, _CAPACITY_RECHECK_SECONDS)):
                await self._capacity_freed.wait()
