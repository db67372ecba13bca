"""asyncio.timeout for a task the caller already holds.

On Python 3.11 every `asyncio.get_running_loop()` and `asyncio.current_task()` checks the
process id with a getpid() system call, and `asyncio.timeout` makes two of them each time it
is entered (docs/performance.md, "Loop and task lookups"). A request therefore looks its task
up once (`Exchange.task`) and bounds its waits with `Deadline`, which behaves
like asyncio.Timeout (it cancels the task when the time is up and turns that cancellation,
and only that one, into TimeoutError) but is handed the task, and the process's `Alarms`
(one loop timer for all bounds, instead of one per wait: see alarms.py).

Moving the bound later, or lifting it, keeps the alarm slot the bound is in: when the slot
rings, the deadline adds itself again for the bound as it is by then, or does nothing if there
is none. A stream relay moves its bound on every chunk; this way it costs one slot per idle
period, not two slot operations per chunk.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from pdproxy.http.alarms import Alarms


class Deadline:
    """`with Deadline(alarms, task, delay):` bounds the block's waits; `delay` None: unbounded
    until `reschedule` gives a time. Not reentrant; one use per object."""

    __slots__ = ("_alarms", "_cancelling", "_expired", "_slot", "_task", "_when")

    def __init__(self, alarms: Alarms, task: asyncio.Task[object], delay: float | None) -> None:
        self._alarms = alarms
        self._task = task
        self._when = None if delay is None else alarms.time() + delay
        self._slot: int | None = None  # the alarm slot this is in (it rings at or before _when)
        self._expired = False
        self._cancelling = 0

    def when(self) -> float | None:
        """The loop time the block must end by, None if unbounded."""
        return self._when

    def reschedule(self, when: float | None) -> None:
        """Move the bound to loop time `when` (None: no bound from now on)."""
        if self._expired:
            raise RuntimeError("the deadline already expired")
        self._when = when
        if when is None or (self._slot is not None and Alarms.slot_of(when) >= self._slot):
            return  # the slot this is in (if any) rings first, and looks again then
        self._arm(when)

    def _arm(self, when: float) -> None:
        if self._slot is not None:
            self._alarms.remove(self._slot, self)
        self._slot = self._alarms.add(when, self)

    def expired(self) -> bool:
        return self._expired

    def __enter__(self) -> Deadline:
        self._cancelling = self._task.cancelling()
        when = self._when
        if when is not None:
            # _arm's work inline, not through reschedule() or _arm (a call less on each of a
            # request's four deadlines); a slot taken by a reschedule() before the block goes.
            if self._slot is not None:
                self._alarms.remove(self._slot, self)
            self._slot = self._alarms.add(when, self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._slot is not None:
            self._alarms.remove(self._slot, self)
            self._slot = None
        # Only our own cancellation becomes a timeout; one from elsewhere (the client went
        # away, the server stops) stays a cancellation.
        if (
            self._expired
            and exc_type is asyncio.CancelledError
            and self._task.uncancel() <= self._cancelling
        ):
            raise TimeoutError from exc

    def ring(self, due: int) -> None:
        """Alarms: slot `due` is due."""
        if self._slot != due:
            return  # a slot left since (the block ended, or the bound moved)
        self._slot = None
        when = self._when
        if when is None:
            return  # the bound was lifted meanwhile
        if Alarms.slot_of(when) > due:
            self._arm(when)  # it was moved later meanwhile, or this was a coarse slot
            return
        self._expired = True
        self._task.cancel()
