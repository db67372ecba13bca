"""The registry process of a proxy with several HTTP workers (`--workers` > 1).

It owns what a single-process proxy keeps to itself: the registry socket and table, the KV
transfer statistics, the drained set. Its state goes to the workers over a PUB socket (after
each change, at most every PUBLISH_CHECK_SECONDS, and every REPUBLISH_SECONDS regardless, so a
worker that starts or restarts late catches up); the admin API's changes come in over a ROUTER
socket, and each reply names the revision whose publication shows the change.

A registry process started again after dying knows only the static instances until the others
announce again: it holds its first publication for one TTL (the time within which every live
instance must announce), so the workers keep routing on their last copy meanwhile instead of
losing the fleet. An admin change in that window is published at once, table and all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from pdproxy.config import Settings
from pdproxy.metrics import Metrics
from pdproxy.registry.operator import FleetOperator
from pdproxy.registry.seeded import seeded_table
from pdproxy.registry.server import RegistryServer
from pdproxy.registry.shared_state import (
    ControlReply,
    ControlRequest,
    SharedState,
    decode,
    encode,
)

log = logging.getLogger("pdproxy.registry")

PUBLISH_CHECK_SECONDS = 0.05
REPUBLISH_SECONDS = 1.0


class RegistryHub:
    def __init__(
        self,
        settings: Settings,
        state_endpoint: str,
        control_endpoint: str,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
        restarted: bool = False,
    ) -> None:
        self._hold_seconds = settings.ttl if restarted else 0.0
        self._state_endpoint = state_endpoint
        self._control_endpoint = control_endpoint
        self._clock = clock
        self.table = seeded_table(settings, metrics, clock)
        self.registry = RegistryServer(settings, self.table, metrics, clock)
        self.operator = FleetOperator(self.registry, self.table)
        # Counted on from the (system-wide) monotonic clock in nanoseconds: a registry process
        # started again publishes revisions above its predecessor's, so a worker waiting for
        # "this revision or later" is never satisfied by its copy of the old process's state.
        self.revision = int(clock() * 1e9)
        self._published: tuple[int, frozenset[str]] | None = None
        self._published_at = float("-inf")

    def state(self) -> SharedState:
        """The state to publish now; the revision moves when the content did."""
        content = (self.table.revision, self.operator.drained)
        if content != self._published:
            self.revision += 1
            self._published = content
        return SharedState(self.revision, tuple(self.table.entries()), self.operator.drained)

    def control(self, request: ControlRequest) -> ControlReply:
        done, refusal = self.operator.apply(request)
        return ControlReply(done, self.state().revision, refusal)

    async def run(self, started: Callable[[], None], stop: asyncio.Event) -> None:
        self.registry.publish_counts()
        self.registry.start()  # raises if the registry address is taken
        context = zmq.asyncio.Context()
        publisher = context.socket(zmq.PUB)
        controls = context.socket(zmq.ROUTER)
        tasks: list[asyncio.Task[None]] = []
        try:
            for sock in (publisher, controls):
                sock.setsockopt(zmq.LINGER, 0)
            publisher.bind(self._state_endpoint)
            controls.bind(self._control_endpoint)
            tasks = [
                asyncio.create_task(self._publish_loop(publisher), name="hub-publish"),
                asyncio.create_task(self._control_loop(controls, publisher), name="hub-control"),
            ]
            started()
            await stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self.registry.stop()
            publisher.close(linger=0)
            controls.close(linger=0)
            context.term()

    async def _publish_loop(self, publisher: zmq.asyncio.Socket) -> None:
        await asyncio.sleep(self._hold_seconds)
        while True:
            await asyncio.sleep(PUBLISH_CHECK_SECONDS)
            stale = self._clock() - self._published_at >= REPUBLISH_SECONDS
            if stale or (self.table.revision, self.operator.drained) != self._published:
                await self._publish(publisher)

    async def _publish(self, publisher: zmq.asyncio.Socket) -> None:
        try:
            await publisher.send(encode(self.state()))
        except Exception:  # the next round publishes again
            log.exception("registry: could not publish the table to the workers")
        self._published_at = self._clock()

    async def _control_loop(
        self, controls: zmq.asyncio.Socket, publisher: zmq.asyncio.Socket
    ) -> None:
        while True:
            frames = await controls.recv_multipart()
            if len(frames) != 2:
                continue
            sender, payload = frames
            try:
                reply = self.control(decode(payload, ControlRequest))
            except Exception:
                log.exception("registry: could not apply an admin request")
                continue  # the worker's bounded wait answers its client
            await self._publish(publisher)  # before the reply: the worker waits to see it
            await controls.send_multipart([sender, encode(reply)])
