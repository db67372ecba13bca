"""When the registry's sweep may judge an instance's silence.

The sweep is a timer on the proxy's loop. When the whole proxy process has not run for a while
(descheduled, CPU-throttled by its cgroup, stopped), its timer fires on waking before ZMQ's I/O
thread has moved what the workers sent meanwhile from the kernel into the socket: a sweep then
would expire every instance and refuse requests with 503 until the next announcements are read,
milliseconds later. So a sweep judges only when the proxy ran through the whole period before
it, which also reads what came during any earlier stall; one that wakes more than two periods
after the last does not. A proxy that never runs two periods on time expires no one (its
requests fail over by retries and outlier ejection) and counts each such sweep.
"""

from __future__ import annotations

LATE_AFTER_PERIODS = 2.0


class StallGuard:
    """Told the time at each sweep; says whether that sweep may expire instances."""

    def __init__(self, period_s: float, now: float) -> None:
        self._late_after = LATE_AFTER_PERIODS * period_s
        self._last = now
        self.stalled_for = 0.0  # the gap before the last late sweep (the stall, at most)

    def may_judge(self, now: float) -> bool:
        """False for a sweep that woke late: the process did not run through the period."""
        gap, self._last = now - self._last, now
        if gap > self._late_after:
            self.stalled_for = gap
            return False
        return True
