"""StallGuard: a sweep judges only when the proxy ran through the period before it."""

from __future__ import annotations

from pdproxy.registry.stall import StallGuard

PERIOD = 1.0


def test_sweeps_on_time_judge() -> None:
    guard = StallGuard(PERIOD, now=0.0)
    assert [guard.may_judge(t) for t in (1.0, 2.05, 3.9, 5.8)] == [True] * 4


def test_the_sweep_after_a_stall_waits_one_period_then_judges() -> None:
    guard = StallGuard(PERIOD, now=0.0)
    assert guard.may_judge(1.0)
    assert not guard.may_judge(13.0)  # the process did not run for 12 s
    assert guard.stalled_for == 12.0
    assert guard.may_judge(14.0)


def test_after_stalls_back_to_back_the_first_sweep_on_time_judges() -> None:
    guard = StallGuard(PERIOD, now=0.0)
    # The process ran a moment at 5.0 (the late sweep) and stopped again until 10.0: the sweep
    # then is late too, and only the one after a whole period run through judges.
    assert [guard.may_judge(t) for t in (5.0, 10.0, 11.0)] == [False, False, True]


def test_a_proxy_that_keeps_stalling_judges_no_one() -> None:
    guard = StallGuard(PERIOD, now=0.0)
    assert [guard.may_judge(t) for t in (5.0, 10.0, 15.0, 20.0)] == [False] * 4


def test_a_gap_of_two_periods_is_not_a_stall() -> None:
    guard = StallGuard(PERIOD, now=0.0)
    assert guard.may_judge(2.0)
    assert not guard.may_judge(4.01)
