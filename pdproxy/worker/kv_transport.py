"""Moving KV frames between a prefill rank and a decode rank over TCP: ZMQ PUSH/PULL.

Behind two small interfaces (`KvSender`, `KvReceiver`), so a transport over NCCL or RDMA can
take its place for GPU tensors. This one carries host memory: payloads go out zero-copy
(pyzmq keeps the buffer alive until sent), from one sender thread per process, so the model's
forward pass only gathers and enqueues; a large payload received stays in the buffer libzmq
read it into, never copied again. Every wait is bounded: a destination that does not take a
frame within `send_timeout` fails that frame (and with it the transfer), and the queue is
capped in bytes.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import zmq

from pdproxy.worker.kv_buffer import Loss, Transfer, TransferBuffer
from pdproxy.worker.kv_wire import LayerHeader, WireError, decode_header

log = logging.getLogger("pdproxy.worker.kv")

_POLL_MS = 100
_DRAIN = 64  # messages taken per wake-up of the receive thread
_ZERO_COPY_BYTES = 64 * 1024  # payloads at least this large are kept in libzmq's buffer
_STOP = object()

# Told of each frame once it left (True) or was given up on (False).
SentCallback = Callable[[LayerHeader, bool], None]


class KvSender(Protocol):
    def send(self, address: str, header: LayerHeader, payload: memoryview) -> bool: ...

    def close(self) -> None: ...


class KvReceiver(Protocol):
    def take(self, key: str) -> Transfer | Loss | None: ...

    def forget(self, key: str) -> None: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class _Outgoing:
    address: str
    header: LayerHeader
    payload: memoryview  # keeps the tensor's memory alive until sent


class ZmqSender:
    def __init__(
        self,
        on_sent: SentCallback,
        *,
        max_queued_bytes: int,
        send_timeout: float,
        delay: float = 0.0,
    ) -> None:
        self._on_sent = on_sent
        self._max_queued_bytes = max_queued_bytes
        self._send_timeout = send_timeout
        self._delay = delay  # tests only: hold every frame this long before sending
        self._queue: queue.SimpleQueue[_Outgoing | object] = queue.SimpleQueue()
        self._queued_bytes = 0
        self._lock = threading.Lock()
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._thread = threading.Thread(target=self._run, name="pdproxy-kv-send", daemon=True)
        self._thread.start()

    def send(self, address: str, header: LayerHeader, payload: memoryview) -> bool:
        """Enqueue one frame; False (and nothing queued) when the queue is full."""
        size = payload.nbytes
        with self._lock:
            if self._queued_bytes + size > self._max_queued_bytes:
                return False
            self._queued_bytes += size
        self._queue.put(_Outgoing(address, header, payload))
        return True

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=self._send_timeout + 1.0)

    def _run(self) -> None:
        sockets: dict[str, zmq.Socket[bytes]] = {}
        try:
            while True:
                item = self._queue.get()
                if item is _STOP:
                    return
                assert isinstance(item, _Outgoing)
                if self._delay:
                    time.sleep(self._delay)
                ok = self._deliver(sockets, item)
                with self._lock:
                    self._queued_bytes -= item.payload.nbytes
                self._on_sent(item.header, ok)
        finally:
            for sock in sockets.values():
                sock.close(linger=0)

    def _deliver(self, sockets: dict[str, zmq.Socket[bytes]], item: _Outgoing) -> bool:
        sock = sockets.get(item.address)
        if sock is None:
            sock = self._context.socket(zmq.PUSH)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a peer that is really there
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{item.address}")
            sockets[item.address] = sock
        deadline = time.monotonic() + self._send_timeout
        frames: list[bytes | memoryview] = [item.header.encode(), item.payload]
        while True:
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return True
            except zmq.Again:
                if time.monotonic() >= deadline:
                    log.warning(
                        "pdproxy connector: %s did not take KV for %s within %gs",
                        item.address,
                        item.header.key,
                        self._send_timeout,
                    )
                    # The socket may hold a half-sent backlog for a dead peer: start afresh.
                    sock.close(linger=0)
                    del sockets[item.address]
                    return False
                time.sleep(0.002)


class ZmqReceiver:
    def __init__(
        self,
        bind_host: str,
        port: int,
        buffer: TransferBuffer,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._buffer = buffer
        self._clock = clock
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(f"tcp://{bind_host}:{port}")
        self._thread = threading.Thread(target=self._run, name="pdproxy-kv-recv", daemon=True)
        self._thread.start()

    def take(self, key: str) -> Transfer | Loss | None:
        with self._lock:
            return self._buffer.take(key)

    def forget(self, key: str) -> None:
        with self._lock:
            self._buffer.forget(key)

    def partial(self, key: str) -> tuple[int, int]:
        """(frames, bytes) arrived so far for `key`."""
        with self._lock:
            transfer = self._buffer.partial(key)
            return (0, 0) if transfer is None else (len(transfer.frames), transfer.size)

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=2.0)
        with contextlib.suppress(zmq.ZMQError):
            self._socket.close(linger=0)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stopping.is_set():
            if poller.poll(_POLL_MS):
                # Take what is already queued (bounded, so expiry still gets its turn).
                for _ in range(_DRAIN):
                    if not self._receive_one():
                        break
            with self._lock:
                expired = self._buffer.expire(self._clock())
            for key in expired:
                log.warning("pdproxy connector: KV for %s was never claimed; freed", key)

    def _receive_one(self) -> bool:
        """Take one message if one is waiting; False when none was."""
        try:
            # Not copied: libzmq received each payload into a buffer of its own, which the
            # frame keeps alive for as long as the transfer holds it.
            frames = self._socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        if len(frames) != 2:
            log.warning("pdproxy connector: dropped a KV message of %d frames", len(frames))
            return True
        try:
            header = decode_header(frames[0].bytes)
        except WireError as exc:
            log.warning("pdproxy connector: dropped a KV message: %s", exc)
            return True
        # A small payload is copied: it may share libzmq's batch buffer with other messages,
        # which a held view would keep alive.
        body = frames[1]
        payload = body.buffer if len(body) >= _ZERO_COPY_BYTES else body.bytes
        with self._lock:
            loss = self._buffer.add(header, payload, self._clock())
        if loss is Loss.OVER_CAPACITY:
            log.warning("pdproxy connector: KV buffer full; refused KV for %s", header.key)
        return True
