"""A counting semaphore, cheap when a slot is free (taking one is one test, giving it back one
more: docs/performance.md, "Slots"): the upstream exchanges and the admission wait on it.

A slot given back while someone waits goes straight to the longest waiting; one handed to a
waiter that is cancelled before it runs is passed on, so a slot is never lost. The invariant
that keeps taking cheap: while a slot is free nobody waits (a waiter only queues when none is).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque


class Slots:
    __slots__ = ("_free", "_loop", "_waiters")

    def __init__(self, loop: asyncio.AbstractEventLoop, count: int) -> None:
        if count < 1:
            raise ValueError(f"need at least one slot, got {count}")
        self._loop = loop
        self._free = count
        self._waiters: deque[asyncio.Future[None]] = deque()

    def all_taken(self) -> bool:
        return not self._free

    def free(self) -> int:
        """Slots free now (none while anyone waits)."""
        return self._free

    def try_take(self) -> bool:
        """Take a free slot now; False if there is none."""
        if self._free:
            self._free -= 1
            return True
        return False

    async def take(self) -> None:
        """Wait for a slot, in turn. Unbounded: the caller bounds the wait."""
        if self.try_take():
            return
        waiter = self._loop.create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.give_back()  # handed a slot, but cancelled before it could run
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            raise

    def give_back(self) -> bool:
        """Hand the slot to the longest waiting (True), or free it."""
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return True
        self._free += 1
        return False
