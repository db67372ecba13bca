"""The registry's rejection log: once per (sender, reason), and rate-limited overall."""

from __future__ import annotations

from pdproxy.registry.messages import Reason
from pdproxy.registry.server import RejectionLog


def test_once_per_sender_and_reason() -> None:
    log = RejectionLog()
    assert log.should_log(b"a", Reason.NOT_MSGPACK, 0.0)
    assert not log.should_log(b"a", Reason.NOT_MSGPACK, 0.1)
    assert log.should_log(b"a", Reason.BAD_ADDRESS, 0.2)
    assert log.should_log(b"b", Reason.NOT_MSGPACK, 0.3)


def test_new_identities_cannot_flood_the_log() -> None:
    log = RejectionLog(burst=5, window=10.0)
    logged = [log.should_log(f"s{i}".encode(), Reason.NOT_MSGPACK, 1.0) for i in range(100)]
    assert sum(logged) == 5
    assert log.suppressed == 95
    # A new window allows a new burst.
    assert log.should_log(b"fresh", Reason.NOT_MSGPACK, 11.5)
    assert log.suppressed == 0


def test_memory_is_bounded() -> None:
    log = RejectionLog(capacity=10, burst=10**9)
    for i in range(1000):
        log.should_log(f"s{i}".encode(), Reason.FRAMING, float(i))
    assert len(log._seen) == 10
    # The oldest were forgotten, so they may be logged again.
    assert log.should_log(b"s0", Reason.FRAMING, 2000.0)


def test_a_suppressed_sender_is_logged_when_the_budget_allows() -> None:
    log = RejectionLog(burst=1, window=10.0)
    assert log.should_log(b"first", Reason.FRAMING, 0.0)
    assert not log.should_log(b"second", Reason.FRAMING, 1.0)  # over budget: not remembered
    assert log.should_log(b"second", Reason.FRAMING, 10.5)  # next window: logged after all


def test_flush_reports_and_resets_after_the_window() -> None:
    log = RejectionLog(burst=1, window=10.0)
    log.should_log(b"a", Reason.FRAMING, 0.0)
    log.should_log(b"b", Reason.FRAMING, 0.0)
    assert log.suppressed == 1
    log.flush(5.0)
    assert log.suppressed == 1  # the window is not over yet
    log.flush(10.0)
    assert log.suppressed == 0
