"""An HTTP worker's copy of the registry (`--workers` > 1): the registry process publishes its
table and drained set; every state received replaces the worker's copy, which the planner,
the prober and the listing endpoints read exactly as they read the table in a single process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import zmq
import zmq.asyncio

from pdproxy.base.tasks import stop_task
from pdproxy.metrics import Metrics
from pdproxy.multiworker.shared_state import SharedState, decode
from pdproxy.registry.control import DrainedSink
from pdproxy.registry.table import RegistryTable

log = logging.getLogger("pdproxy.registry")

# The registry process republishes every two seconds: this long without a state means it is gone
# (it is being started again, or it cannot start). The copy keeps routing on what it has.
SILENCE_SECONDS = 5.0
RECEIVE_RETRY_SECONDS = 0.1


class TableMirror:
    def __init__(
        self,
        endpoint: str,
        context: zmq.asyncio.Context,
        table: RegistryTable,
        on_drained: DrainedSink,
        metrics: Metrics,
    ) -> None:
        self._endpoint = endpoint
        self._context = context
        self._table = table
        self._on_drained = on_drained
        self._metrics = metrics
        self.revision = -1  # none received yet
        self._received = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        sock = self._context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        # Only the newest state matters: older ones queued behind it are worth nothing.
        sock.setsockopt(zmq.CONFLATE, 1)
        sock.connect(self._endpoint)
        self._task = asyncio.create_task(self._receive_loop(sock), name="table-mirror")

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None

    async def caught_up(self, revision: int, within: float) -> bool:
        """Wait (bounded) until the copy shows the owner's `revision`."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                while self.revision < revision:
                    await self._received.wait()
        return self.revision >= revision

    def apply(self, state: SharedState) -> None:
        before = {entry.instance.name for entry in self._table.registrations()}
        self._table.adopt(state.entries)
        after = {entry.instance.name for entry in self._table.registrations()}
        for name in after - before:
            self._metrics.instance_joined(name)
        for name in before - after:
            self._metrics.instance_left(name)
        self._on_drained(state.drained)
        self.revision = state.revision
        self._received.set()
        self._received = asyncio.Event()

    async def _receive_loop(self, sock: zmq.asyncio.Socket) -> None:
        silent = False
        try:
            while True:
                try:
                    async with asyncio.timeout(SILENCE_SECONDS):
                        data = await sock.recv()
                except zmq.ZMQError as exc:  # keep the copy updating, whatever happened
                    log.warning("registry copy: receiving failed (%s); trying again", exc)
                    await asyncio.sleep(RECEIVE_RETRY_SECONDS)
                    continue
                except TimeoutError:
                    if not silent and self.revision >= 0:
                        log.warning(
                            "no table from the registry process for %gs: routing on the last "
                            "copy (revision %d) until it is back",
                            SILENCE_SECONDS,
                            self.revision,
                        )
                    silent = True
                    continue
                if silent:
                    log.info("the registry process publishes its table again")
                    silent = False
                try:
                    self.apply(decode(data, SharedState))
                except Exception:  # a bad state must not end the copy's updates
                    log.exception("registry copy: could not apply a published state")
        finally:
            sock.close(linger=0)
