"""The fake worker's KV waits end when their request is cancelled (the proxy closed the leg),
even when the cancellation comes as the awaited send or KV completes: Python 3.11's
asyncio.wait_for lost such a cancellation, and the leg then waited out its KV timeout."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq.asyncio

from pdproxy.fake_vllm.config import Geometry
from pdproxy.fake_vllm.kv_payload import KvPayload
from pdproxy.fake_vllm.kv_store import KvItem, KvStore
from pdproxy.fake_vllm.kv_transport import KvSender
from pdproxy.fake_vllm.kv_wire import Register


def test_a_cancellation_that_comes_with_the_kv_is_not_lost() -> None:
    async def scenario() -> None:
        store = KvStore()
        waiting = asyncio.create_task(store.wait("r", 5.0))
        await asyncio.sleep(0)  # it waits for the KV now
        payload = KvPayload(bytes(32), "nixl", Geometry(tp_size=1, block_size=16, kv_layout="HND"))
        store.put("r", KvItem("127.0.0.1:1", payload, time.monotonic()))
        waiting.cancel()  # in the same turn of the loop as the KV
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(scenario())


def test_a_cancellation_that_comes_as_a_registration_is_sent_is_not_lost() -> None:
    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        sender = KvSender(ctx, "127.0.0.1:1")
        try:

            async def leg() -> None:
                await sender.push("127.0.0.1:9", Register("k", "engine", "127.0.0.1:1"), 5.0)
                await asyncio.sleep(30)  # stands for the wait for the KV

            running = asyncio.create_task(leg())
            await asyncio.sleep(0)
            running.cancel()
            with pytest.raises(asyncio.CancelledError):
                async with asyncio.timeout(5):  # lost, the leg would sleep on
                    await running
        finally:
            sender.close()
            ctx.term()

    asyncio.run(scenario())
