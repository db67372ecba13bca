"""decode_beside_prefill's outcomes, with plain coroutines standing in for the two legs."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

from pdproxy.http.upstream import Reply
from pdproxy.proxy.side_by_side import decode_beside_prefill


class Legs:
    def __init__(self) -> None:
        self.answered = False
        self.decode_cancelled = False
        self.prefill_cancelled = False

    async def prefill(self, after: float, status: int = 200, fail: bool = False) -> Reply:
        try:
            await asyncio.sleep(after)
        except asyncio.CancelledError:
            self.prefill_cancelled = True
            raise
        if fail:
            raise RuntimeError("prefill broke")
        return Reply(status, b"application/json", b'{"from": "prefill"}')

    async def decode(self, answer_after: float, fail_after: float | None = None) -> None:
        try:
            if fail_after is not None:
                await asyncio.sleep(fail_after)
                raise ValueError("decode broke")
            await asyncio.sleep(answer_after)
            self.answered = True
        except asyncio.CancelledError:
            self.decode_cancelled = True
            raise


async def run(
    legs: Legs,
    prefill: Coroutine[Any, Any, Reply],
    decode: Coroutine[Any, Any, None],
) -> Reply | None:
    return await decode_beside_prefill(
        prefill, decode, lambda: legs.answered, asyncio.get_running_loop()
    )


def test_both_succeed_and_the_decode_answers() -> None:
    async def main() -> None:
        legs = Legs()
        assert await run(legs, legs.prefill(0.01), legs.decode(0.02)) is None
        assert legs.answered and not legs.prefill_cancelled and not legs.decode_cancelled

    asyncio.run(main())


def test_a_failed_prefill_cancels_the_waiting_decode_and_is_raised() -> None:
    async def main() -> None:
        legs = Legs()
        with pytest.raises(RuntimeError, match="prefill broke"):
            await run(legs, legs.prefill(0.01, fail=True), legs.decode(10.0))
        assert legs.decode_cancelled and not legs.answered

    asyncio.run(main())


def test_a_prefill_refusal_is_returned_and_the_decode_cancelled() -> None:
    async def main() -> None:
        legs = Legs()
        refusal = await run(legs, legs.prefill(0.01, status=400), legs.decode(10.0))
        assert refusal is not None and refusal.status == 400
        assert refusal.body == b'{"from": "prefill"}'
        assert legs.decode_cancelled

    asyncio.run(main())


def test_a_failed_decode_cancels_the_prefill_and_is_raised() -> None:
    async def main() -> None:
        legs = Legs()
        with pytest.raises(ValueError, match="decode broke"):
            await run(legs, legs.prefill(10.0), legs.decode(0.0, fail_after=0.01))
        assert legs.prefill_cancelled

    asyncio.run(main())


def test_a_prefill_failure_after_the_decode_answered_does_not_undo_the_answer() -> None:
    async def main() -> None:
        legs = Legs()

        async def decode_answers_at_once() -> None:
            legs.answered = True
            await asyncio.sleep(0.05)

        assert await run(legs, legs.prefill(0.01, fail=True), decode_answers_at_once()) is None

    asyncio.run(main())


def test_the_prefill_is_awaited_after_the_decode_answered() -> None:
    async def main() -> None:
        legs = Legs()
        finished: list[str] = []

        async def slow_prefill() -> Reply:
            await asyncio.sleep(0.05)
            finished.append("prefill")
            return Reply(200, b"application/json", b"{}")

        assert await run(legs, slow_prefill(), legs.decode(0.0)) is None
        assert finished == ["prefill"] and not legs.prefill_cancelled

    asyncio.run(main())


def test_cancelling_the_request_ends_both_legs() -> None:
    async def main() -> None:
        legs = Legs()
        outer = asyncio.get_running_loop().create_task(
            run(legs, legs.prefill(10.0), legs.decode(10.0))
        )
        await asyncio.sleep(0.01)
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        assert legs.prefill_cancelled and legs.decode_cancelled

    asyncio.run(main())
