"""pdproxy.http.alarms: one loop timer for many deadlines, none of them rung early, few slots
kept however many requests come and go. On asyncio's loop and on uvloop (the proxy's)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from pdproxy.http.alarms import FINE_SLOTS_PER_SECOND, Alarms
from pdproxy.http.deadline import Deadline

# The loop timer counts whole milliseconds, so it may fire up to half of one early.
TIMER_ROUNDING = 0.001
SLOT = 1.0 / FINE_SLOTS_PER_SECOND

Runner = Callable[[Coroutine[Any, Any, Any]], Any]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Runner:
    if request.param == "uvloop":
        return uvloop.run
    return asyncio.run


class Bell:
    """An alarm that records its rings."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.rings: list[tuple[int, float]] = []

    def ring(self, due: int) -> None:
        self.rings.append((due, self.loop.time()))


async def this_task() -> asyncio.Task[Any]:
    task = asyncio.current_task()
    assert task is not None
    return task


def test_requests_that_end_in_time_leave_a_slot_per_bound_not_per_request(run: Runner) -> None:
    async def body() -> tuple[int, int]:
        task = await this_task()
        alarms = Alarms(task.get_loop())
        for _ in range(5000):  # the proxy's four bounds per request, far and near
            with (
                Deadline(alarms, task, 600.0),
                Deadline(alarms, task, 30.0),
                Deadline(alarms, task, 0.5),
                Deadline(alarms, task, None),
            ):
                pass
        kept = alarms.slot_count()
        alarms.close()
        return kept, alarms.slot_count()

    kept, after_close = run(body())
    # Far bounds share the second they fall in; the near one shares its 10 ms slot. The loop
    # may cross a second or a few slots while it runs, hence a little more than three.
    assert 3 <= kept <= 12
    assert after_close == 0


def test_no_bound_rings_before_its_time(run: Runner) -> None:
    async def body() -> list[tuple[float, float]]:
        loop = asyncio.get_running_loop()
        alarms = Alarms(loop)
        delays = [0.0005, 0.003, 0.0101, SLOT, 0.029, 0.05, 0.1]

        async def bounded(delay: float) -> tuple[float, float]:
            task = await this_task()
            began = loop.time()
            with pytest.raises(TimeoutError), Deadline(alarms, task, delay):
                await asyncio.sleep(10)
            return delay, loop.time() - began

        return list(await asyncio.gather(*(bounded(d) for d in delays)))

    for delay, waited in run(body()):
        assert waited >= delay - TIMER_ROUNDING, (delay, waited)
        assert waited < delay + 1.0  # and it did ring (bounded: a loaded machine is slow)


def test_a_far_bound_waits_in_a_coarse_slot_then_rings_on_time(run: Runner) -> None:
    async def body() -> tuple[float, int]:
        task = await this_task()
        loop = task.get_loop()
        alarms = Alarms(loop)
        began = loop.time()
        with pytest.raises(TimeoutError), Deadline(alarms, task, 2.05) as deadline:
            coarse_slots = alarms.slot_count()
            await asyncio.sleep(10)
        assert deadline.expired()
        return loop.time() - began, coarse_slots

    waited, slots = run(body())
    assert slots == 1
    assert 2.05 - TIMER_ROUNDING <= waited < 3.05


def test_alarms_in_one_slot_all_ring_once_and_in_due_order(run: Runner) -> None:
    async def body() -> tuple[float, list[Bell], list[Bell]]:
        loop = asyncio.get_running_loop()
        alarms = Alarms(loop)
        now = loop.time()
        early = [Bell(loop) for _ in range(50)]
        late = [Bell(loop) for _ in range(50)]
        for bell in late:
            alarms.add(now + 0.08, bell)
        for bell in early:
            alarms.add(now + 0.02, bell)
        await asyncio.sleep(0.3)
        return now, early, late

    now, early, late = run(body())
    assert all(len(b.rings) == 1 for b in early + late)
    assert {b.rings[0][0] for b in early} == {Alarms.slot_of(now + 0.02)}
    assert {b.rings[0][0] for b in late} == {Alarms.slot_of(now + 0.08)}
    assert max(b.rings[0][1] for b in early) <= min(b.rings[0][1] for b in late)


def test_a_removed_alarm_never_rings_and_its_slot_rings_for_the_rest(run: Runner) -> None:
    async def body() -> tuple[Bell, Bell]:
        loop = asyncio.get_running_loop()
        alarms = Alarms(loop)
        gone, kept = Bell(loop), Bell(loop)
        when = loop.time() + 0.02
        key = alarms.add(when, gone)
        assert alarms.add(when, kept) == key
        alarms.remove(key, gone)
        await asyncio.sleep(0.1)
        return gone, kept

    gone, kept = run(body())
    assert gone.rings == []
    assert len(kept.rings) == 1


def test_a_bound_already_past_rings_at_the_next_turn(run: Runner) -> None:
    async def body() -> tuple[Bell, list[str]]:
        loop = asyncio.get_running_loop()
        alarms = Alarms(loop)
        bell = Bell(loop)
        order: list[str] = []
        alarms.add(loop.time() - 1.0, bell)
        loop.call_soon(lambda: order.append(f"after: {len(bell.rings)} rings"))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return bell, order

    bell, order = run(body())
    assert len(bell.rings) == 1
    assert order == ["after: 1 rings"]


def test_closing_silences_every_slot(run: Runner) -> None:
    async def body() -> Bell:
        loop = asyncio.get_running_loop()
        alarms = Alarms(loop)
        bell = Bell(loop)
        alarms.add(loop.time() + 0.02, bell)
        alarms.add(loop.time() + 5.0, bell)
        alarms.close()
        await asyncio.sleep(0.1)
        return bell

    assert run(body()).rings == []


def test_an_earlier_slot_added_later_moves_the_loop_timer_forward(run: Runner) -> None:
    async def body() -> tuple[Bell, Bell]:
        loop = asyncio.get_running_loop()
        alarms = Alarms(loop)
        far, near = Bell(loop), Bell(loop)
        alarms.add(loop.time() + 0.5, far)  # arms the timer for 0.5 s
        alarms.add(loop.time() + 0.02, near)  # must not wait for the far one
        await asyncio.sleep(0.15)
        assert len(near.rings) == 1 and far.rings == []
        await asyncio.sleep(0.6)
        return far, near

    far, near = run(body())
    assert len(far.rings) == 1 and len(near.rings) == 1
