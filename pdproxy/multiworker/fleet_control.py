"""The admin API's way to the registry process, which owns the table and the drained set when
HTTP workers share one (`--workers` > 1); the in-process way is pdproxy.registry.control."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import zmq
import zmq.asyncio

from pdproxy.multiworker.shared_state import decode, encode
from pdproxy.multiworker.table_mirror import TableMirror
from pdproxy.registry.control import ControlUnavailable
from pdproxy.registry.operator import ControlReply, ControlRequest

log = logging.getLogger("pdproxy")

# How long an admin request waits for the registry process, then for this worker's copy to show
# the change (so the same client reads its own write).
CONTROL_TIMEOUT_SECONDS = 5.0


class RemoteControl:
    def __init__(self, endpoint: str, context: zmq.asyncio.Context, mirror: TableMirror) -> None:
        self._endpoint = endpoint
        self._context = context
        self._mirror = mirror

    async def apply(self, request: ControlRequest) -> ControlReply:
        # A socket per request: a reply that comes too late can never answer another one.
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        expires_at = time.monotonic() + CONTROL_TIMEOUT_SECONDS
        try:
            sock.connect(self._endpoint)
            async with asyncio.timeout(CONTROL_TIMEOUT_SECONDS):
                await sock.send(encode(dataclasses.replace(request, expires_at=expires_at)))
                reply = decode(await sock.recv(), ControlReply)
        except TimeoutError:
            raise ControlUnavailable(
                f"the registry process did not answer within {CONTROL_TIMEOUT_SECONDS:g}s"
            ) from None
        finally:
            sock.close(linger=0)
        if reply.unavailable is not None:
            raise ControlUnavailable(reply.unavailable)
        if reply.done and not await self._mirror.caught_up(reply.revision, CONTROL_TIMEOUT_SECONDS):
            log.warning("admin change applied, but this worker's copy has not shown it yet")
        return reply
