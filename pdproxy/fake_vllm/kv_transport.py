"""KV messages over ZMQ (the frames are in kv_wire): every worker serves a ROUTER on its KV
port, which stores pushed KV (p2p_nccl decode) and answers pulls (nixl/pdproxy prefill); a
prefill pushes through DEALERs, and a decode pulls through a DEALER of its own per request."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from pdproxy.fake_vllm.kv_held import HeldTransfers
from pdproxy.fake_vllm.kv_stats import KvStats, payload_size
from pdproxy.fake_vllm.kv_store import KvItem, KvStore
from pdproxy.fake_vllm.kv_wire import (
    MAX_KV_MESSAGE_BYTES,
    Pull,
    PullReply,
    Push,
    Register,
    WireError,
    decode,
    encode,
)
from pdproxy.fake_vllm.records import Records, stamp

log = logging.getLogger("pdproxy.fake_vllm")

KV_SENDER_CACHE = 64  # push sockets kept open, one per decode destination
KV_SNDHWM = 1000


def kv_socket(ctx: zmq.asyncio.Context, kind: int) -> zmq.asyncio.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_KV_MESSAGE_BYTES)  # a bigger frame drops the peer
    return sock


async def serve_kv(
    sock: zmq.asyncio.Socket,
    store: KvStore,
    held: HeldTransfers,
    records: Records,
    stats: KvStats,
    registered: Callable[[Register], Awaitable[None]],
) -> None:
    """Handle [peer identity, frame] messages on the KV port's ROUTER, forever. `registered`
    takes a nixl_push decode's registration (the prefill's side)."""
    while True:
        frames = await sock.recv_multipart()
        if len(frames) != 2:
            log.warning("fake worker: ignoring a KV message of %d frames", len(frames))
            continue
        identity, frame = frames
        try:
            message = decode(frame)
        except WireError as err:
            log.warning("fake worker: ignoring a malformed KV message: %s", err)
            continue
        if isinstance(message, Push):
            store.put(message.request_id, KvItem(message.sender, message.payload, time.monotonic()))
            records.add(
                "kv_received",
                {"request_id": message.request_id, "sender": message.sender, **stamp()},
            )
        elif isinstance(message, Pull):
            started = stats.clock()
            reply, served = held.answer(message)
            entry = {"transfer_id": message.transfer_id, "requester": message.requester}
            if reply.error is not None:
                records.kv_failed(reply.error, **entry)
            elif served is not None:
                size = payload_size(served.payload)
                stats.report(served.stats, message.requester, "ok", size, started)
                records.add("kv_served", {**entry, "bytes": size, **stamp()})
            # A ROUTER never blocks: a reply to a peer that went away is dropped.
            await sock.send_multipart([identity, encode(reply)])
        elif isinstance(message, Register):
            await registered(message)
        else:
            log.warning("fake worker: ignoring a pull reply nobody asked this port for")


async def pull_kv(
    ctx: zmq.asyncio.Context, address: str, pull: Pull, timeout_s: float
) -> PullReply:
    """Ask the prefill at `address` for its held KV; raises TimeoutError (nothing answered
    within timeout_s), zmq.ZMQError or WireError."""
    sock = kv_socket(ctx, zmq.DEALER)
    try:
        sock.connect(f"tcp://{address}")
        # One socket per pull, so its only reply is the answer to this pull.
        async with asyncio.timeout(timeout_s):
            await sock.send(encode(pull))
            reply = decode(await sock.recv())
    finally:
        sock.close(linger=0)
    if not isinstance(reply, PullReply) or reply.transfer_id != pull.transfer_id:
        raise WireError(f"expected the pull reply for transfer {pull.transfer_id}")
    return reply


class KvSender:
    """DEALER sockets to decode workers, one per destination, least recently used closed first."""

    def __init__(self, ctx: zmq.asyncio.Context, own_address: str) -> None:
        self._ctx = ctx
        self.own_address = own_address
        self._sockets: OrderedDict[str, zmq.asyncio.Socket] = OrderedDict()

    def _socket(self, destination: str) -> zmq.asyncio.Socket:
        sock = self._sockets.get(destination)
        if sock is not None:
            self._sockets.move_to_end(destination)
            return sock
        sock = kv_socket(self._ctx, zmq.DEALER)
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

    async def push(self, destination: str, message: Push | Register, timeout_s: float) -> None:
        """Queue the message for `destination`; raises zmq.ZMQError, TimeoutError or WireError."""
        frame = encode(message)
        # asyncio sockets never block the loop, but a full queue would wait forever. Not
        # wait_for: Python 3.11's loses a cancellation that comes as the send completes, and
        # a decode leg the proxy closed would then wait out its KV instead of ending.
        async with asyncio.timeout(timeout_s):
            await self._socket(destination).send(frame)

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()
