"""pdproxy.registry.server.TurnBudget: the registry yields to the HTTP side after a bounded
amount of work per event-loop turn, counted in time and bytes rather than messages."""

from __future__ import annotations

from pdproxy.registry.server import TURN_BYTES, TURN_SECONDS, TurnBudget


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_many_small_quick_frames_share_a_turn() -> None:
    clock = Clock()
    budget = TurnBudget(clock=clock)
    assert not any(budget.spend(200) for _ in range(500))  # 100 KB, no time passing


def test_the_turn_ends_when_its_time_is_spent() -> None:
    clock = Clock()
    budget = TurnBudget(clock=clock)
    clock.now += TURN_SECONDS / 2
    assert not budget.spend(100)
    clock.now += TURN_SECONDS / 2
    assert budget.spend(100)  # one dear frame is enough, whatever the count
    budget.restart()
    assert not budget.spend(100)


def test_the_turn_ends_when_its_bytes_are_spent() -> None:
    budget = TurnBudget(clock=Clock())
    assert not budget.spend(TURN_BYTES - 1)
    assert budget.spend(1)
    budget.restart()
    assert not budget.spend(TURN_BYTES // 2)
