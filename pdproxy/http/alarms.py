"""One loop timer for all of a process's request deadlines, instead of one per wait.

A request waits under four bounds (whole request, body, prefill, decode), nearly all of them
lifted long before they are due; a loop timer per bound cost more than that deserves
(docs/performance.md, "Alarms").

`Alarms` keeps the bounds in slots of time instead, in a dict, and arms one loop timer for the
earliest slot. A bound whose whole second begins more than `FINE_HORIZON` from now goes into
the coarse slot of that second (at or before the bound); when that slot is due, the bound, if
it is still waited on, moves to the fine slot (`FINE_SLOTS_PER_SECOND`) at or after it. So a
request that ends within a second of starting, nearly all of them, only adds itself to a dict
and removes itself again, and the slots kept for far bounds number one per second of the
longest timeout, not one per request.

A bound is kept late by at most one fine slot (10 ms), never early (beyond the loop timer's own
millisecond rounding).
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections.abc import Callable
from typing import Protocol

FINE_SLOTS_PER_SECOND = 100
FINE_HORIZON = 1.0  # seconds: a bound further away goes into a coarse (one second) slot
FINE_HORIZON_SLOTS = FINE_HORIZON * FINE_SLOTS_PER_SECOND


class Alarm(Protocol):
    """What a slot holds: told when its slot is due."""

    def ring(self, due: int) -> None:
        """Its slot `due` (in fine slots, see `Alarms.slot_of`) is due; the alarm is no longer
        in it. May be a slot the alarm has left (see `Alarms.add`)."""


class Alarms:
    """Slots of alarms on one event loop, and the one loop timer for the earliest slot."""

    __slots__ = ("_armed", "_handle", "_keys", "_loop", "_slots", "time")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        # The loop's clock itself, not a method calling it: read by every Deadline made.
        self.time: Callable[[], float] = loop.time
        self._slots: dict[int, dict[Alarm, None]] = {}
        self._keys: list[int] = []  # heap of the keys of `_slots`
        self._handle: asyncio.TimerHandle | None = None
        self._armed = 0  # the slot the loop timer is set for (while `_handle` is set)

    @staticmethod
    def slot_of(when: float) -> int:
        """The fine slot at or after loop time `when`."""
        return math.ceil(when * FINE_SLOTS_PER_SECOND)

    def add(self, when: float, alarm: Alarm) -> int:
        """Ring `alarm` when the slot holding loop time `when` is due; returns that slot (for
        `remove`). Nothing rings before `when`'s fine slot: a coarse slot may ring earlier, and
        the alarm is expected to add itself again then (`Deadline` does).

        A `when` already past rings at the loop's next turn, before anything that turn
        schedules later (as a timer armed for the past would not), and cannot be removed: the
        alarm must ignore a ring for a slot it has left."""
        now = self._loop.time()
        key = math.ceil(when * FINE_SLOTS_PER_SECOND)  # slot_of(when), without the call
        if when <= now:
            self._loop.call_soon(alarm.ring, key)
            return key
        coarse = math.floor(when) * FINE_SLOTS_PER_SECOND
        # Coarse only when its slot is more than FINE_HORIZON ahead: a bound re-added as its
        # coarse slot rings must land in a later (fine) slot, never in the one ringing.
        if coarse - now * FINE_SLOTS_PER_SECOND > FINE_HORIZON_SLOTS:
            key = coarse
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = {}
            heapq.heappush(self._keys, key)
            if self._handle is None or key < self._armed:
                self._arm(key)
        slot[alarm] = None
        return key

    def remove(self, key: int, alarm: Alarm) -> None:
        """Take `alarm` out of slot `key` (nothing if that slot has rung). An emptied slot is
        kept until it is due: a slot empties and fills again with every request."""
        slot = self._slots.get(key)
        if slot is not None:
            slot.pop(alarm, None)

    def slot_count(self) -> int:
        """Slots kept (rung ones are dropped), for tests and debugging."""
        return len(self._slots)

    def close(self) -> None:
        """Cancel the loop timer; alarms still in slots never ring."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._slots.clear()
        self._keys.clear()

    def _arm(self, key: int) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._armed = key
        self._handle = self._loop.call_at(key / FINE_SLOTS_PER_SECOND, self._ring)

    def _ring(self) -> None:
        self._handle = None
        # The loop timer may fire up to half a millisecond before its slot (it counts whole
        # milliseconds): the slot it was armed for is due all the same.
        due = max(self._armed, math.floor(self._loop.time() * FINE_SLOTS_PER_SECOND))
        keys = self._keys
        rung: list[tuple[int, dict[Alarm, None]]] = []
        while keys and keys[0] <= due:
            key = heapq.heappop(keys)
            slot = self._slots.pop(key, None)
            if slot:
                rung.append((key, slot))
        if keys:
            self._arm(keys[0])
        # Rung after the slots are updated: a ringing alarm may add itself again.
        for key, slot in rung:
            for alarm in list(slot):
                alarm.ring(key)
