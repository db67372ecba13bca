"""Moving KV frames between a prefill rank and a decode rank over plain TCP.

Implements `kv_transport.KvSender` and `KvReceiver`. Each frame (`kv_wire`) goes as prefix +
header + payload (`kv_wire.frame_prefix`) over one persistent connection per destination:
nothing sits between the two processes' threads and the kernel, and the receiver reads every
payload into memory it reuses (`kv_pool.ReceivePool`).

Sending: one sender thread per process; the forward pass only gathers and enqueues. The thread
writes the frames queued for one destination together (up to `_BATCH_FRAMES` / `_BATCH_BYTES`:
small transfers cost few system calls), headers and payloads in one `sendmsg` at a time,
straight from the gathered tensors' memory (no copy in user space). Every wait is bounded: the
socket is blocking with a kernel send timeout (SO_SNDTIMEO) of what is left of `send_timeout`,
so a destination that does not take a frame within `send_timeout` fails that frame, the rest of
its transfer toward that destination at once, and its connection (which may hold half a frame).
Connecting is retried until the same deadline; a frame cut by a broken connection is sent again
from its start on a new one. The queue is capped in bytes. `close` shuts the connections down,
which wakes a blocked send, and reports what is still queued as failed.

Receiving: one thread serves the listening socket and every connection with a selector. It reads
a frame's prefix and header, asks the `TransferBuffer` whether the frame would be kept
(`TransferBuffer.admit`, which counts the bytes still being received against its cap), and reads
the payload straight into a buffer of its own size (`recv_into`; no further copy; a large one
from the pool, so a transfer does not fault in fresh pages). A frame that would be refused is
read into the staging buffer and dropped, never allocated; a bad header costs that frame only
(the prefix keeps the stream in step); a stream that is not pdproxy's, or a connection that
stalls mid-frame for `stall_timeout`, is closed; connections are capped. Every read is bounded
(a kernel receive timeout of `_WAIT_S`), and the loop wakes at least every `_POLL_S` to expire
unclaimed transfers, trim the pool and stop.

System-call sizes: large payloads move in pieces, at most `_SEND_CHUNK` (1 MiB) per `sendmsg`
and `_DIRECT_CHUNK` (128 KiB) per `recv_into`. On Linux loopback that doubles throughput over
one call per frame: a plain socket copy of 1 GiB between two processes moved 2.6 GB/s as one
`sendall` read with `recv_into` of whatever was there, 6.1 GB/s in 1 MiB sends and 128 KiB
reads (benchmarks/README.md, "KV transport"). Our reading, not verified in the kernel: a call
that copies a lot keeps its socket locked, so the peer's segments and acknowledgements wait in
the socket's backlog meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import selectors
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from pdproxy.vllm_side.kv_buffer import Loss, Transfer, TransferBuffer
from pdproxy.vllm_side.kv_pool import PoolStats, ReceivePool
from pdproxy.vllm_side.kv_transport import SentCallback
from pdproxy.vllm_side.kv_wire import (
    PREFIX_BYTES,
    LayerHeader,
    WireError,
    decode_header,
    decode_prefix,
    frame_prefix,
)

log = logging.getLogger("pdproxy.vllm_side.kv")

_STOP = object()
_BATCH_FRAMES = 128  # frames for one destination written together at most
_BATCH_BYTES = 256 << 20
_IOV_MAX = 256  # buffers handed to one sendmsg (Linux allows 1024)
_SEND_CHUNK = 1 << 20  # the most one sendmsg is given (see the module's docstring)
_CONNECT_RETRY_S = 0.02
_REMEMBERED_FAILURES = 4096

_POLL_S = 0.1  # the receive loop's longest sleep: expiry, trimming and close get their turn
_WAIT_S = 0.05  # the longest one read of a payload waits for more bytes
_STAGE_BYTES = 64 * 1024  # prefixes, headers and small payloads are read through this
_DIRECT_BYTES = 64 * 1024  # payload parts at least this large are read straight to their buffer
_DIRECT_FLAGS = 0  # such a read returns what is there (waiting up to _WAIT_S for a first byte)
_DIRECT_CHUNK = 128 * 1024  # the most one such read asks for (see the module's docstring)
_PUMP_BYTES = 64 << 20  # one connection's turn: at most this much ...
_PUMP_S = 0.1  # ... and this long, then the others (and the housekeeping) get theirs
_MAX_CONNECTIONS = 256  # x _STAGE_BYTES: 16 MiB of staging at most


def _timeval(seconds: float) -> bytes:
    """A kernel socket timeout: at least a millisecond (zero would mean no timeout at all)."""
    micros = max(int(seconds * 1e6), 1000)
    return struct.pack("@ll", micros // 1_000_000, micros % 1_000_000)


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


@dataclass(slots=True)
class _Frame:
    address: str
    header: LayerHeader
    payload: memoryview  # keeps the tensor's memory alive until sent


class TcpSender:
    def __init__(
        self,
        on_sent: SentCallback,
        *,
        max_queued_bytes: int,
        send_timeout: float,
        delay: float = 0.0,
        send_buffer_bytes: int | None = None,
    ) -> None:
        self._on_sent = on_sent
        self._max_queued_bytes = max_queued_bytes
        self._send_timeout = send_timeout
        self._delay = delay  # tests only: hold every frame this long before sending
        self._send_buffer_bytes = send_buffer_bytes  # None: the kernel's autotuning
        self._queue: queue.SimpleQueue[_Frame | object] = queue.SimpleQueue()
        self._queued_bytes = 0
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._sockets: dict[str, socket.socket] = {}  # guarded by _lock
        # Transfers that already failed toward a destination: their other frames fail at once.
        self._failed: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._thread = threading.Thread(target=self._run, name="pdproxy-kv-send", daemon=True)
        self._thread.start()

    def send(self, address: str, header: LayerHeader, payload: memoryview) -> bool:
        """Enqueue one frame; False (and nothing queued) when the queue is full or closed."""
        if payload.ndim != 1 or payload.format != "B":
            payload = payload.cast("B")
        size = payload.nbytes
        with self._lock:
            if self._closing.is_set() or self._queued_bytes + size > self._max_queued_bytes:
                return False
            self._queued_bytes += size
        self._queue.put(_Frame(address, header, payload))
        return True

    def close(self) -> None:
        """Stop: a send under way is interrupted, frames still queued are reported failed."""
        with self._lock:
            self._closing.set()
            for sock in self._sockets.values():
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        self._queue.put(_STOP)
        self._thread.join(timeout=self._send_timeout + 1.0)

    # -- the sender thread -------------------------------------------------------------------

    def _run(self) -> None:
        held: _Frame | object | None = None
        try:
            while True:
                item = held if held is not None else self._queue.get()
                held = None
                if not isinstance(item, _Frame):
                    return
                batch = [item]
                if self._delay:
                    self._closing.wait(self._delay)
                else:
                    held = self._gather(batch)
                if self._closing.is_set():
                    self._report(batch, [False] * len(batch))
                else:
                    self._report(batch, self._deliver(batch))
        finally:
            with self._lock:
                sockets, self._sockets = list(self._sockets.values()), {}
            for sock in sockets:
                sock.close()
            left = [held] if isinstance(held, _Frame) else []
            with contextlib.suppress(queue.Empty):
                while True:
                    item = self._queue.get_nowait()
                    if isinstance(item, _Frame):
                        left.append(item)
            self._report(left, [False] * len(left))

    def _gather(self, batch: list[_Frame]) -> _Frame | object | None:
        """More queued frames for the same destination into `batch`; the first one that is not
        (to be handled next), or None."""
        size = batch[0].payload.nbytes
        while len(batch) < _BATCH_FRAMES and size < _BATCH_BYTES:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return None
            if not isinstance(item, _Frame) or item.address != batch[0].address:
                return item
            batch.append(item)
            size += item.payload.nbytes
        return None

    def _report(self, batch: list[_Frame], results: list[bool]) -> None:
        for frame, ok in zip(batch, results, strict=True):
            with self._lock:
                self._queued_bytes -= frame.payload.nbytes
            try:
                self._on_sent(frame.header, ok)
            except Exception:  # the callback's failure must not end the sender thread
                log.exception("pdproxy connector: KV sent-callback failed")

    def _deliver(self, batch: list[_Frame]) -> list[bool]:
        """Write `batch` (one destination) to its connection; whether each frame went out."""
        address = batch[0].address
        results = [False] * len(batch)
        todo = [i for i, f in enumerate(batch) if (address, f.header.key) not in self._failed]
        heads: dict[int, bytes] = {}
        for i in todo:
            encoded = batch[i].header.encode()
            heads[i] = frame_prefix(len(encoded), batch[i].payload.nbytes) + encoded
        position = 0  # index into todo
        offset = 0  # bytes of todo[position] written to the current connection
        deadline = time.monotonic() + self._send_timeout
        sock: socket.socket | None = None
        while position < len(todo) and not self._closing.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if sock is None:
                sock = self._connection(address, deadline)
                offset = 0  # a frame starts over on a new connection
                if sock is None:
                    break
            buffers = self._buffers(batch, heads, todo[position:], offset)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(remaining))
                sent = sock.sendmsg(buffers)
            except (BlockingIOError, TimeoutError, InterruptedError):
                continue  # the kernel's timeout: the deadline is checked above
            except OSError as exc:
                log.info("pdproxy connector: KV connection to %s broke: %s", address, exc)
                self._forget_connection(address)
                sock = None
                self._closing.wait(_CONNECT_RETRY_S)
                continue
            offset += sent
            while position < len(todo):
                index = todo[position]
                length = len(heads[index]) + batch[index].payload.nbytes
                if offset < length:
                    break
                offset -= length
                results[index] = True
                position += 1
                deadline = time.monotonic() + self._send_timeout
        if position < len(todo):
            if not self._closing.is_set():
                log.warning(
                    "pdproxy connector: %s did not take KV for %s within %gs",
                    address,
                    batch[todo[position]].header.key,
                    self._send_timeout,
                )
            if sock is not None and offset > 0:
                self._forget_connection(address)  # half a frame is on it: start afresh
            for index in todo[position:]:
                self._failed[(address, batch[index].header.key)] = None
            while len(self._failed) > _REMEMBERED_FAILURES:
                self._failed.popitem(last=False)
        return results

    @staticmethod
    def _buffers(
        batch: list[_Frame], heads: dict[int, bytes], todo: list[int], offset: int
    ) -> list[memoryview]:
        """What is left to write from `offset` into the first of `todo` on."""
        buffers: list[memoryview] = []
        room = _SEND_CHUNK
        for index in todo:
            if len(buffers) + 2 > _IOV_MAX or room <= 0:
                break
            for part in (memoryview(heads[index]), batch[index].payload):
                if offset >= part.nbytes:  # written already (or empty)
                    offset -= part.nbytes
                    continue
                piece = part[offset : offset + room]
                offset = 0
                buffers.append(piece)
                room -= piece.nbytes
                if room <= 0:
                    break
        return buffers

    def _connection(self, address: str, deadline: float) -> socket.socket | None:
        """The open connection to `address`, or a new one (retried until `deadline`)."""
        with self._lock:
            sock = self._sockets.get(address)
        if sock is not None:
            if _still_open(sock):
                return sock
            self._forget_connection(address)
        host, port = _split_address(address)
        while not self._closing.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                sock = socket.create_connection((host, port), timeout=remaining)
            except OSError:
                self._closing.wait(min(_CONNECT_RETRY_S, remaining))
                continue
            sock.settimeout(None)  # blocking; the kernel's SO_SNDTIMEO bounds each send
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._send_buffer_bytes:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._send_buffer_bytes)
            with self._lock:
                if self._closing.is_set():
                    sock.close()
                    return None
                self._sockets[address] = sock
            return sock
        return None

    def _forget_connection(self, address: str) -> None:
        with self._lock:
            sock = self._sockets.pop(address, None)
        if sock is not None:
            sock.close()


def _still_open(sock: socket.socket) -> bool:
    """Whether an idle connection is still usable: the receiver never writes, so anything
    readable (its close, a reset, or bytes it should not send) means it is not."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


@dataclass(slots=True, eq=False)
class _Connection:
    sock: socket.socket
    peer: str
    last_progress: float
    stage: bytearray = field(default_factory=lambda: bytearray(_STAGE_BYTES), repr=False)
    start: int = 0  # unread staged bytes are stage[start:end]
    end: int = 0
    header_bytes: int = 0  # of the frame under way; 0: its prefix is still to come
    payload_bytes: int = 0
    in_payload: bool = False
    header: LayerHeader | None = None  # None while in the payload: the frame is dropped
    payload: memoryview | None = None
    got: int = 0
    reserved: int = 0  # counted as pending against the buffer's cap

    @property
    def mid_frame(self) -> bool:
        return self.in_payload or self.header_bytes > 0 or self.end > self.start


class TcpReceiver:
    def __init__(
        self,
        bind_host: str,
        port: int,
        buffer: TransferBuffer,
        clock: Callable[[], float] = time.monotonic,
        *,
        pool_bytes: int | None = None,
        pool_idle_s: float = 60.0,
        stall_timeout: float = 30.0,
        receive_buffer_bytes: int | None = None,
        max_connections: int = _MAX_CONNECTIONS,
    ) -> None:
        """`pool_bytes`: cap on the reusable receive memory (None: the buffer's cap; 0: none);
        `stall_timeout`: a connection that makes no progress mid-frame this long is closed."""
        self._buffer = buffer
        self._clock = clock
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        pool_cap = buffer.max_bytes if pool_bytes is None else pool_bytes
        self._pool = ReceivePool(pool_cap, pool_idle_s)
        self._stall_timeout = stall_timeout
        self._receive_buffer_bytes = receive_buffer_bytes  # None: the kernel's autotuning
        self._max_connections = max_connections
        self._pending = 0  # payload bytes being received, reserved against the buffer's cap
        self._connections: dict[int, _Connection] = {}
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self._listener = socket.create_server((bind_host, port), family=family, backlog=128)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="pdproxy-kv-recv", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

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

    def pool_stats(self) -> PoolStats:
        with self._lock:
            return self._pool.stats()

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=2.0)
        if self._thread.is_alive():  # cannot be (every wait is bounded); never hang a shutdown
            log.warning("pdproxy connector: the KV receive thread did not stop")
            return
        with contextlib.suppress(OSError):
            self._listener.close()

    # -- the receive thread ------------------------------------------------------------------

    def _run(self) -> None:
        next_tick = 0.0
        try:
            while not self._stopping.is_set():
                for key, _ in self._selector.select(_POLL_S):
                    if key.fileobj is self._listener:
                        self._accept()
                    else:
                        connection = self._connections.get(key.fd)
                        if connection is not None and not self._pump(connection):
                            self._drop(connection)
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + _POLL_S
                    self._housekeeping(now)
        finally:
            for connection in list(self._connections.values()):
                self._drop(connection)
            self._selector.close()
            with self._lock:
                self._pool.close()

    def _housekeeping(self, now: float) -> None:
        with self._lock:
            expired = self._buffer.expire(self._clock())
            self._pool.trim()
        for key in expired:
            log.warning("pdproxy connector: KV for %s was never claimed; freed", key)
        for connection in list(self._connections.values()):
            if connection.mid_frame and now - connection.last_progress >= self._stall_timeout:
                log.warning(
                    "pdproxy connector: KV connection from %s stalled mid-frame; closed",
                    connection.peer,
                )
                self._drop(connection)

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of descriptors: try again on the next wake-up
                log.warning("pdproxy connector: accepting a KV connection failed: %s", exc)
                return
            if len(self._connections) >= self._max_connections:
                log.warning("pdproxy connector: too many KV connections; refused %s", peer)
                sock.close()
                continue
            sock.settimeout(None)  # blocking; the kernel's SO_RCVTIMEO bounds every read
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(_WAIT_S))
            if self._receive_buffer_bytes:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._receive_buffer_bytes)
            connection = _Connection(sock, f"{peer[0]}:{peer[1]}", time.monotonic())
            self._connections[sock.fileno()] = connection
            self._selector.register(sock, selectors.EVENT_READ)

    def _drop(self, connection: _Connection) -> None:
        fd = connection.sock.fileno()
        if self._connections.get(fd) is connection:
            del self._connections[fd]
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(connection.sock)
        connection.sock.close()
        if connection.in_payload and connection.header is not None:
            log.warning(
                "pdproxy connector: KV connection from %s closed in the middle of a frame for %s",
                connection.peer,
                connection.header.key,
            )
        self._pending -= connection.reserved
        connection.reserved = 0
        connection.payload = None  # pooled memory goes back once nothing holds it

    def _pump(self, connection: _Connection) -> bool:
        """Read what `connection` has (within its turn); False when it is to be closed."""
        began = time.monotonic()
        budget = _PUMP_BYTES
        sock = connection.sock
        try:
            while budget > 0:
                self._consume(connection)
                if (
                    connection.in_payload
                    and connection.payload is not None
                    and connection.payload_bytes - connection.got >= _DIRECT_BYTES
                ):
                    # Straight into the payload's own buffer, in pieces of _DIRECT_CHUNK.
                    left = connection.payload_bytes - connection.got
                    target = connection.payload[connection.got :]
                    count = sock.recv_into(target, min(left, _DIRECT_CHUNK), _DIRECT_FLAGS)
                    connection.got += count
                    if count and connection.got == connection.payload_bytes:
                        self._finish(connection)
                else:
                    if connection.start == connection.end:
                        connection.start = connection.end = 0
                    elif connection.end == len(connection.stage):
                        staged = connection.end - connection.start
                        connection.stage[:staged] = connection.stage[connection.start :]
                        connection.start, connection.end = 0, staged
                    view = memoryview(connection.stage)[connection.end :]
                    count = sock.recv_into(view, 0, socket.MSG_DONTWAIT)
                    connection.end += count
                if count == 0:
                    return False  # the peer closed the connection
                connection.last_progress = time.monotonic()
                budget -= count
                if connection.last_progress - began >= _PUMP_S:
                    break
            self._consume(connection)
        except (BlockingIOError, InterruptedError, TimeoutError):
            return True  # nothing more for now
        except WireError as exc:
            log.warning("pdproxy connector: closed KV connection from %s: %s", connection.peer, exc)
            return False
        except OSError as exc:
            log.warning("pdproxy connector: KV connection from %s failed: %s", connection.peer, exc)
            return False
        return True

    def _consume(self, connection: _Connection) -> None:
        """Make what is staged into frames, as far as it goes."""
        stage = connection.stage
        while True:
            staged = connection.end - connection.start
            if connection.in_payload:
                take = min(connection.payload_bytes - connection.got, staged)
                if take == 0:
                    return
                if connection.payload is not None:
                    at = connection.got
                    connection.payload[at : at + take] = memoryview(stage)[
                        connection.start : connection.start + take
                    ]
                connection.got += take
                connection.start += take
                if connection.got == connection.payload_bytes:
                    self._finish(connection)
            elif connection.header_bytes == 0:
                if staged < PREFIX_BYTES:
                    return
                at = connection.start
                connection.header_bytes, connection.payload_bytes = decode_prefix(
                    memoryview(stage)[at : at + PREFIX_BYTES]
                )
                connection.start += PREFIX_BYTES
            else:
                if staged < connection.header_bytes:
                    return
                at = connection.start
                raw = bytes(stage[at : at + connection.header_bytes])
                connection.start += connection.header_bytes
                self._begin(connection, raw)

    def _begin(self, connection: _Connection, raw: bytes) -> None:
        """A frame's header arrived: where its payload goes (nowhere: it is dropped)."""
        size = connection.payload_bytes
        connection.in_payload = True
        connection.got = 0
        try:
            header = decode_header(raw)
        except WireError as exc:
            log.warning("pdproxy connector: dropped a KV frame from %s: %s", connection.peer, exc)
        else:
            with self._lock:
                loss = self._buffer.admit(header, size, self._pending)
                if loss is None:
                    connection.header = header
                    connection.payload = self._pool.lend(size)
            if loss is Loss.OVER_CAPACITY:
                log.warning("pdproxy connector: KV buffer full; refused KV for %s", header.key)
            elif loss is Loss.INCONSISTENT:
                log.warning("pdproxy connector: KV for %s is inconsistent; dropped", header.key)
            if loss is None:
                connection.reserved = size
                self._pending += size
        if size == 0:
            self._finish(connection)

    def _finish(self, connection: _Connection) -> None:
        """A frame's payload arrived whole: into the buffer (unless it is being dropped)."""
        header, payload = connection.header, connection.payload
        self._pending -= connection.reserved
        connection.reserved = 0
        connection.in_payload = False
        connection.header_bytes = connection.payload_bytes = connection.got = 0
        connection.header = connection.payload = None
        if header is None or payload is None:
            return
        with self._lock:
            loss = self._buffer.add(header, payload, self._clock())
        if loss is Loss.OVER_CAPACITY:
            log.warning("pdproxy connector: KV buffer full; refused KV for %s", header.key)
