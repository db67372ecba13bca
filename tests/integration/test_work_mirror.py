"""An HTTP worker's WorkMirror (`--workers` > 1) over a real ipc PUB/SUB pair: each forwarded
report reaches the worker's legs in flight, and a report it cannot read does not end the rest."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import zmq
import zmq.asyncio

from pdproxy.ids import Address
from pdproxy.multiworker.shared_state import WorkReport, encode
from pdproxy.multiworker.work_mirror import WorkMirror
from pdproxy.pairing.inflight import InFlight

PREFILL = Address("127.0.0.1", 8100)
OTHER = Address("127.0.0.1", 8101)


class Heard:
    """The worker's legs in flight (a real InFlight), noting which reports reached them."""

    def __init__(self) -> None:
        self.inflight = InFlight()
        self.addresses: list[Address] = []
        self.changed = asyncio.Event()

    def follow_work(self) -> None:
        self.inflight.follow_work()

    def announced_work(self, address: Address, prefill_tokens: int) -> None:
        self.inflight.announced_work(address, prefill_tokens)
        self.addresses.append(address)
        self.changed.set()

    async def until(self, address: Address) -> None:
        while address not in self.addresses:
            self.changed.clear()
            await self.changed.wait()


def test_forwarded_reports_reach_the_legs_in_flight(tmp_path: Path) -> None:
    async def scenario() -> Heard:
        endpoint = f"ipc://{tmp_path / 'work'}"
        context = zmq.asyncio.Context()
        publisher = context.socket(zmq.PUB)
        publisher.setsockopt(zmq.LINGER, 0)
        publisher.bind(endpoint)
        heard = Heard()
        heard.inflight.add(PREFILL, 300)  # this worker's own leg there: not the others' work
        mirror = WorkMirror(endpoint, context, heard)
        mirror.start()
        try:
            assert heard.inflight.follows_work
            async with asyncio.timeout(10):
                # A subscriber hears only what is sent after it joined: send until it does.
                while OTHER not in heard.addresses:
                    await publisher.send(encode(WorkReport(OTHER, 50)))
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(0.05):
                            await heard.until(OTHER)
                await publisher.send(b"not a report")
                await publisher.send(encode(WorkReport(PREFILL, 1_000)))
                await heard.until(PREFILL)
        finally:
            await mirror.stop()
            publisher.close(linger=0)
            context.term()
        return heard

    heard = asyncio.run(scenario())
    assert heard.inflight.others_work(OTHER, None) == 50.0
    assert heard.inflight.others_work(PREFILL, None) == 700.0  # 1,000 announced less its own 300
    assert set(heard.addresses) == {OTHER, PREFILL}  # the unreadable one reached nobody
