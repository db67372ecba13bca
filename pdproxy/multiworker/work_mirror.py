"""An HTTP worker's ear for the prefills' announced work (`--workers` > 1): the registry process
forwards each report as it arrives (`WorkReport`), and the worker hands it to its planner's legs
in flight (`WorkSink`) exactly as a single process's registry does, so every worker places
prompts by the work the others put on a prefill within milliseconds, not by a table copy.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from pdproxy.base.tasks import stop_task
from pdproxy.multiworker.shared_state import WorkReport, decode
from pdproxy.registry.control import WorkSink

log = logging.getLogger("pdproxy.registry")

# Reports waiting for this worker's loop: past this many the newest are dropped (each prefill
# reports again within milliseconds of its next change).
RECEIVE_QUEUE_BOUND = 10_000
RECEIVE_RETRY_SECONDS = 0.1


class WorkMirror:
    def __init__(self, endpoint: str, context: zmq.asyncio.Context, sink: WorkSink) -> None:
        self._endpoint = endpoint
        self._context = context
        self._sink = sink
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Subscribe, and from now on let the planner rely on the reports (`follow_work`)."""
        sock = self._context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE_BOUND)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(self._endpoint)
        self._sink.follow_work()
        self._task = asyncio.create_task(self._receive_loop(sock), name="work-mirror")

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None

    def apply(self, report: WorkReport) -> None:
        self._sink.announced_work(report.address, report.prefill_tokens)

    async def _receive_loop(self, sock: zmq.asyncio.Socket) -> None:
        try:
            while True:
                try:
                    data = await sock.recv()
                except zmq.ZMQError as exc:  # keep hearing reports, whatever happened
                    log.warning("work reports: receiving failed (%s); trying again", exc)
                    await asyncio.sleep(RECEIVE_RETRY_SECONDS)
                    continue
                try:
                    self.apply(decode(data, WorkReport))
                except Exception:  # a bad report must not end the others
                    log.exception("work reports: could not apply a report")
        finally:
            sock.close(linger=0)
