"""The registry process of a proxy with several HTTP workers (`--workers` > 1).

It owns what a single-process proxy keeps to itself: the registry socket and table, the KV
transfer statistics, the drained set. Its state goes to the workers over a PUB socket: within
PUBLISH_CHECK_SECONDS of a change of membership (or of the drained set), within
LOAD_REFRESH_SECONDS of a load-only change (the same lag a single process's routing snapshot
allows), and every REPUBLISH_SECONDS regardless, so a worker that starts late catches up. The
prefills' announced work (`Load.prefill_tokens`) goes to the workers on a PUB socket of its own
the moment each report arrives, as a single process hands it to its planner. The admin API's
changes come in over a ROUTER socket; each reply names the revision whose
publication shows the change, and what only an operator said (instances registered through the
API, the drained set) is written to the shared directory after every change.

A registry process started again takes back that admin state and knows the static instances;
the others announce again within one TTL. Until then it publishes nothing (the workers keep
routing on their copy) and refuses admin changes ("try again"): a publication of its partial
table would take the rest of the fleet away from every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from pdproxy.config import Settings
from pdproxy.ids import Address
from pdproxy.metrics import Metrics
from pdproxy.multiworker.shared_state import SharedState, WorkReport, decode, encode
from pdproxy.registry.discovery import Discovery, start_discovery
from pdproxy.registry.operator import AdminState, ControlReply, ControlRequest, FleetOperator
from pdproxy.registry.seeded import seeded_table
from pdproxy.registry.server import RegistryServer
from pdproxy.registry.table import LOAD_REFRESH_SECONDS

log = logging.getLogger("pdproxy.registry")

PUBLISH_CHECK_SECONDS = 0.05
REPUBLISH_SECONDS = 2.0
# Work reports queued for a worker that is not reading: past this many, the newest are dropped
# for it (the next report of the same prefill replaces a lost one within milliseconds).
WORK_QUEUE_BOUND = 10_000


class RegistryHub:
    def __init__(
        self,
        settings: Settings,
        state_endpoint: str,
        control_endpoint: str,
        work_endpoint: str,
        admin_path: str,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
        restarted: bool = False,
    ) -> None:
        self._state_endpoint = state_endpoint
        self._control_endpoint = control_endpoint
        self._work_endpoint = work_endpoint
        self._work_publisher: zmq.Socket[bytes] | None = None
        self._admin_path = admin_path
        self._clock = clock
        self._hold_until = clock() + (settings.ttl if restarted else 0.0)
        self._settings = settings
        self._metrics = metrics
        self.table = seeded_table(settings, metrics, clock)
        self.registry = RegistryServer(settings, self.table, metrics, clock)
        self.operator = FleetOperator(self.registry, self.table)
        if os.path.exists(admin_path):
            with open(admin_path, "rb") as saved:
                self.operator.restore(decode(saved.read(), AdminState))
        # Counted on from the (system-wide) monotonic clock in nanoseconds: a registry process
        # started again publishes revisions above its predecessor's, so a worker waiting for
        # "this revision or later" is never satisfied by its copy of the old process's state.
        self.revision = int(clock() * 1e9)
        self._content: tuple[int, frozenset[str]] | None = None  # what `revision` stands for
        self._published: tuple[int, frozenset[str]] | None = None  # membership, drained
        self._published_load = -1
        self._published_at = float("-inf")

    def state(self) -> SharedState:
        """The state to publish now; the revision moves when the content did."""
        content = (self.table.revision, self.operator.drained)
        if content != self._content:
            self.revision += 1
            self._content = content
        return SharedState(self.revision, tuple(self.table.registrations()), self.operator.drained)

    def due(self, now: float) -> bool:
        """Whether to publish now (never while holding back after a restart)."""
        if now < self._hold_until:
            return False
        if (self.table.version, self.operator.drained) != self._published:
            return True
        since = now - self._published_at
        if self.table.revision != self._published_load and since >= LOAD_REFRESH_SECONDS:
            return True
        return since >= REPUBLISH_SECONDS

    def control(self, request: ControlRequest) -> ControlReply | None:
        """Apply an admin change; None when it came too late (its client heard 503)."""
        now = self._clock()
        if now > request.expires_at:
            log.warning("registry: dropped an admin %s that arrived too late", request.operation)
            return None
        if now < self._hold_until:
            return ControlReply(
                False,
                self.revision,
                unavailable="the registry process was started again and is hearing the fleet "
                f"again: try again in {self._hold_until - now:.0f}s",
            )
        done, refusal = self.operator.apply(request)
        if done:
            self._save_admin_state()
        return ControlReply(done, self.state().revision, refusal)

    def published(self, now: float) -> None:
        self._published = (self.table.version, self.operator.drained)
        self._published_load = self.table.revision
        self._published_at = now

    def _save_admin_state(self) -> None:
        partial = self._admin_path + ".partial"
        with open(partial, "wb") as file:
            file.write(encode(self.operator.admin_state()))
        os.replace(partial, self._admin_path)  # whole or not at all, even if we die meanwhile

    async def run(self, started: Callable[[], None], stop: asyncio.Event) -> None:
        """Serve until `stop` is set; raises if one of its loops failed (the supervisor starts
        the process again)."""
        self.registry.publish_counts()
        self.registry.start()  # raises if the registry address is taken
        discovery: Discovery | None = start_discovery(self._settings, self.registry, self._metrics)
        context = zmq.asyncio.Context()
        publisher = context.socket(zmq.PUB)
        controls = context.socket(zmq.ROUTER)
        # Not an asyncio socket: reports are sent from the registry's callback, and a PUB
        # socket never waits (past its bound it drops).
        work_publisher: zmq.Socket[bytes] = zmq.Context.shadow(context.underlying).socket(zmq.PUB)
        tasks: list[asyncio.Task[None]] = []
        try:
            for sock in (publisher, controls, work_publisher):
                sock.setsockopt(zmq.LINGER, 0)
            work_publisher.setsockopt(zmq.SNDHWM, WORK_QUEUE_BOUND)
            publisher.bind(self._state_endpoint)
            controls.bind(self._control_endpoint)
            work_publisher.bind(self._work_endpoint)
            self._work_publisher = work_publisher
            self.registry.work_listener = self.forward_work
            tasks = [
                asyncio.create_task(self._publish_loop(publisher), name="hub-publish"),
                asyncio.create_task(self._control_loop(controls, publisher), name="hub-control"),
            ]
            started()
            stopped = asyncio.create_task(stop.wait(), name="hub-stop")
            done, _ = await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            for task in done:
                if task is not stopped:
                    raise RuntimeError(f"the registry's {task.get_name()} loop ended") from (
                        task.exception() if not task.cancelled() else None
                    )
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if discovery is not None:
                await discovery.stop()
            await self.registry.stop()
            self.registry.work_listener = None
            self._work_publisher = None
            publisher.close(linger=0)
            controls.close(linger=0)
            work_publisher.close(linger=0)
            context.term()

    def forward_work(self, address: Address, prefill_tokens: int) -> None:
        """The registry's work listener: every HTTP worker hears the report at once."""
        if self._work_publisher is None:
            return
        try:
            self._work_publisher.send(encode(WorkReport(address, prefill_tokens)), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a report is worth less than the registry's loop
            log.warning("registry: could not forward a work report of %s: %s", address, exc)

    async def _publish_loop(self, publisher: zmq.asyncio.Socket) -> None:
        while True:
            await asyncio.sleep(PUBLISH_CHECK_SECONDS)
            if self.due(self._clock()):
                await self._publish(publisher)

    async def _publish(self, publisher: zmq.asyncio.Socket) -> None:
        state = self.state()
        await publisher.send(encode(state))
        self.published(self._clock())

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
            if reply is None:
                continue
            if reply.done:
                await self._publish(publisher)  # before the reply: the worker waits to see it
            await controls.send_multipart([sender, encode(reply)])
