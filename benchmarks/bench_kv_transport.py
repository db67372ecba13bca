"""Benchmark: pdproxy's KV transport between two local processes, against a plain socket copy.

Issue 7, "Performance": the transfer throughput of the connector's TCP transport for KV of 1, 16,
256 and 2,048 blocks, in MB/s and time per request, against the loopback limit measured with a
plain socket copy of the same bytes between two processes. Goal: at least 70% of that limit for
large transfers. It measures `pdproxy.vllm_side.kv_tcp` (plain TCP, receive memory reused from a
pool), the connector's transport.

Two child processes, a prefill rank ("sender") and a decode rank ("receiver"), each this script
started again with ``--role``; this process only coordinates them over their stdin/stdout.
Everything binds 127.0.0.1. One request is all layers of N blocks of one rank's KV:

- the sender runs the real `ProducerWorker.save_layer` for every layer (`gather_kv` +
  `wire_to_bytes`, one frame per layer) into a holding sender: that time is the **gather**
  column. Then, at t0, it hands the frames to the real sender (`TcpSender`), as
  `save_layer` would have;
- the receiver runs the real receiver (`TcpReceiver`) with a `TransferBuffer`
  and a real `ConsumerWorker` waiting for the request; t1 is when the buffer holds the whole
  transfer (timed inside `TransferBuffer.add`). Transport time = t1 - t0 (both CLOCK_MONOTONIC,
  one clock for the machine). Then `ConsumerWorker.poll()` takes it whole and writes it into the
  decode cache (`wire_from_bytes` + `scatter_kv` per layer): the **scatter** column;
- the baselines: the sender sends a preallocated buffer of the same size over one TCP
  connection, the receiver `recv_into`s a preallocated buffer until it has every byte; timed the
  same way (t0 before the first send, t1 after the last `recv_into`). **plain**: one `sendall`
  of it all, each `recv_into` takes whatever is there (the baseline of the first version of this
  script). **plain, chunked**: sends of `--plain-send-chunk` (1 MiB) and `recv_into`s of at most
  `--plain-recv-chunk` (128 KiB), which on Linux loopback moves more than twice as much per
  second as "plain" (6.1 against 2.6 GB/s here): the loopback limit the goal is measured against
  ("ratio to chunked"). **fresh**: as "plain", into pages never touched (a new mapping per
  request), what a receiver that allocates per request gets.

Receive memory is reused on both sides of the comparison: the baselines receive into the same
buffer every time, the TCP transport into its receive pool, which the warm-up request fills.

The transport and the baselines run alternately, rep by rep, so all see the same machine load.
The first request of each size is a warm-up (not counted) that also checks the decode cache
received exactly what the prefill cache held (CRC32 of the first and last layers).
`--gil-busy-ms/--gil-idle-ms` add a thread running Python in each child, as a busy vLLM main
thread would: the transport's threads need the GIL between system calls.

Every child runs in its own process group and is stopped by PID (SIGTERM, then SIGKILL) in a
``finally``, also on Ctrl-C, SIGTERM and SIGHUP; if this script is SIGKILLed the children get
SIGKILL from the kernel (PR_SET_PDEATHSIG) and also exit when their stdin closes.

    .venv/bin/python benchmarks/bench_kv_transport.py
    .venv/bin/python benchmarks/bench_kv_transport.py --blocks 1,16,256 --repeats 20 --pin
    .venv/bin/python benchmarks/bench_kv_transport.py --heads 8 --layers 16 --dtype float16
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as dt
import json
import mmap
import os
import platform
import queue
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from arg_types import positive_int
from unwind import run_unwound, write_json_report

REPO_ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = "127.0.0.1"
DEFAULT_BLOCKS = (1, 16, 256, 2048)
STOP_TIMEOUT_S = 5.0
START_TIMEOUT_S = 120.0  # importing torch and filling the caches
MB = 1e6  # MB/s are decimal megabytes per second
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "uint8": 1}
PLANES = 2  # K and V


class BenchError(RuntimeError):
    """A failure that ends the benchmark with a message instead of a traceback."""


@dataclass(frozen=True)
class Geometry:
    layers: int
    heads: int  # KV heads of this rank
    head_dim: int
    block_size: int
    dtype: str

    @property
    def bytes_per_block(self) -> int:
        """One block of one rank's KV over all layers (K and V)."""
        per_layer = PLANES * self.block_size * self.heads * self.head_dim
        return self.layers * per_layer * DTYPE_BYTES[self.dtype]

    def describe(self) -> str:
        return (
            f"{self.layers} layers x {PLANES} (K,V) x {self.block_size} tokens x {self.heads} KV "
            f"heads x head_dim {self.head_dim} x {self.dtype} = {self.bytes_per_block:,} bytes "
            f"({self.bytes_per_block / 1024:,.0f} KiB) per block, "
            f"{self.bytes_per_block // self.layers:,} bytes per block and layer"
        )


def geometry_of(args: argparse.Namespace) -> Geometry:
    return Geometry(args.layers, args.heads, args.head_dim, args.block_size, args.dtype)


# ---- children: the prefill rank and the decode rank ----------------------------------------


class Channel:
    """A child's side of the coordinator's pipe: JSON commands in, JSON replies out."""

    def __init__(self) -> None:
        # Replies go to the real stdout; anything else printing to fd 1 lands in the log.
        self._out: IO[str] = os.fdopen(os.dup(1), "w", encoding="utf-8")
        os.dup2(2, 1)

    def commands(self) -> Any:
        for line in sys.stdin:
            if line.strip():
                yield json.loads(line)

    def reply(self, **fields: Any) -> None:
        self._out.write(json.dumps(fields) + "\n")
        self._out.flush()


def _transfer_key(uid: str, decode_port: int) -> Any:
    from pdproxy.vllm_side.kv_keys import transfer_key

    key = transfer_key(
        f"cmpl-___prefill_addr_{LOOPBACK}:1___decode_addr_{LOOPBACK}:{decode_port}_{uid}-0-abcdef01"
    )
    if key is None:
        raise BenchError("could not build a transfer key")
    return key


def _caches(geometry: Geometry, blocks: int, seed: int) -> dict[str, Any]:
    """vLLM 0.32 CPU-backend caches (blocks, heads, block_size, 2 * head_dim) per layer."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, geometry.dtype)
    shape = (blocks, geometry.heads, geometry.block_size, 2 * geometry.head_dim)
    caches = {}
    for layer in range(geometry.layers):
        cache = torch.empty(shape, dtype=dtype)
        # Random bytes (some are NaN as floats): gather and scatter only move them.
        cache.view(torch.uint8).random_(0, 256, generator=generator)
        caches[f"model.layers.{layer}.self_attn.attn"] = cache
    return caches


def _block_ids(count: int, seed: int) -> list[int]:
    """A shuffled order of the cache's blocks, as a long-running cache hands them out."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [int(i) for i in torch.randperm(count, generator=generator)]


def _crc(layers: Sequence[tuple[int, bytes | bytearray | memoryview]]) -> dict[str, int]:
    return {str(layer): zlib.crc32(data) for layer, data in layers}


def _usage() -> tuple[int, float]:
    """(minor page faults, CPU seconds) of this whole process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt, usage.ru_utime + usage.ru_stime


def _since(before: tuple[int, float]) -> dict[str, float]:
    faults, cpu = _usage()
    return {"faults": faults - before[0], "cpu_s": cpu - before[1]}


def _fresh_pages(size: int) -> mmap.mmap:
    """Private anonymous memory never touched: what malloc hands out for a large block."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _recv_exactly(sock: socket.socket, view: memoryview, size: int, chunk: int = 0) -> int:
    """Receive `size` bytes into `view` (at most `chunk` per call, 0: as many as there are);
    when the last one arrived (monotonic ns)."""
    got = 0
    while got < size:
        n = sock.recv_into(view[got:size], min(chunk, size - got) if chunk else 0)
        if n == 0:
            raise BenchError("the sender closed the plain socket")
        got += n
    return time.monotonic_ns()


def _filled_buffer(size: int) -> bytearray:
    """A buffer whose pages are all really there (not the shared zero page)."""
    import torch

    buffer = bytearray(size)
    if size:
        torch.frombuffer(buffer, dtype=torch.uint8).random_(0, 256)
    return buffer


def apply_tuning(settings: Sequence[str]) -> None:
    """Experiments only: `--tune kv_tcp._BATCH_FRAMES=1` sets a constant of a module of
    pdproxy.vllm_side in this child before anything runs."""
    import importlib

    for setting in settings:
        target, _, value = setting.partition("=")
        module_name, _, name = target.rpartition(".")
        module = importlib.import_module(f"pdproxy.vllm_side.{module_name}")
        if not hasattr(module, name):
            raise BenchError(f"--tune: pdproxy.vllm_side.{module_name} has no {name}")
        setattr(module, name, int(value, 0))


def start_gil_load(busy_ms: float, idle_ms: float) -> None:
    """A thread running Python bytecode for `busy_ms`, then sleeping `idle_ms`, for ever: what
    a busy vLLM main thread does to the transport's threads, which need the GIL between system
    calls. Off when `busy_ms` is 0."""
    if busy_ms <= 0:
        return

    def load() -> None:
        count = 0
        while True:
            until = time.perf_counter() + busy_ms / 1e3
            while time.perf_counter() < until:
                count += 1
            time.sleep(idle_ms / 1e3)

    threading.Thread(target=load, name="gil-load", daemon=True).start()


def run_sender(args: argparse.Namespace) -> None:
    import torch

    from pdproxy.pairing.geometry import KvGeometry, KvLayout
    from pdproxy.vllm_side.kv import CacheFormat
    from pdproxy.vllm_side.kv_schedule import SendSpec
    from pdproxy.vllm_side.kv_tcp import TcpSender
    from pdproxy.vllm_side.kv_wire import LayerHeader
    from pdproxy.vllm_side.kv_worker import ProducerWorker, TransferRecord

    apply_tuning(args.tune)
    start_gil_load(args.gil_busy_ms, args.gil_idle_ms)
    geometry = geometry_of(args)
    channel = Channel()
    max_blocks = max(args.blocks)
    caches = _caches(geometry, max_blocks, seed=1)
    names = list(caches)
    block_ids = _block_ids(max_blocks, seed=11)
    plain = _filled_buffer(max_blocks * geometry.bytes_per_block)

    class HeldSender:
        """Takes what ProducerWorker sends and holds it: gather and transport timed apart."""

        def __init__(self) -> None:
            self.frames: list[tuple[str, LayerHeader, memoryview]] = []

        def send(self, address: str, header: LayerHeader, payload: memoryview) -> bool:
            self.frames.append((address, header, payload))
            return True

        def close(self) -> None:
            pass

    records: queue.SimpleQueue[TransferRecord] = queue.SimpleQueue()
    kv_geometry = KvGeometry(
        1,
        geometry.block_size,
        geometry.layers,
        geometry.heads,
        geometry.head_dim,
        geometry.dtype,
        False,
        KvLayout.HND,
    )
    producer = ProducerWorker(
        0, kv_geometry, CacheFormat.BHNC_CPU, f"{LOOPBACK}:1", records.put, clock=time.monotonic
    )
    producer.register(caches)
    held = HeldSender()
    producer.attach(held)
    queue_cap = max(1 << 30, max_blocks * geometry.bytes_per_block)
    sender = TcpSender(
        producer.sent,
        max_queued_bytes=queue_cap,
        send_timeout=args.timeout,
        send_buffer_bytes=args.socket_buffer,
    )
    plain_socket: socket.socket | None = None
    channel.reply(ok=True, pid=os.getpid(), torch_threads=torch.get_num_threads())
    try:
        for command in channel.commands():
            op = command["op"]
            if op == "quit":
                return
            if op == "usage":
                faults, cpu_s = _usage()
                channel.reply(ok=True, faults=faults, cpu_s=cpu_s)
            elif op == "sock_connect":
                plain_socket = socket.create_connection((LOOPBACK, command["port"]), timeout=30)
                plain_socket.settimeout(None)
                channel.reply(ok=True)
            elif op == "sock_send":
                assert plain_socket is not None
                size = command["bytes"]
                chunk = command.get("chunk") or size
                view = memoryview(plain)
                start = time.monotonic_ns()
                for at in range(0, size, chunk):
                    plain_socket.sendall(view[at : min(at + chunk, size)])
                channel.reply(ok=True, start_ns=start)
                view.release()
            elif op == "kv_send":
                blocks = command["blocks"]
                key = _transfer_key(command["uid"], command["port"])
                spec = SendSpec(
                    "p-req", key, tuple(block_ids[:blocks]), blocks * geometry.block_size
                )
                held.frames.clear()
                gather_usage = _usage()
                began = time.perf_counter()
                for name in names:
                    producer.save_layer(name, caches[name], [spec])
                gather_s = time.perf_counter() - began
                gather_usage_delta = _since(gather_usage)
                frames, held.frames = held.frames, []
                crc = (
                    _crc([(frames[0][1].layer, frames[0][2]), (frames[-1][1].layer, frames[-1][2])])
                    if command.get("check")
                    else {}
                )
                faults, cpu_s = _usage()
                start = time.monotonic_ns()
                refused = sum(not sender.send(*frame) for frame in frames)
                enqueue_s = (time.monotonic_ns() - start) / 1e9
                del frames
                record = records.get(timeout=args.timeout + 30)
                channel.reply(
                    ok=refused == 0 and record.outcome == "ok",
                    start_ns=start,
                    gather_s=gather_s,
                    enqueue_s=enqueue_s,
                    bytes=record.bytes,
                    outcome=record.outcome,
                    refused=refused,
                    crc=crc,
                    gather_usage=gather_usage_delta,
                    send_usage={"faults": faults, "cpu_s": cpu_s},  # at the first send
                )
            else:
                channel.reply(ok=False, error=f"unknown op {op!r}")
    finally:
        sender.close()
        if plain_socket is not None:
            plain_socket.close()


def run_receiver(args: argparse.Namespace) -> None:
    import torch

    from pdproxy.demo.processes import free_port
    from pdproxy.vllm_side.kv import CacheFormat, gather_kv, wire_to_bytes
    from pdproxy.vllm_side.kv_buffer import Loss, Payload, TransferBuffer
    from pdproxy.vllm_side.kv_schedule import LoadSpec
    from pdproxy.vllm_side.kv_tcp import TcpReceiver
    from pdproxy.vllm_side.kv_wire import LayerHeader
    from pdproxy.vllm_side.kv_worker import ConsumerWorker, TransferRecord

    apply_tuning(args.tune)
    start_gil_load(args.gil_busy_ms, args.gil_idle_ms)
    geometry = geometry_of(args)
    channel = Channel()
    max_blocks = max(args.blocks)
    max_bytes = max_blocks * geometry.bytes_per_block
    caches = _caches(geometry, max_blocks, seed=2)
    names = list(caches)
    block_ids = _block_ids(max_blocks, seed=22)
    plain = _filled_buffer(max_bytes)

    class TimedBuffer(TransferBuffer):
        """A TransferBuffer that notes when each transfer became whole (the receive thread)."""

        def __init__(self, capacity: int, ttl: float) -> None:
            super().__init__(capacity, ttl)
            self.done: dict[str, int | str] = {}
            self.changed = threading.Condition()

        def add(self, header: LayerHeader, payload: Payload, now: float) -> Loss | None:
            loss = super().add(header, payload, now)
            transfer = self.partial(header.key)
            if loss is not None or (transfer is not None and transfer.complete):
                with self.changed:
                    self.done.setdefault(header.key, loss or time.monotonic_ns())
                    self.changed.notify_all()
            return loss

        def wait(self, key: str, timeout: float) -> int | str | None:
            """When `key` became whole (monotonic ns), or how it was lost, or None: timeout."""
            with self.changed:
                self.changed.wait_for(lambda: key in self.done, timeout=timeout)
                return self.done.pop(key, None)

    def layer_crc(layers: Sequence[int], ids: list[int], tokens: int) -> dict[str, int]:
        wires = [
            (
                layer,
                wire_to_bytes(gather_kv(caches[names[layer]], CacheFormat.BHNC_CPU, ids, tokens)),
            )
            for layer in layers
        ]
        return _crc(wires)

    port = free_port()
    buffer = TimedBuffer(2 * max_bytes + (64 << 20), ttl=3600.0)
    receiver = TcpReceiver(
        LOOPBACK,
        port,
        buffer,
        pool_bytes=args.pool_bytes,
        receive_buffer_bytes=args.socket_buffer,
    )
    records: queue.SimpleQueue[TransferRecord] = queue.SimpleQueue()
    consumer = ConsumerWorker(0, geometry.block_size, CacheFormat.BHNC_CPU, 3600.0, records.put)
    consumer.register(caches)
    consumer.attach(receiver)
    listener = socket.create_server((LOOPBACK, 0))
    plain_socket: socket.socket | None = None
    channel.reply(
        ok=True,
        pid=os.getpid(),
        kv_port=port,
        sock_port=listener.getsockname()[1],
        torch_threads=torch.get_num_threads(),
    )
    try:
        for command in channel.commands():
            op = command["op"]
            if op == "quit":
                return
            if op == "sock_accept":
                listener.settimeout(30)
                plain_socket, _ = listener.accept()
                plain_socket.settimeout(None)
                listener.close()
                channel.reply(ok=True)
            elif op == "sock_recv":
                assert plain_socket is not None
                size = command["bytes"]
                # fresh: into pages never touched, as a receiver allocating per request gets them
                fresh = _fresh_pages(size) if command.get("fresh") else None
                view = memoryview(plain if fresh is None else fresh)
                receive_usage = _usage()
                channel.reply(ok=True, ready=True)
                done_ns = _recv_exactly(plain_socket, view, size, command.get("chunk", 0))
                channel.reply(ok=True, done_ns=done_ns, receive_usage=_since(receive_usage))
                view.release()
                if fresh is not None:
                    fresh.close()
            elif op == "kv_recv":
                blocks = command["blocks"]
                key = _transfer_key(command["uid"], port)
                tokens = blocks * geometry.block_size
                spec = LoadSpec("d-req", key, tuple(block_ids[:blocks]), 0, tokens)
                consumer.start([spec], [])
                receive_usage = _usage()
                channel.reply(ok=True, ready=True)
                done = buffer.wait(key.key, args.timeout + 30)
                receive_usage_delta = _since(receive_usage)
                if not isinstance(done, int):
                    channel.reply(ok=False, error=f"transfer not whole: {done or 'timeout'}")
                    continue
                scatter_usage = _usage()
                began = time.perf_counter()
                loaded, failed = consumer.poll()
                scatter_s = time.perf_counter() - began
                scatter_usage_delta = _since(scatter_usage)
                record = records.get(timeout=5)
                crc = {}
                if command.get("check"):
                    crc = layer_crc((0, geometry.layers - 1), block_ids[:blocks], tokens)
                channel.reply(
                    ok=loaded == {"d-req"} and not failed and record.outcome == "ok",
                    done_ns=done,
                    scatter_s=scatter_s,
                    bytes=record.bytes,
                    outcome=record.outcome,
                    crc=crc,
                    receive_usage=receive_usage_delta,
                    scatter_usage=scatter_usage_delta,
                )
            else:
                channel.reply(ok=False, error=f"unknown op {op!r}")
    finally:
        receiver.close()
        listener.close()
        if plain_socket is not None:
            plain_socket.close()


# ---- the coordinator -----------------------------------------------------------------------


def _die_with_parent() -> None:
    """Child pre-exec hook (Linux): get SIGKILL if this script dies without cleaning up."""
    with contextlib.suppress(Exception):
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


_PREEXEC = _die_with_parent if sys.platform.startswith("linux") else None


@dataclass
class Child:
    """One child process and its replies, read by a thread so every wait can be bounded."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    replies: queue.SimpleQueue[dict[str, Any] | None] = field(default_factory=queue.SimpleQueue)

    def start_reader(self) -> None:
        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                with contextlib.suppress(ValueError):
                    self.replies.put(json.loads(line))
            self.replies.put(None)  # the child closed its stdout: it is gone

        threading.Thread(target=read, name=f"{self.name}-replies", daemon=True).start()

    def tell(self, **command: Any) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(command) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise BenchError(f"{self.name} is gone:\n{self.log_tail()}") from None

    def answer(self, timeout: float) -> dict[str, Any]:
        try:
            reply = self.replies.get(timeout=timeout)
        except queue.Empty:
            raise BenchError(
                f"{self.name} did not answer within {timeout:g}s:\n{self.log_tail()}"
            ) from None
        if reply is None:
            raise BenchError(f"{self.name} exited:\n{self.log_tail()}")
        if not reply.get("ok"):
            raise BenchError(f"{self.name} failed: {reply}\n{self.log_tail()}")
        return reply

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])


def child_env() -> dict[str, str]:
    """OpenMP threads that wait passively: torch's (libgomp's) spinning workers left over from a
    gather or scatter otherwise take half a core from the transport's threads on a small box."""
    return {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}


def spawn(name: str, role_args: list[str], log_dir: Path, core: int | None) -> Child:
    log_path = log_dir / f"{name}.log"
    pin = ["taskset", "-c", str(core)] if core is not None else []
    argv = [*pin, sys.executable, str(Path(__file__).resolve()), *role_args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv,
            cwd=REPO_ROOT,
            env=child_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,  # own process group: killpg(pid) reaches only it
            preexec_fn=_PREEXEC,  # noqa: PLW1509 - started before any thread of ours
        )
    child = Child(name, proc, log_path)
    child.start_reader()
    return child


def stop(child: Child) -> None:
    """Ask it to quit; then SIGTERM its process group (by its PID), then SIGKILL."""
    with contextlib.suppress(BenchError):
        child.tell(op="quit")
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.proc.wait(timeout=1.0)
    pgid = child.proc.pid  # start_new_session=True: the child leads group == its pid
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
        try:
            child.proc.wait(timeout=STOP_TIMEOUT_S)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


# Per request: seconds, and page faults / CPU seconds of a whole process during a phase.
SAMPLES = (
    "transport_s",  # first send .. the receiver holds the whole transfer
    "plain_s",  # sendall .. the last recv_into
    "gather_s",  # ProducerWorker.save_layer for every layer (gather_kv + wire_to_bytes)
    "scatter_s",  # ConsumerWorker.poll: take + wire_from_bytes + scatter_kv for every layer
    "enqueue_s",  # KvSender.send for every frame (the sender thread does the rest)
    "receiver_faults",  # minor page faults of the decode process while receiving
    "receiver_cpu_s",  # its CPU then (all threads)
    "sender_cpu_s",  # the prefill process's CPU from the first send until the receiver had it
    "plain_receiver_faults",
    "plain_receiver_cpu_s",
    "plain_chunked_s",  # the same in sends of --plain-send-chunk, recv_into of --plain-recv-chunk
    "plain_chunked_receiver_faults",
    "plain_chunked_receiver_cpu_s",
    "plain_fresh_s",  # the same into pages never touched (a fresh mmap per request)
    "plain_fresh_receiver_faults",
    "plain_fresh_receiver_cpu_s",
    "gather_faults",
    "scatter_faults",
)


@dataclass
class SizeResult:
    blocks: int
    bytes: int
    repeats: int
    samples: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in SAMPLES})

    def add(self, one: dict[str, float]) -> None:
        for name, value in one.items():
            self.samples[name].append(value)

    def median(self, name: str) -> float:
        return statistics.median(self.samples[name])

    def mb_s(self, seconds: float) -> float:
        return self.bytes / seconds / MB

    def summary(self) -> dict[str, Any]:
        transport, plain = self.samples["transport_s"], self.samples["plain_s"]
        out: dict[str, Any] = {
            "blocks": self.blocks,
            "bytes": self.bytes,
            "repeats": self.repeats,
            "transport_mb_s_median": self.mb_s(statistics.median(transport)),
            "transport_mb_s_best": self.mb_s(min(transport)),
            "plain_mb_s_median": self.mb_s(statistics.median(plain)),
            "plain_mb_s_best": self.mb_s(min(plain)),
            "ratio_median": statistics.median(plain) / statistics.median(transport),
            "ratio_best": min(plain) / min(transport),
            "plain_chunked_mb_s_median": self.mb_s(self.median("plain_chunked_s")),
            "plain_chunked_mb_s_best": self.mb_s(min(self.samples["plain_chunked_s"])),
            "ratio_chunked_median": self.median("plain_chunked_s") / statistics.median(transport),
            "transport_ms_median": statistics.median(transport) * 1e3,
            "transport_ms_best": min(transport) * 1e3,
            "plain_fresh_mb_s_median": self.mb_s(self.median("plain_fresh_s")),
        }
        for name in SAMPLES:
            if name.endswith("_s"):
                out[f"{name[:-2]}_ms_median"] = self.median(name) * 1e3
            else:
                out[f"{name}_median"] = self.median(name)
        return out


def repeats_for(size: int, asked: int | None) -> int:
    """Asked, or about 2 GB of traffic per size, at least 5 and at most 50 requests."""
    if asked is not None:
        return asked
    return max(5, min(50, (2 << 30) // max(size, 1)))


class Bench:
    def __init__(self, args: argparse.Namespace, sender: Child, receiver: Child) -> None:
        self.args = args
        self.sender = sender
        self.receiver = receiver
        self.kv_port = 0

    def bound(self, size: int) -> float:
        return float(self.args.timeout) + size / (20 * MB)  # generous even at 20 MB/s

    def setup(self) -> None:
        sender_hello = self.sender.answer(START_TIMEOUT_S)
        receiver_hello = self.receiver.answer(START_TIMEOUT_S)
        self.kv_port = receiver_hello["kv_port"]
        self.sender.tell(op="sock_connect", port=receiver_hello["sock_port"])
        self.sender.answer(30)
        self.receiver.tell(op="sock_accept")
        self.receiver.answer(30)
        print(
            f"sender pid {sender_hello['pid']}, receiver pid {receiver_hello['pid']} "
            f"(torch threads {sender_hello['torch_threads']}/{receiver_hello['torch_threads']})",
            flush=True,
        )

    def transport_once(self, blocks: int, size: int, check: bool) -> dict[str, float]:
        uid = uuid.uuid4().hex
        self.receiver.tell(op="kv_recv", uid=uid, blocks=blocks, check=check)
        self.receiver.answer(30)  # the decode side is waiting for the request
        self.sender.tell(op="kv_send", uid=uid, blocks=blocks, port=self.kv_port, check=check)
        sent = self.sender.answer(self.bound(size))
        got = self.receiver.answer(self.bound(size))
        self.sender.tell(op="usage")  # the sender's CPU until the receiver had it all (+ a bit)
        sender_now = self.sender.answer(30)
        if sent["bytes"] != size or got["bytes"] != size:
            raise BenchError(f"{size} bytes expected, sent {sent['bytes']}, got {got['bytes']}")
        if check and sent["crc"] != got["crc"]:
            raise BenchError(
                f"{blocks} blocks: decode cache differs: {sent['crc']} vs {got['crc']}"
            )
        return {
            "transport_s": (got["done_ns"] - sent["start_ns"]) / 1e9,
            "gather_s": sent["gather_s"],
            "scatter_s": got["scatter_s"],
            "enqueue_s": sent["enqueue_s"],
            "receiver_faults": got["receive_usage"]["faults"],
            "receiver_cpu_s": got["receive_usage"]["cpu_s"],
            "sender_cpu_s": sender_now["cpu_s"] - sent["send_usage"]["cpu_s"],
            "gather_faults": sent["gather_usage"]["faults"],
            "scatter_faults": got["scatter_usage"]["faults"],
        }

    def plain_once(self, size: int, fresh: bool = False, chunked: bool = False) -> dict[str, float]:
        send_chunk = self.args.plain_send_chunk if chunked else 0
        recv_chunk = self.args.plain_recv_chunk if chunked else 0
        self.receiver.tell(op="sock_recv", bytes=size, fresh=fresh, chunk=recv_chunk)
        self.receiver.answer(30)  # blocked in recv_into from here on
        self.sender.tell(op="sock_send", bytes=size, chunk=send_chunk)
        sent = self.sender.answer(self.bound(size))
        got = self.receiver.answer(self.bound(size))
        name = "plain_fresh" if fresh else "plain_chunked" if chunked else "plain"
        return {
            f"{name}_s": float(got["done_ns"] - sent["start_ns"]) / 1e9,
            f"{name}_receiver_faults": got["receive_usage"]["faults"],
            f"{name}_receiver_cpu_s": got["receive_usage"]["cpu_s"],
        }

    def measure(self, blocks: int, bytes_per_block: int) -> SizeResult:
        size = blocks * bytes_per_block
        repeats = repeats_for(size, self.args.repeats)
        self.transport_once(blocks, size, check=True)  # warm-up and correctness
        self.plain_once(size)
        result = SizeResult(blocks, size, repeats)
        for _ in range(repeats):
            result.add(self.transport_once(blocks, size, check=False))
            result.add(self.plain_once(size))
            result.add(self.plain_once(size, chunked=True))
            result.add(self.plain_once(size, fresh=True))
        return result


def cpu_times() -> list[int] | None:
    """The machine's CPU ticks (user, nice, system, idle, iowait, irq, softirq, steal)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        first = Path("/proc/stat").read_text().splitlines()[0].split()
        return [int(v) for v in first[1:9]]
    return None


def busy_share(before: list[int] | None, after: list[int] | None) -> dict[str, float]:
    """Shares of the machine's CPU time during the run: busy, and stolen by the hypervisor."""
    if before is None or after is None:
        return {}
    delta = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(delta) or 1
    idle = delta[3] + delta[4]
    return {"busy": (total - idle - delta[7]) / total, "steal": delta[7] / total}


def pinning(args: argparse.Namespace) -> tuple[int | None, int | None, str]:
    if not args.pin:
        return None, None, "unpinned"
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None, None, f"unpinned: only cores {cores} available"
    return cores[0], cores[1], f"sender on core {cores[0]}, receiver on core {cores[1]}"


def child_args(args: argparse.Namespace, role: str) -> list[str]:
    return [
        "--role",
        role,
        "--layers",
        str(args.layers),
        "--heads",
        str(args.heads),
        "--head-dim",
        str(args.head_dim),
        "--block-size",
        str(args.block_size),
        "--dtype",
        args.dtype,
        "--blocks",
        ",".join(map(str, args.blocks)),
        "--timeout",
        str(args.timeout),
        *(["--socket-buffer", str(args.socket_buffer)] if args.socket_buffer else []),
        *(["--pool-bytes", str(args.pool_bytes)] if args.pool_bytes is not None else []),
        *[f"--tune={setting}" for setting in args.tune],
        f"--gil-busy-ms={args.gil_busy_ms}",
        f"--gil-idle-ms={args.gil_idle_ms}",
    ]


def run_bench(args: argparse.Namespace) -> dict[str, Any]:

    geometry = geometry_of(args)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdproxy-bench-kv-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    sender_core, receiver_core, pin_note = pinning(args)
    print(f"geometry: {geometry.describe()}")
    omp = child_env()["OMP_WAIT_POLICY"]
    print(f"logs: {log_dir}; {pin_note}; OMP_WAIT_POLICY={omp}; loopback {LOOPBACK}", flush=True)
    started: list[Child] = []
    results: list[SizeResult] = []
    ticks_before, load_before = cpu_times(), os.getloadavg()
    try:
        started.append(spawn("receiver", child_args(args, "receiver"), log_dir, receiver_core))
        started.append(spawn("sender", child_args(args, "sender"), log_dir, sender_core))
        bench = Bench(args, sender=started[1], receiver=started[0])
        bench.setup()
        for blocks in args.blocks:
            result = bench.measure(blocks, geometry.bytes_per_block)
            results.append(result)
            row = result.summary()
            print(
                f"  {blocks:>6,} blocks: transport {row['transport_mb_s_median']:,.0f} MB/s, "
                f"plain socket {row['plain_mb_s_median']:,.0f} MB/s, chunked "
                f"{row['plain_chunked_mb_s_median']:,.0f} MB/s ({result.repeats} requests)",
                flush=True,
            )
    finally:
        for child in reversed(started):
            stop(child)
    return {
        "meta": {
            "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg": os.getloadavg(),
            "cpu_share": busy_share(ticks_before, cpu_times()),
            "pinning": pin_note,
            "socket_buffer": args.socket_buffer,
            "pool_bytes": args.pool_bytes,
            "tune": args.tune,
            "plain_send_chunk": args.plain_send_chunk,
            "gil_load_ms": [args.gil_busy_ms, args.gil_idle_ms],
            "plain_recv_chunk": args.plain_recv_chunk,
            "omp_wait_policy": child_env()["OMP_WAIT_POLICY"],
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
            "geometry": asdict(geometry),
            "bytes_per_block": geometry.bytes_per_block,
        },
        "results": [r.summary() for r in results],
        "raw": [asdict(r) for r in results],
    }


def table(rows: list[dict[str, Any]]) -> str:
    header = (
        "| blocks | bytes | transport MB/s (median / best) | plain socket MB/s (median / best) "
        "| ratio | plain socket, chunked MB/s (median / best) | ratio to chunked "
        "| ms per request (median / best) | gather ms | scatter ms |"
    )
    lines = [header, "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(
            f"| {r['blocks']:,} | {r['bytes']:,} "
            f"| {r['transport_mb_s_median']:,.0f} / {r['transport_mb_s_best']:,.0f} "
            f"| {r['plain_mb_s_median']:,.0f} / {r['plain_mb_s_best']:,.0f} "
            f"| {r['ratio_median']:.0%} "
            f"| {r['plain_chunked_mb_s_median']:,.0f} / {r['plain_chunked_mb_s_best']:,.0f} "
            f"| **{r['ratio_chunked_median']:.0%}** "
            f"| {_ms(r['transport_ms_median'])} / {_ms(r['transport_ms_best'])} "
            f"| {_ms(r['gather_ms_median'])} | {_ms(r['scatter_ms_median'])} |"
        )
    return "\n".join(lines)


def cost_table(rows: list[dict[str, Any]]) -> str:
    """Where the time goes: page faults and CPU of each side, per request (medians)."""
    header = (
        "| blocks | plain socket into fresh pages MB/s "
        "| receiver page faults (transport / plain / plain fresh) "
        "| receiver CPU ms (transport / plain / plain fresh) | sender CPU ms (transport) "
        "| gather faults | scatter faults |"
    )
    lines = [header, "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(
            f"| {r['blocks']:,} | {r['plain_fresh_mb_s_median']:,.0f} "
            f"| {r['receiver_faults_median']:,.0f} / {r['plain_receiver_faults_median']:,.0f} / "
            f"{r['plain_fresh_receiver_faults_median']:,.0f} "
            f"| {_ms(r['receiver_cpu_ms_median'])} / {_ms(r['plain_receiver_cpu_ms_median'])} / "
            f"{_ms(r['plain_fresh_receiver_cpu_ms_median'])} "
            f"| {_ms(r['sender_cpu_ms_median'])} "
            f"| {r['gather_faults_median']:,.0f} | {r['scatter_faults_median']:,.0f} |"
        )
    return "\n".join(lines)


def _ms(value: float) -> str:
    return f"{value:,.2f}" if value < 10 else f"{value:,.0f}"


# ---- command line --------------------------------------------------------------------------


def _block_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("block counts must be positive")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="pdproxy's KV transport between two local processes vs a plain socket copy."
    )
    add = parser.add_argument
    add("--blocks", type=_block_list, default=list(DEFAULT_BLOCKS), help="default 1,16,256,2048")
    add("--layers", type=positive_int, default=32, help="attention layers (default 32)")
    add("--heads", type=positive_int, default=2, help="KV heads of the rank (default 2)")
    add("--head-dim", type=positive_int, default=128, help="default 128")
    add("--block-size", type=positive_int, default=16, help="tokens per block (default 16)")
    add("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16", help="default bfloat16")
    add("--repeats", type=positive_int, default=None, help="requests per size (default 5..50)")
    add("--timeout", type=float, default=60.0, help="send timeout and per-request bound")
    add("--plain-send-chunk", type=positive_int, default=1 << 20, help="chunked baseline: 1 MiB")
    add(
        "--plain-recv-chunk", type=positive_int, default=128 << 10, help="chunked baseline: 128 KiB"
    )
    add("--gil-busy-ms", type=float, default=0.0, help="a Python thread in each child busy ...")
    add("--gil-idle-ms", type=float, default=0.0, help="... then idle this long (default off)")
    add("--socket-buffer", type=positive_int, default=None, help="tcp: SO_SNDBUF/SO_RCVBUF bytes")
    add("--pool-bytes", type=int, default=None, help="tcp: receive pool cap (0: no pool)")
    add("--pin", action="store_true", help="sender on one core, receiver on another")
    add("--log-dir", default=None, help="child logs (default: a new temp dir)")
    add("--json", default=None, metavar="PATH", help="also write every number here")
    add("--role", choices=("sender", "receiver"), default=None, help=argparse.SUPPRESS)
    add("--tune", action="append", default=[], help=argparse.SUPPRESS)  # experiments only
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role == "sender":
        run_sender(args)
        return 0
    if args.role == "receiver":
        run_receiver(args)
        return 0
    report = run_unwound(lambda: run_bench(args), (BenchError, TimeoutError, OSError))
    print()
    print(table(report["results"]))
    print("\nwhere the time goes (medians per request; CPU of the whole process, all threads):")
    print(cost_table(report["results"]))
    meta = report["meta"]
    print(
        f"\n{meta['bytes_per_block']:,} bytes per block; MB = 10^6 bytes; "
        f"transport kv_tcp; "
        f"{meta['pinning']}; "
        f"load average {meta['loadavg_before'][0]:.2f} before, {meta['loadavg'][0]:.2f} at the end"
        + (
            f"; CPU busy {share['busy']:.0%}, stolen {share['steal']:.1%} during the run"
            if (share := meta["cpu_share"])
            else ""
        )
    )
    if args.json:
        write_json_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
