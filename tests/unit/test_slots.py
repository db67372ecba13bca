"""pdproxy.http.slots.Slots: a counting semaphore that never loses a slot."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from pdproxy.http.slots import Slots


def run(body: Callable[[Slots], Awaitable[None]], count: int = 2) -> None:
    async def main() -> None:
        await body(Slots(asyncio.get_running_loop(), count))

    asyncio.run(main())


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_free_slots_are_taken_at_once_until_none_is_left() -> None:
    async def body(slots: Slots) -> None:
        assert not slots.all_taken()
        assert slots.try_take()
        await slots.take()  # the second, without waiting
        assert slots.all_taken()
        assert not slots.try_take()
        slots.give_back()
        assert not slots.all_taken()
        assert slots.try_take()

    run(body)


def test_a_slot_given_back_goes_to_the_longest_waiting() -> None:
    async def body(slots: Slots) -> None:
        assert slots.try_take()
        served: list[str] = []

        async def wait(name: str) -> None:
            await slots.take()
            served.append(name)

        first = asyncio.create_task(wait("first"))
        await settle()
        second = asyncio.create_task(wait("second"))
        await settle()
        assert served == []
        slots.give_back()
        await settle()
        assert served == ["first"]
        assert not slots.try_take()  # the slot went to the waiter, not back to the pool
        slots.give_back()
        await settle()
        assert served == ["first", "second"]
        await asyncio.gather(first, second)

    run(body, count=1)


def test_a_waiter_cancelled_while_waiting_leaves_the_queue() -> None:
    async def body(slots: Slots) -> None:
        assert slots.try_take()
        gone = asyncio.create_task(slots.take())
        await settle()
        gone.cancel()
        await settle()
        assert gone.cancelled()
        slots.give_back()
        assert slots.try_take()  # nobody was waiting any more: the slot is free

    run(body, count=1)


def test_a_slot_handed_to_a_waiter_cancelled_before_it_ran_is_passed_on() -> None:
    async def body(slots: Slots) -> None:
        assert slots.try_take()
        first = asyncio.create_task(slots.take())
        second = asyncio.create_task(slots.take())
        await settle()
        slots.give_back()  # handed to `first`...
        first.cancel()  # ...which is cancelled before it runs
        await settle()
        assert first.cancelled()
        assert second.done() and second.exception() is None
        assert slots.all_taken()  # `second` holds the one slot
        slots.give_back()
        assert slots.try_take()

    run(body, count=1)


def test_a_bounded_wait_that_times_out_loses_no_slot() -> None:
    async def body(slots: Slots) -> None:
        assert slots.try_take() and slots.try_take()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.01):
                await slots.take()
        slots.give_back()
        slots.give_back()
        assert slots.try_take() and slots.try_take()
        assert not slots.try_take()

    run(body)


def test_at_least_one_slot() -> None:
    async def body() -> None:
        with pytest.raises(ValueError):
            Slots(asyncio.get_running_loop(), 0)

    asyncio.run(body())


def test_give_back_says_whether_it_handed_the_slot_on() -> None:
    async def body(slots: Slots) -> None:
        assert slots.try_take()
        waiter = asyncio.create_task(slots.take())
        await settle()
        assert slots.free() == 0
        assert slots.give_back() is True  # to the waiter: still none free
        await waiter
        assert slots.free() == 0
        assert slots.give_back() is False  # nobody waits: freed
        assert slots.free() == 1

    run(body, count=1)
