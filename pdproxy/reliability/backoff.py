"""Retry pacing and the overall deadline. Pure: randomness and time are arguments."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_attempts: int = 3
    backoff_base_seconds: float = 0.025
    backoff_max_seconds: float = 1.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if not 0 <= self.backoff_base_seconds <= self.backoff_max_seconds:
            raise ValueError("need 0 <= backoff_base_seconds <= backoff_max_seconds")

    def delay(self, failed_attempts: int, unit_random: float) -> float:
        """Seconds to wait after `failed_attempts` (>= 1) failures: exponential, with "equal
        jitter" (half fixed, half random) so that retries of a burst that failed together do
        not arrive together, while no retry comes back immediately."""
        doublings = min(failed_attempts - 1, 32)
        ceiling = min(self.backoff_max_seconds, self.backoff_base_seconds * 2.0**doublings)
        return ceiling / 2 + ceiling / 2 * unit_random

    def next_delay(
        self, failed_attempts: int, unit_random: float, remaining: float
    ) -> float | None:
        """The wait before another attempt, or None when no attempt is left: the attempts are
        used up, or the wait would leave too little of the deadline for anything to happen."""
        if failed_attempts >= self.max_attempts:
            return None
        wait = self.delay(failed_attempts, unit_random)
        return wait if wait < remaining else None
