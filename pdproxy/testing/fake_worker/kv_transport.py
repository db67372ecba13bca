"""KV payloads over ZMQ: a prefill worker PUSHes, a decode worker PULLs into its store.

A frame is [b"kv", request_id, sender zmq address, payload].
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

import zmq
import zmq.asyncio

from pdproxy.testing.fake_worker.kv_store import KvItem, KvStore
from pdproxy.testing.fake_worker.records import Records, stamp

log = logging.getLogger("pdproxy.testing.fake_worker")

KV_SENDER_CACHE = 64  # PUSH sockets kept open, one per decode destination
KV_SNDHWM = 1000
KV_FRAME_TAG = b"kv"


async def receive_kv(sock: zmq.asyncio.Socket, store: KvStore, records: Records) -> None:
    """Pull [b"kv", request_id, sender zmq address, payload] frames into the store, forever."""
    while True:
        frames = await sock.recv_multipart()
        if len(frames) != 4 or frames[0] != KV_FRAME_TAG:
            log.warning("fake worker: ignoring a malformed KV message (%d frames)", len(frames))
            continue
        try:
            request_id, sender = frames[1].decode(), frames[2].decode()
        except UnicodeDecodeError:
            log.warning("fake worker: ignoring a KV message with a non-UTF-8 id or sender")
            continue
        store.put(request_id, KvItem(sender, frames[3], time.monotonic()))
        records.add(
            "kv_received",
            {"request_id": request_id, "sender": sender, "bytes": len(frames[3]), **stamp()},
        )


class KvSender:
    """PUSH sockets to decode workers, one per destination, least recently used closed first."""

    def __init__(self, ctx: zmq.asyncio.Context, own_address: str) -> None:
        self._ctx = ctx
        self._own = own_address.encode()
        self._sockets: OrderedDict[str, zmq.asyncio.Socket] = OrderedDict()

    def _socket(self, destination: str) -> zmq.asyncio.Socket:
        sock = self._sockets.get(destination)
        if sock is not None:
            self._sockets.move_to_end(destination)
            return sock
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, KV_SNDHWM)
        try:
            sock.connect(f"tcp://{destination}")
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        self._sockets[destination] = sock
        while len(self._sockets) > KV_SENDER_CACHE:
            self._sockets.popitem(last=False)[1].close(linger=0)
        return sock

    async def push(
        self, destination: str, request_id: str, payload: bytes, timeout_s: float
    ) -> None:
        """Queue the payload for `destination`; raises zmq.ZMQError or TimeoutError."""
        frames = [KV_FRAME_TAG, request_id.encode(), self._own, payload]
        # asyncio sockets never block the loop, but a full queue would wait forever.
        await asyncio.wait_for(self._socket(destination).send_multipart(frames), timeout_s)

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()
