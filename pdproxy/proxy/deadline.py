"""asyncio.timeout for a task the caller already holds.

On Python 3.11 every `asyncio.get_running_loop()` and `asyncio.current_task()` checks the
process id with a getpid() system call (the running-loop cache is per process), and
`asyncio.timeout` makes two of them each time it is entered. A request crossed half a dozen
of those: measured with py-spy on the proxy at 64 concurrent requests, getpid() was about a
quarter of its CPU on this VM, where a system call costs microseconds. A request therefore
looks its task up once (`Exchange.task`) and bounds its waits with `Deadline`, which behaves
like asyncio.Timeout (it cancels the task when the time is up and turns that cancellation,
and only that one, into TimeoutError) but is handed the loop and the task.

Moving the bound later, or lifting it, keeps the timer that is already armed: when it fires
it re-arms itself for the bound as it is by then, or does nothing if there is none. A stream
relay moves its bound on every chunk; this way it costs one timer per idle period, not two
timer operations per chunk.
"""

from __future__ import annotations

import asyncio
from types import TracebackType


class Deadline:
    """`with Deadline(task, delay):` bounds the block's waits; `delay` None: unbounded until
    `reschedule` gives a time. Not reentrant; one use per object."""

    __slots__ = ("_armed_at", "_cancelling", "_expired", "_handle", "_loop", "_task", "_when")

    def __init__(self, task: asyncio.Task[object], delay: float | None) -> None:
        self._task = task
        self._loop = task.get_loop()
        self._when = None if delay is None else self._loop.time() + delay
        self._handle: asyncio.Handle | None = None
        self._armed_at = 0.0  # when the armed timer fires (meaningful while _handle is set)
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
        if when is None or (self._handle is not None and when >= self._armed_at):
            return  # the armed timer (if any) looks again when it fires
        self._arm(when)

    def _arm(self, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._armed_at = when
        if when <= self._loop.time():
            self._handle = self._loop.call_soon(self._fire)
        else:
            self._handle = self._loop.call_at(when, self._fire)

    def expired(self) -> bool:
        return self._expired

    def __enter__(self) -> Deadline:
        self._cancelling = self._task.cancelling()
        if self._when is not None:
            # _arm directly, not through reschedule(): four of these per request, and a timer
            # already armed by a reschedule() before the block is re-armed, not kept.
            self._arm(self._when)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        # Only our own cancellation becomes a timeout; one from elsewhere (the client went
        # away, the server stops) stays a cancellation.
        if (
            self._expired
            and exc_type is asyncio.CancelledError
            and self._task.uncancel() <= self._cancelling
        ):
            raise TimeoutError from exc

    def _fire(self) -> None:
        self._handle = None
        when = self._when
        if when is None:
            return  # the bound was lifted meanwhile
        if when > self._armed_at:
            self._arm(when)  # it was moved later meanwhile
            return
        self._expired = True
        self._task.cancel()
