"""The outlier detector's circuit, exhaustively, with a fake clock (plain numbers)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.reliability.outlier import Circuit, OutlierDetector, OutlierPolicy

POLICY = OutlierPolicy(
    consecutive_failures=3,
    base_ejection_seconds=10.0,
    max_ejection_seconds=80.0,
    max_ejection_percent=100,
)


def fail(detector: OutlierDetector, name: str, now: float, times: int, size: int = 4) -> bool:
    ejected = False
    for _ in range(times):
        ejected = detector.failure(name, "prefill", now, size) or ejected
    return ejected


def test_consecutive_failures_eject_and_a_success_in_between_resets_the_count() -> None:
    detector = OutlierDetector(POLICY)
    assert not fail(detector, "a", 0.0, 2)
    detector.success("a", "prefill", 0.5)
    assert not fail(detector, "a", 1.0, 2)
    assert detector.ejected(1.0) == frozenset()
    assert fail(detector, "a", 1.0, 1)
    assert detector.ejected(1.0) == {"a"}
    status = detector.status("a", 1.0)
    assert status.circuit is Circuit.OPEN and status.ejections == 1
    assert status.ejected_for_seconds == pytest.approx(10.0)


def test_cool_down_ends_half_open_then_a_success_closes() -> None:
    detector = OutlierDetector(POLICY)
    fail(detector, "a", 0.0, 3)
    assert detector.ejected(9.99) == {"a"}
    assert detector.ejected(10.0) == frozenset()
    assert detector.status("a", 10.0).circuit is Circuit.HALF_OPEN
    detector.success("a", "prefill", 11.0)
    assert detector.status("a", 11.0).circuit is Circuit.CLOSED


def test_a_failure_on_probation_ejects_at_once_for_twice_as_long() -> None:
    detector = OutlierDetector(POLICY)
    fail(detector, "a", 0.0, 3)
    detector.ejected(10.0)
    assert detector.failure("a", "prefill", 10.5, 4)
    assert detector.status("a", 10.5).ejected_for_seconds == pytest.approx(20.0)
    detector.ejected(30.5)
    assert detector.failure("a", "prefill", 31.0, 4)
    assert detector.status("a", 31.0).ejected_for_seconds == pytest.approx(40.0)


def test_cool_down_is_capped() -> None:
    detector = OutlierDetector(POLICY)
    now = 0.0
    fail(detector, "a", now, 3)
    for _ in range(10):
        now += 1000.0
        detector.ejected(now)
        detector.failure("a", "prefill", now, 4)
    assert detector.status("a", now).ejected_for_seconds == pytest.approx(80.0)


def test_answers_to_requests_sent_before_an_ejection_do_not_close_it() -> None:
    detector = OutlierDetector(POLICY)
    fail(detector, "a", 0.0, 3)
    detector.success("a", "prefill", 1.0)
    assert detector.ejected(1.0) == {"a"}


def test_failures_while_open_do_not_extend_it() -> None:
    detector = OutlierDetector(POLICY)
    fail(detector, "a", 0.0, 3)
    assert not fail(detector, "a", 5.0, 5)
    assert detector.ejected(10.0) == frozenset()


def test_a_long_healthy_spell_forgives_past_ejections() -> None:
    detector = OutlierDetector(POLICY)
    fail(detector, "a", 0.0, 3)
    detector.ejected(10.0)
    detector.success("a", "prefill", 10.0)
    detector.success("a", "prefill", 10.0 + 80.0)
    assert detector.circuits() == {}
    fail(detector, "a", 200.0, 3)
    assert detector.status("a", 200.0).ejections == 1


def test_at_most_the_allowed_share_of_a_role_is_ejected() -> None:
    detector = OutlierDetector(OutlierPolicy(1, 10.0, 80.0, max_ejection_percent=50))
    assert detector.failure("a", "prefill", 0.0, 4)
    assert detector.failure("b", "prefill", 0.0, 4)
    assert not detector.failure("c", "prefill", 0.0, 4)  # 3 of 4 would exceed 50 %
    assert detector.failure("x", "decode", 0.0, 2)  # roles are counted apart
    assert detector.ejected(0.0) == {"a", "b", "x"}


def test_zero_percent_never_ejects() -> None:
    detector = OutlierDetector(OutlierPolicy(1, 1.0, 2.0, max_ejection_percent=0))
    assert not fail(detector, "a", 0.0, 10)
    assert detector.ejected(0.0) == frozenset()


def test_a_probe_closes_half_open_but_does_not_clear_request_failures() -> None:
    detector = OutlierDetector(POLICY)
    fail(detector, "a", 0.0, 2)
    detector.probe_succeeded("a", 1.0)
    assert fail(detector, "a", 1.0, 1)  # the two failures before the probe still count
    detector.ejected(11.0)
    detector.probe_succeeded("a", 11.0)
    assert detector.status("a", 11.0).circuit is Circuit.CLOSED


def test_instances_that_left_are_forgotten() -> None:
    detector = OutlierDetector(POLICY)
    fail(detector, "a", 0.0, 3)
    fail(detector, "b", 0.0, 1)
    version = detector.version
    detector.retain(["b"])
    assert detector.ejected(0.0) == frozenset()
    assert set(detector.circuits()) == {"b"}
    assert detector.version > version


def test_policy_is_validated() -> None:
    with pytest.raises(ValueError, match="consecutive"):
        OutlierPolicy(consecutive_failures=0)
    with pytest.raises(ValueError, match="base_ejection"):
        OutlierPolicy(base_ejection_seconds=10, max_ejection_seconds=5)
    with pytest.raises(ValueError, match="percent"):
        OutlierPolicy(max_ejection_percent=101)


EVENTS = st.lists(
    st.tuples(
        st.sampled_from(["fail", "ok", "probe", "tick"]),
        st.sampled_from(["a", "b", "c"]),
        st.floats(0, 30),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(EVENTS)
def test_invariants_hold_under_any_sequence(events: list[tuple[str, str, float]]) -> None:
    detector = OutlierDetector(OutlierPolicy(2, 5.0, 40.0, max_ejection_percent=67))
    now = 0.0
    for action, name, step in events:
        now += step
        if action == "fail":
            detector.failure(name, "prefill", now, 3)
        elif action == "ok":
            detector.success(name, "prefill", now)
        elif action == "probe":
            detector.probe_succeeded(name, now)
        ejected = detector.ejected(now)
        # Never more than 67 % of 3 instances (2) out at once.
        assert len(ejected) <= 2
        for member in ejected:
            status = detector.status(member, now)
            assert status.circuit is Circuit.OPEN
            assert 0 < status.ejected_for_seconds <= 40.0
        for other in {"a", "b", "c"} - ejected:
            assert detector.status(other, now).circuit is not Circuit.OPEN


def test_legs_begun_before_an_ejection_neither_close_nor_reopen_it() -> None:
    detector = OutlierDetector(POLICY)
    fail(detector, "a", 0.0, 3)  # ejected at 0 for 10 s
    detector.ejected(10.0)
    detector.success("a", "prefill", 10.5, began=-1.0)  # a long stream sent before it
    assert detector.status("a", 10.5).circuit is Circuit.HALF_OPEN
    assert not detector.failure("a", "prefill", 10.6, 4, began=-0.5)
    assert detector.status("a", 10.6).circuit is Circuit.HALF_OPEN
    detector.success("a", "prefill", 11.0, began=10.2)
    assert detector.status("a", 11.0).circuit is Circuit.CLOSED
