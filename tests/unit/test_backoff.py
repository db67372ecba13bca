"""Retry pacing: exponential with equal jitter, capped, inside the deadline."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdproxy.reliability.backoff import RetryPolicy

POLICY = RetryPolicy(max_attempts=4, backoff_base_seconds=0.1, backoff_max_seconds=0.5)


@pytest.mark.parametrize(
    ("failed", "low", "high"), [(1, 0.05, 0.1), (2, 0.1, 0.2), (3, 0.2, 0.4), (9, 0.25, 0.5)]
)
def test_delay_doubles_with_jitter_and_is_capped(failed: int, low: float, high: float) -> None:
    assert POLICY.delay(failed, 0.0) == pytest.approx(low)
    assert POLICY.delay(failed, 1.0) == pytest.approx(high)


@given(st.integers(1, 10_000), st.floats(0, 1))
def test_delay_is_always_within_half_and_whole_ceiling(failed: int, unit: float) -> None:
    delay = POLICY.delay(failed, unit)
    assert 0.05 - 1e-12 <= delay <= 0.5 + 1e-12


def test_no_attempt_after_the_last() -> None:
    assert POLICY.next_delay(3, 0.5, remaining=100.0) is not None
    assert POLICY.next_delay(4, 0.5, remaining=100.0) is None


def test_no_retry_that_the_deadline_would_cut_short() -> None:
    assert POLICY.next_delay(1, 1.0, remaining=0.09) is None
    assert POLICY.next_delay(1, 1.0, remaining=0.11) == pytest.approx(0.1)


def test_one_attempt_means_no_retry() -> None:
    assert RetryPolicy(max_attempts=1).next_delay(1, 0.0, 100.0) is None


def test_policy_is_validated() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError, match="backoff"):
        RetryPolicy(backoff_base_seconds=2.0, backoff_max_seconds=1.0)
