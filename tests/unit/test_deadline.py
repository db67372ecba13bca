"""pdproxy.http.deadline.Deadline behaves as asyncio.timeout for the task it is given."""

from __future__ import annotations

import asyncio

import pytest

from pdproxy.http.alarms import Alarms
from pdproxy.http.deadline import Deadline
from pdproxy.tracing.random_ids import RandomHex


def run(coroutine: object) -> object:
    return asyncio.run(coroutine)  # type: ignore[arg-type]


async def this_task() -> asyncio.Task[object]:
    task = asyncio.current_task()
    assert task is not None
    return task


def test_a_wait_past_the_deadline_becomes_a_timeout() -> None:
    async def body() -> None:
        task = await this_task()
        with pytest.raises(TimeoutError), Deadline(Alarms(task.get_loop()), task, 0.01) as deadline:
            await asyncio.sleep(5)
        assert deadline.expired()
        assert task.cancelling() == 0  # our cancellation was taken back

    run(body())


def test_a_block_that_ends_in_time_is_left_alone() -> None:
    async def body() -> str:
        task = await this_task()
        with Deadline(Alarms(task.get_loop()), task, 5) as deadline:
            await asyncio.sleep(0)
        assert not deadline.expired()
        await asyncio.sleep(0.02)  # the timer was cancelled: nothing fires later
        return "done"

    assert run(body()) == "done"


def test_no_delay_means_no_bound_until_rescheduled() -> None:
    async def body() -> None:
        task = await this_task()
        with pytest.raises(TimeoutError), Deadline(Alarms(task.get_loop()), task, None) as deadline:
            assert deadline.when() is None
            await asyncio.sleep(0.01)
            deadline.reschedule(task.get_loop().time() + 0.01)
            await asyncio.sleep(5)

    run(body())


def test_rescheduling_to_none_lifts_the_bound() -> None:
    async def body() -> None:
        task = await this_task()
        with Deadline(Alarms(task.get_loop()), task, 0.01) as deadline:
            deadline.reschedule(None)
            await asyncio.sleep(0.03)
        assert not deadline.expired()

    run(body())


def test_a_deadline_in_the_past_expires_at_the_next_wait() -> None:
    async def body() -> None:
        task = await this_task()
        with pytest.raises(TimeoutError), Deadline(Alarms(task.get_loop()), task, 5) as deadline:
            deadline.reschedule(task.get_loop().time() - 1)
            await asyncio.sleep(5)
        with pytest.raises(RuntimeError):
            deadline.reschedule(None)

    run(body())


def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    async def victim(started: asyncio.Event) -> None:
        task = await this_task()
        with Deadline(Alarms(task.get_loop()), task, 5):
            started.set()
            await asyncio.sleep(5)

    async def body() -> None:
        started = asyncio.Event()
        task = asyncio.get_running_loop().create_task(victim(started))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(body())


def test_an_outer_cancellation_racing_the_deadline_is_not_swallowed() -> None:
    # Both fire before the task runs again: the outer cancel must win (as with
    # asyncio.timeout), not be turned into a timeout.
    async def body() -> None:
        task = await this_task()
        alarms = Alarms(task.get_loop())
        with pytest.raises(asyncio.CancelledError), Deadline(alarms, task, None) as deadline:
            deadline.reschedule(task.get_loop().time() - 1)  # fires at the next wait
            task.cancel()  # the outer one, at the same time
            await asyncio.sleep(5)
        assert deadline.expired()
        task.uncancel()  # the test's own outer cancel, caught above

    run(body())


def test_nested_deadlines_blame_the_one_that_expired() -> None:
    async def body() -> str:
        task = await this_task()
        alarms = Alarms(task.get_loop())  # one for both, as in the proxy
        with Deadline(alarms, task, 5) as outer:
            try:
                with Deadline(alarms, task, 0.01):
                    await asyncio.sleep(5)
            except TimeoutError:
                pass
            await asyncio.sleep(0)
        assert not outer.expired()
        return "outer intact"

    assert run(body()) == "outer intact"


def test_a_bound_moved_later_again_and_again_holds_until_it_stops_moving() -> None:
    async def body() -> None:
        task = await this_task()
        loop = task.get_loop()
        with pytest.raises(TimeoutError), Deadline(Alarms(task.get_loop()), task, 0.05) as deadline:
            for _ in range(20):  # 0.2 s in all, well past the first bound
                await asyncio.sleep(0.01)
                deadline.reschedule(loop.time() + 0.05)
            assert not deadline.expired()
            moved_last = loop.time()
            await asyncio.sleep(5)
        assert 0.04 <= loop.time() - moved_last < 1.0

    run(body())


def test_a_bound_lifted_while_armed_then_set_again_counts_from_the_new_time() -> None:
    async def body() -> None:
        task = await this_task()
        loop = task.get_loop()
        with pytest.raises(TimeoutError), Deadline(Alarms(task.get_loop()), task, 0.02) as deadline:
            deadline.reschedule(None)
            await asyncio.sleep(0.06)  # the armed timer fires and finds no bound
            assert not deadline.expired()
            deadline.reschedule(loop.time() + 0.02)
            await asyncio.sleep(5)

    run(body())


def test_a_bound_moved_earlier_fires_at_the_earlier_time() -> None:
    async def body() -> None:
        task = await this_task()
        loop = task.get_loop()
        began = loop.time()
        with pytest.raises(TimeoutError), Deadline(Alarms(task.get_loop()), task, 5) as deadline:
            deadline.reschedule(loop.time() + 0.01)
            await asyncio.sleep(5)
        assert loop.time() - began < 1.0

    run(body())


def test_random_hex_is_fresh_hex_of_the_asked_length() -> None:
    source = RandomHex()
    ids = [source.hex(16) for _ in range(2000)]  # crosses several refills
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    assert len(set(ids)) == len(ids)
    assert len(source.hex(5000)) == 10000  # more than one refill at once


def test_a_bound_set_before_the_block_leaves_no_timer_behind() -> None:
    async def body() -> None:
        task = await this_task()
        deadline = Deadline(Alarms(task.get_loop()), task, 5)
        deadline.reschedule(task.get_loop().time() + 0.02)  # arms a timer before the block
        with deadline:
            pass
        await asyncio.sleep(0.1)  # a timer left armed would cancel this task here
        assert not deadline.expired()

    run(body())
