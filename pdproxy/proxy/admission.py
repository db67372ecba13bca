"""Admission control: a proxy-wide cap on completion requests in flight, one bounded FIFO
queue in front of it, and the drain switch.

Beyond the queue a request gets 429 at once; one that waited `queue_timeout` gets 503; both
with Retry-After. Requests waiting for an instance below its in-flight cap (the rotation's
wait) take places in the same queue, so one number bounds every waiting request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from pdproxy.http.slots import Slots
from pdproxy.metrics import Metrics
from pdproxy.proxy.errors import ProxyError


class Admission:
    def __init__(
        self,
        limit: int,
        queue_limit: int,
        queue_timeout: float,
        retry_after_seconds: int,
        metrics: Metrics,
    ) -> None:
        self._limit = limit
        self._queue_limit = queue_limit
        self._queue_timeout = queue_timeout
        self._retry_after = ((b"retry-after", str(retry_after_seconds).encode()),)
        self._metrics = metrics
        # FIFO: a slot given back goes straight to the longest waiting request.
        self._slots = Slots(asyncio.get_running_loop(), limit)
        self.waiting = 0
        self.closing = False
        # False: the metrics read the count at scrape time (one process), nothing to report.
        self._reports = not metrics.read_admitted(lambda: self.active)

    @property
    def active(self) -> int:
        """Requests admitted and not finished (a slot handed on stays counted)."""
        return self._limit - self._slots.free()

    @property
    def idle(self) -> bool:
        return self.active == 0 and self.waiting == 0

    def try_enter(self) -> bool:
        """Take a free slot now (True), or find none (False: `await enter()` waits for one);
        refused while draining. The slot is held until `leave()`."""
        self.refuse_if_closing()
        if self._slots.try_take():
            if self._reports:
                self._metrics.set_admitted(self.active)
            return True
        return False

    async def enter(self) -> None:
        """Wait in the queue for a slot (after `try_enter` found none), bounded by
        queue_timeout; held until `leave()`."""
        try:
            await self._wait_for_slot()
        finally:
            # Exact however the wait ended: a slot handed over just as it timed out or was
            # cancelled went on to the next waiter, or back to the free ones.
            if self._reports:
                self._metrics.set_admitted(self.active)

    def leave(self) -> None:
        if not self._slots.give_back() and self._reports:
            self._metrics.set_admitted(self.active)

    @contextlib.contextmanager
    def queued(self) -> Iterator[None]:
        """A place in the queue while waiting for something; 429 when none is left."""
        if self.waiting >= self._queue_limit:
            self._refused("queue_full")
            raise ProxyError(
                429,
                f"pdproxy is at capacity: {self.waiting} requests are already waiting",
                code="queue_full",
                headers=self._retry_after,
            )
        self.waiting += 1
        self._metrics.queued.set(self.waiting)
        try:
            yield
        finally:
            self.waiting -= 1
            self._metrics.queued.set(self.waiting)

    def refuse_if_closing(self) -> None:
        if self.closing:
            self._refused("draining")
            raise ProxyError(
                503,
                "pdproxy is shutting down; retry on another replica",
                code="draining",
                headers=((b"connection", b"close"), *self._retry_after),
            )

    async def _wait_for_slot(self) -> None:
        with self.queued():
            try:
                async with asyncio.timeout(self._queue_timeout):
                    await self._slots.take()
            except TimeoutError:
                self._refused("queue_timeout")
                raise ProxyError(
                    503,
                    f"no free slot within {self._queue_timeout:g}s: {self._limit} requests are "
                    "in flight",
                    code="queue_timeout",
                    headers=self._retry_after,
                ) from None

    def _refused(self, reason: str) -> None:
        self._metrics.refused.labels(reason).inc()
