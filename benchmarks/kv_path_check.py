"""Check pdproxy's own KV connector path end to end, on a GPU when there is one: bit for bit, and
how fast each part of it is against a plain copy of the same bytes through host memory.

What runs is the connector's own code, as the PdproxyConnector runs it inside vLLM
(pdproxy.vllm_side; vLLM itself is not needed):

- this process is a prefill rank: `ProducerWorker.save_layer` for every layer gathers the
  request's tokens from paged KV blocks (`kv.gather_kv`, on the cache's device) and stages them
  in host memory (`kv.wire_to_bytes`: a device-to-host copy on CUDA), handing each frame to the
  real `TcpSender`;
- a second process (multiprocessing, spawned) is a decode rank: a real `TcpReceiver` listening on
  127.0.0.1 with a `TransferBuffer`, and a `ConsumerWorker` that takes the whole transfer and
  scatters it into its own blocks (`kv.wire_from_bytes` + `kv.scatter_kv`: host-to-device on
  CUDA), between the steps of its (here imagined) engine loop.

Caches are vLLM 0.32's per-layer tensors: `BHNC` (blocks, heads, block_size, 2 * head_dim) on
CUDA, and the CPU backend's `BHNC_CPU` on CPU, as the connector picks them (`--cache-format`
chooses another). Both sides fill every block with its own seeded random bytes, and the two
sides use different, shuffled block ids.

Each request (per dtype and number of blocks) runs twice, and a baseline once:

- **parts**, one after the other: `gather` (`gather_kv` for every layer, synchronised), `stage`
  (`wire_to_bytes` of those), `save_layer` (the two together as the connector calls them, into a
  holding sender), `transport` (those frames through `TcpSender` until the receiver's buffer
  holds all of them; both processes read CLOCK_MONOTONIC), `scatter` (`ConsumerWorker.poll`,
  synchronised);
- **path**: the real pipeline, as in vLLM: the first `save_layer` to the decode side's cache
  written (frames leave while later layers are still being gathered);
- **copy via host**: the same number of bytes copied device -> host -> device with two plain
  tensor copies (pageable host memory, as the path stages; on CUDA also through pinned memory).
  On CPU both hops are plain memcpys.

Bit for bit: before a checked request the decode side zeroes its destination blocks; after it,
every destination block must equal the prefill's source block byte for byte (rebuilt there from
the prefill's seed, not read through pdproxy's code), and every other block must still hold its
own bytes. The warm-up requests of each size and the last path request are checked. Any
mismatch makes the run fail (exit status 1) after the report.

    python benchmarks/kv_path_check.py                      # CUDA if available, else CPU
    python benchmarks/kv_path_check.py --quick --json /tmp/kv.json
    benchmarks/gpu_check.sh                                 # a hard timeout, JSON under $OUT

OpenMP workers wait passively (`omp_passive`, unless OMP_WAIT_POLICY is set): spinning ones
left over from a gather take the cores the other process and the transport threads need.

Works from a checkout with nothing installed beyond torch and msgpack (the transport's headers);
it imports nothing else outside the standard library, neither vLLM nor pyzmq. The defaults (a
7-8B model's rank: 32 layers, 8 KV heads, head_dim 128, blocks of 16 tokens: 2 MiB per block;
1, 16 and 128 blocks; float16 and bfloat16) take well under a minute on an H100 and a few on
a small CPU box; `--budget-s` bounds the whole run (sizes not started in time are skipped).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as dt
import multiprocessing
import os
import platform
import queue
import signal
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import checkout_root  # noqa: F401 - the checkout's pdproxy, with nothing installed
import omp_passive  # noqa: F401 - before torch: OpenMP workers that do not spin
import torch
from arg_types import positive_int, positive_ints
from unwind import run_unwound, write_json_report

from pdproxy.ids import build_request_id, make_address
from pdproxy.pairing.geometry import KvGeometry, KvLayout
from pdproxy.vllm_side.kv import CacheFormat, gather_kv, wire_to_bytes
from pdproxy.vllm_side.kv_buffer import Loss, Payload, TransferBuffer
from pdproxy.vllm_side.kv_keys import TransferKey, transfer_key
from pdproxy.vllm_side.kv_schedule import LoadSpec, SendSpec
from pdproxy.vllm_side.kv_tcp import TcpReceiver, TcpSender
from pdproxy.vllm_side.kv_wire import LayerHeader
from pdproxy.vllm_side.kv_worker import ConsumerWorker, ProducerWorker, TransferRecord

LOOPBACK = "127.0.0.1"
GB = 1e9  # GB/s are decimal gigabytes per second
MIB = 1 << 20
# The connector's defaults (pdproxy.vllm_side.connector_settings; not imported: it brings the
# announcer, hence pyzmq). The caps grow with --blocks so a large request is never refused.
CONNECTOR_QUEUE_BYTES = 1 << 30
CONNECTOR_BUFFER_BYTES = 1 << 30
CONNECTOR_SEND_TIMEOUT_S = 10.0
START_TIMEOUT_S = 180.0  # the decode process imports torch and initialises CUDA
STOP_TIMEOUT_S = 5.0
SETUP_TIMEOUT_S = 300.0  # filling a large cache on a slow CPU
# Bytes/s no part of the path is slower than even on a loaded 2-core box (bounds, not goals).
SLOWEST_RATE = 4e6
PARTS = ("gather", "stage", "save_layer", "transport", "scatter", "path")
BASELINES = ("copy_via_host", "d2h", "h2d", "copy_via_pinned")
DEFAULT_BLOCKS = (1, 16, 128)
QUICK = {"layers": 2, "heads": 2, "head_dim": 16, "block_size": 16, "blocks": [1, 3], "repeats": 2}
FORMATS = {
    "BHNC": CacheFormat.BHNC,
    "BHNC_CPU": CacheFormat.BHNC_CPU,
    "NHD": CacheFormat.NHD,
    "HND": CacheFormat.HND,
}


class CheckError(RuntimeError):
    """A failure that ends the check with a message instead of a traceback."""


# ---- what both sides share: the model, the caches, the request ----------------------------


@dataclass(frozen=True)
class Model:
    """One rank's KV geometry, and how its caches are laid out in this check."""

    layers: int
    heads: int  # KV heads of the rank
    head_dim: int
    block_size: int
    cache_blocks: int  # blocks in each layer's cache (more than a request uses)
    cache_format: str  # a key of FORMATS
    device: str

    @property
    def format(self) -> CacheFormat:
        return FORMATS[self.cache_format]

    @property
    def block_axis(self) -> int:
        """The cache tensor's axis that numbers blocks (NHD/HND lead with K/V)."""
        return 1 if self.format in (CacheFormat.NHD, CacheFormat.HND) else 0

    def cache_shape(self) -> tuple[int, ...]:
        blocks, heads, size, dim = self.cache_blocks, self.heads, self.block_size, self.head_dim
        if self.format is CacheFormat.NHD:
            return (2, blocks, size, heads, dim)
        if self.format is CacheFormat.HND:
            return (2, blocks, heads, size, dim)
        return (blocks, heads, size, 2 * dim)

    def block_shape(self) -> tuple[int, ...]:
        shape = list(self.cache_shape())
        del shape[self.block_axis]
        return tuple(shape)

    def bytes_per_block(self, dtype: str) -> int:
        """One block of KV (K and V) over all layers."""
        item = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        return self.layers * 2 * self.block_size * self.heads * self.head_dim * item

    def kv_geometry(self, dtype: str) -> KvGeometry:
        layout = KvLayout.NHD if self.format is CacheFormat.NHD else KvLayout.HND
        return KvGeometry(
            1, self.block_size, self.layers, self.heads, self.head_dim, dtype, False, layout
        )


def layer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


def block_bytes(seed: int, layer: int, block: int, model: Model, dtype: str) -> torch.Tensor:
    """The bytes block `block` of layer `layer` starts with on the side seeded `seed`, on the
    host, shaped as the cache's block. Seeded per block, so a check rebuilds only what it reads.
    Random bytes, some NaN as floats: the path only moves them, and they are compared as bytes.
    """
    torch_dtype = getattr(torch, dtype)
    shape = model.block_shape()
    size = torch.empty(shape, dtype=torch_dtype).nbytes
    generator = torch.Generator().manual_seed((seed << 40) | (layer << 20) | block)
    raw = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
    return raw.view(torch_dtype).view(shape)


def filled_caches(seed: int, model: Model, dtype: str) -> dict[str, torch.Tensor]:
    """Every layer's cache on the model's device, each block holding `block_bytes`."""
    caches = {}
    for layer in range(model.layers):
        host = torch.stack(
            [block_bytes(seed, layer, b, model, dtype) for b in range(model.cache_blocks)],
            dim=model.block_axis,
        )
        caches[layer_name(layer)] = host.to(model.device).contiguous()
    return caches


def shuffled_blocks(count: int, seed: int) -> list[int]:
    """The cache's blocks in a shuffled order, as a long-running cache hands them out."""
    generator = torch.Generator().manual_seed(seed)
    return [int(i) for i in torch.randperm(count, generator=generator)]


def request_key(uid: str, decode_port: int) -> TransferKey:
    """The transfer key of a request the proxy tagged for this prefill and decode."""
    tagged = build_request_id(make_address(LOOPBACK, 1), make_address(LOOPBACK, decode_port), uid)
    key = transfer_key(f"cmpl-{tagged}-0")
    if key is None:
        raise CheckError(f"no transfer key in {tagged!r}")
    return key


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


PREFILL_SEED, DECODE_SEED = 1, 2
PREFILL_ORDER_SEED, DECODE_ORDER_SEED = 11, 22


# ---- the decode rank: the second process ---------------------------------------------------


class TimedBuffer(TransferBuffer):
    """The connector's TransferBuffer, noting when each transfer became whole (receive thread)."""

    def __init__(self, max_bytes: int, ttl: float) -> None:
        super().__init__(max_bytes, ttl)
        self._whole: dict[str, int | str] = {}
        self._changed = threading.Condition()

    def add(self, header: LayerHeader, payload: Payload, now: float) -> Loss | None:
        loss = super().add(header, payload, now)
        transfer = self.partial(header.key)
        if loss is not None or (transfer is not None and transfer.complete):
            with self._changed:
                self._whole.setdefault(header.key, str(loss) if loss else time.monotonic_ns())
                self._changed.notify_all()
        return loss

    def wait(self, key: str, timeout: float) -> int | str | None:
        """When `key` became whole (monotonic ns), how it was lost, or None: not in time."""
        with self._changed:
            self._changed.wait_for(lambda: key in self._whole, timeout=timeout)
            return self._whole.pop(key, None)


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the prefill process dies without stopping this one."""
    with contextlib.suppress(Exception):
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


class DecodeSide:
    """The decode rank's state: one receiver for the whole run, caches per dtype."""

    def __init__(self, model: Model, buffer_bytes: int, wait_s: float) -> None:
        self.model = model
        self.wait_s = wait_s
        self.buffer = TimedBuffer(buffer_bytes, ttl=3600.0)
        self.receiver = TcpReceiver(LOOPBACK, 0, self.buffer)
        self.records: queue.SimpleQueue[TransferRecord] = queue.SimpleQueue()
        self.dtype = ""
        self.caches: list[torch.Tensor] = []
        self.pristine: list[torch.Tensor] = []
        self.block_ids = shuffled_blocks(model.cache_blocks, DECODE_ORDER_SEED)
        self.consumer: ConsumerWorker | None = None

    def setup(self, dtype: str) -> dict[str, Any]:
        self.dtype = dtype
        caches = filled_caches(DECODE_SEED, self.model, dtype)
        self.caches = list(caches.values())
        # What every block held before any transfer: blocks a request must not touch keep it.
        self.pristine = [cache.to("cpu", copy=True) for cache in self.caches]
        consumer = ConsumerWorker(
            0, self.model.block_size, self.model.format, self.wait_s, self.records.put
        )
        consumer.register(caches)
        consumer.attach(self.receiver)
        self.consumer = consumer
        return {"ok": True}

    def receive(self, conn: Connection, uid: str, blocks: int, check: bool) -> dict[str, Any]:
        """Wait for one request's KV, write it into this side's blocks, and say when."""
        assert self.consumer is not None
        model = self.model
        key = request_key(uid, self.receiver.port)
        ids = self.block_ids[:blocks]
        if check:  # what the transfer must overwrite starts as zeros
            for cache in self.caches:
                cache.index_fill_(model.block_axis, torch.tensor(ids, device=cache.device), 0)
            synchronize(model.device)
        spec = LoadSpec("decode-request", key, tuple(ids), 0, blocks * model.block_size)
        self.consumer.start([spec], [])
        conn.send({"ok": True, "ready": True})
        whole = self.buffer.wait(key.key, self.wait_s)
        if not isinstance(whole, int):
            self.consumer.start([], ["decode-request"])
            return {"ok": False, "error": f"transfer not whole: {whole or 'timeout'}"}
        began = time.perf_counter()
        loaded, failed = self.consumer.poll()
        synchronize(model.device)
        done_ns = time.monotonic_ns()
        scatter_s = time.perf_counter() - began
        record = self.records.get(timeout=5)
        reply: dict[str, Any] = {
            "ok": loaded == {"decode-request"} and not failed and record.outcome == "ok",
            "outcome": record.outcome,
            "bytes": record.bytes,
            "whole_ns": whole,
            "done_ns": done_ns,
            "scatter_s": scatter_s,
        }
        if check:
            reply["mismatches"] = self.mismatches(blocks)
        return reply

    def mismatches(self, blocks: int) -> list[str]:
        """Blocks that do not hold what they should, byte for byte (the first few named)."""
        model, axis = self.model, self.model.block_axis
        sources = shuffled_blocks(model.cache_blocks, PREFILL_ORDER_SEED)[:blocks]
        targets = self.block_ids[:blocks]
        others = sorted(set(range(model.cache_blocks)) - set(targets))
        wrong: list[str] = []
        for layer, (cache, pristine) in enumerate(zip(self.caches, self.pristine, strict=True)):
            host = cache.cpu()
            for target, source in zip(targets, sources, strict=True):
                expected = block_bytes(PREFILL_SEED, layer, source, model, self.dtype)
                if not same_bytes(host.select(axis, target), expected):
                    wrong.append(f"layer {layer} block {target} (from prefill block {source})")
            if others:
                index = torch.tensor(others)
                if not same_bytes(
                    host.index_select(axis, index), pristine.index_select(axis, index)
                ):
                    wrong.append(f"layer {layer}: a block outside the request changed")
        return wrong[:10] + ([f"... {len(wrong) - 10} more"] if len(wrong) > 10 else [])


def same_bytes(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Bit for bit (NaNs included, which == would call unequal)."""
    return bool(
        torch.equal(got.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8))
    )


def decode_main(conn: Connection, model: Model, buffer_bytes: int, wait_s: float) -> None:
    """The second process: answers the prefill's commands until told to quit or it is gone."""
    _die_with_parent()
    side = DecodeSide(model, buffer_bytes, wait_s)
    try:
        conn.send({"ok": True, "pid": os.getpid(), "port": side.receiver.port})
        while True:
            try:
                command = conn.recv()
            except EOFError:  # the prefill process is gone
                return
            op = command.pop("op")
            if op == "quit":
                return
            try:
                if op == "setup":
                    conn.send(side.setup(**command))
                elif op == "receive":
                    conn.send(side.receive(conn, **command))
                else:
                    conn.send({"ok": False, "error": f"unknown op {op!r}"})
            except (CheckError, ValueError, RuntimeError, queue.Empty) as exc:
                conn.send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        side.receiver.close()


class DecodeProcess:
    """The prefill's handle on the decode process: every wait bounded, stopped by its PID."""

    def __init__(self, model: Model, buffer_bytes: int, wait_s: float) -> None:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: CUDA-safe
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(
            target=decode_main,
            args=(child_conn, model, buffer_bytes, wait_s),
            name="kv-path-decode",
            daemon=True,
        )
        self.process.start()
        child_conn.close()
        self.pid = self.process.pid

    def tell(self, op: str, **fields: Any) -> None:
        try:
            self.conn.send({"op": op, **fields})
        except (BrokenPipeError, OSError):
            raise CheckError(f"the decode process is gone (exit {self.process.exitcode})") from None

    def answer(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not self.conn.poll(min(0.5, max(0.0, deadline - time.monotonic()))):
            if not self.process.is_alive():
                raise CheckError(f"the decode process exited ({self.process.exitcode})")
            if time.monotonic() >= deadline:
                raise CheckError(f"the decode process did not answer within {timeout:g}s")
        try:
            reply: dict[str, Any] = self.conn.recv()
        except EOFError:
            raise CheckError("the decode process closed its end") from None
        if not reply.get("ok"):
            raise CheckError(f"the decode process failed: {reply}")
        return reply

    def stop(self) -> None:
        """Ask it to quit; then SIGTERM, then SIGKILL, by its PID."""
        with contextlib.suppress(CheckError):
            self.tell("quit")
        self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(STOP_TIMEOUT_S)
        self.conn.close()


# ---- the prefill rank: this process ----------------------------------------------------------


class HeldSender:
    """Holds what `save_layer` sends, so gathering and the transport are timed apart."""

    def __init__(self) -> None:
        self.frames: list[tuple[str, LayerHeader, memoryview]] = []

    def send(self, address: str, header: LayerHeader, payload: memoryview) -> bool:
        self.frames.append((address, header, payload))
        return True

    def close(self) -> None:
        self.frames.clear()


@dataclass
class Result:
    """One dtype and size: seconds per part (every request) and the checks' findings."""

    dtype: str
    blocks: int
    bytes: int
    seconds: dict[str, list[float]]
    asked: int  # measured requests asked for; fewer ran when the budget ran out
    checks: int = 0
    mismatches: tuple[str, ...] = ()

    @property
    def bit_exact(self) -> bool:
        return self.checks > 0 and not self.mismatches

    def gb_s(self, part: str) -> float | None:
        samples = self.seconds.get(part)
        if not samples:
            return None
        return self.bytes / statistics.median(samples) / GB

    def summary(self) -> dict[str, Any]:
        rates = {part: self.gb_s(part) for part in (*PARTS, *BASELINES) if self.gb_s(part)}
        path, copy = rates.get("path"), rates.get("copy_via_host")
        return {
            "dtype": self.dtype,
            "blocks": self.blocks,
            "bytes": self.bytes,
            "repeats": len(self.seconds["path"]),
            "repeats_asked": self.asked,
            "bit_exact": self.bit_exact,
            "checks": self.checks,
            "mismatches": list(self.mismatches),
            "gb_s_median": rates,
            "ms_median": {
                part: statistics.median(values) * 1e3
                for part, values in self.seconds.items()
                if values
            },
            "path_to_copy": path / copy if path and copy else None,
        }


class PrefillSide:
    """This process's prefill rank for one dtype: caches, the real worker and sender."""

    def __init__(self, model: Model, dtype: str, decode: DecodeProcess, decode_port: int) -> None:
        self.model = model
        self.dtype = dtype
        self.decode = decode
        self.decode_port = decode_port
        self.caches = filled_caches(PREFILL_SEED, model, dtype)
        self.block_ids = shuffled_blocks(model.cache_blocks, PREFILL_ORDER_SEED)
        self.records: queue.SimpleQueue[TransferRecord] = queue.SimpleQueue()
        self.producer = ProducerWorker(
            0, model.kv_geometry(dtype), model.format, f"{LOOPBACK}:0", self.records.put
        )
        self.producer.register(self.caches)
        queue_bytes = max(
            CONNECTOR_QUEUE_BYTES, 2 * model.cache_blocks * model.bytes_per_block(dtype)
        )
        self.sender = TcpSender(
            self.producer.sent,
            max_queued_bytes=queue_bytes,
            send_timeout=CONNECTOR_SEND_TIMEOUT_S,
        )
        self.held = HeldSender()

    def close(self) -> None:
        self.sender.close()

    def bound(self, size: int) -> float:
        return CONNECTOR_SEND_TIMEOUT_S + size / SLOWEST_RATE

    def spec(self, uid: str, blocks: int) -> SendSpec:
        key = request_key(uid, self.decode_port)
        ids = tuple(self.block_ids[:blocks])
        return SendSpec("prefill-request", key, ids, blocks * self.model.block_size)

    def _expect(self, blocks: int, check: bool) -> str:
        """Have the decode side wait for a new request; its uid."""
        uid = uuid.uuid4().hex
        self.decode.tell("receive", uid=uid, blocks=blocks, check=check)
        self.decode.answer(self.bound(blocks * self.model.bytes_per_block(self.dtype)))
        return uid

    def _finish(self, size: int) -> dict[str, Any]:
        record = self.records.get(timeout=self.bound(size))
        if record.outcome != "ok":
            raise CheckError(f"the prefill side's transfer ended {record.outcome}")
        got = self.decode.answer(self.bound(size))
        if got["bytes"] != size or record.bytes != size:
            raise CheckError(f"{size} bytes expected: sent {record.bytes}, got {got['bytes']}")
        return got

    def parts(self, blocks: int, check: bool) -> tuple[dict[str, float], list[str] | None]:
        """Each part of the path on its own (see the module's docstring)."""
        device, size = self.model.device, blocks * self.model.bytes_per_block(self.dtype)
        uid = self._expect(blocks, check)
        spec = self.spec(uid, blocks)
        names = list(self.caches)
        seconds: dict[str, float] = {}
        synchronize(device)
        began = time.perf_counter()
        wires = [
            gather_kv(self.caches[n], self.model.format, spec.block_ids, spec.num_tokens)
            for n in names
        ]
        synchronize(device)
        seconds["gather"] = time.perf_counter() - began
        began = time.perf_counter()
        staged = [wire_to_bytes(wire) for wire in wires]
        seconds["stage"] = time.perf_counter() - began
        del wires, staged
        self.producer.attach(self.held)
        synchronize(device)
        began = time.perf_counter()
        for name in names:
            self.producer.save_layer(name, self.caches[name], [spec])
        seconds["save_layer"] = time.perf_counter() - began
        frames, self.held.frames = self.held.frames, []
        start_ns = time.monotonic_ns()
        refused = sum(not self.sender.send(*frame) for frame in frames)
        del frames
        if refused:
            raise CheckError(f"the sender refused {refused} frames")
        got = self._finish(size)
        seconds["transport"] = (got["whole_ns"] - start_ns) / 1e9
        seconds["scatter"] = got["scatter_s"]
        return seconds, got.get("mismatches")

    def path(self, blocks: int, check: bool) -> tuple[dict[str, float], list[str] | None]:
        """The whole path as the connector runs it: frames leave while layers are gathered."""
        size = blocks * self.model.bytes_per_block(self.dtype)
        uid = self._expect(blocks, check)
        spec = self.spec(uid, blocks)
        self.producer.attach(self.sender)
        synchronize(self.model.device)
        start_ns = time.monotonic_ns()
        for name, cache in self.caches.items():
            self.producer.save_layer(name, cache, [spec])
        got = self._finish(size)
        return {"path": (got["done_ns"] - start_ns) / 1e9}, got.get("mismatches")


class CopyBaseline:
    """The same bytes copied device -> host -> device with two plain tensor copies, into
    buffers allocated once (warm pages: the best the hardware does, no allocation counted)."""

    def __init__(self, size: int, device: str) -> None:
        self.device = device
        self.source = torch.empty(size, dtype=torch.uint8, device=device).fill_(7)
        self.target = torch.empty(size, dtype=torch.uint8, device=device)
        self.host = torch.empty(size, dtype=torch.uint8)
        cuda = device.startswith("cuda")
        self.pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True) if cuda else None

    def once(self) -> dict[str, float]:
        synchronize(self.device)
        began = time.perf_counter()
        self.host.copy_(self.source)
        synchronize(self.device)
        middle = time.perf_counter()
        self.target.copy_(self.host)
        synchronize(self.device)
        ended = time.perf_counter()
        seconds = {"copy_via_host": ended - began, "d2h": middle - began, "h2d": ended - middle}
        if self.pinned is not None:
            began = time.perf_counter()
            self.pinned.copy_(self.source)
            self.target.copy_(self.pinned)
            synchronize(self.device)
            seconds["copy_via_pinned"] = time.perf_counter() - began
        return seconds


# ---- the run --------------------------------------------------------------------------------


def measure(prefill: PrefillSide, blocks: int, repeats: int, deadline: float) -> Result:
    """`repeats` measured requests, fewer when `deadline` (monotonic) passes: at least one."""
    size = blocks * prefill.model.bytes_per_block(prefill.dtype)
    result = Result(prefill.dtype, blocks, size, {p: [] for p in (*PARTS, *BASELINES)}, repeats)
    found: list[str] = []

    def keep(seconds: dict[str, float], mismatches: list[str] | None, counted: bool) -> None:
        if mismatches is not None:
            result.checks += 1
            found.extend(mismatches)
        if counted:
            for part, value in seconds.items():
                result.seconds[part].append(value)

    # Warm-up (not counted): checked, and it fills the receive pool and the device caches.
    keep(*prefill.parts(blocks, check=True), counted=False)
    keep(*prefill.path(blocks, check=True), counted=False)
    baseline = CopyBaseline(size, prefill.model.device)
    baseline.once()
    for repeat in range(repeats):
        keep(*prefill.parts(blocks, check=False), counted=True)
        last = repeat == repeats - 1 or time.monotonic() > deadline
        keep(*prefill.path(blocks, check=last), counted=True)  # the last one is checked
        keep(baseline.once(), None, counted=True)
        if last:
            break
    result.mismatches = tuple(found)
    return result


@dataclass(frozen=True)
class Plan:
    model: Model
    dtypes: tuple[str, ...]
    blocks: tuple[int, ...]
    repeats: int
    budget_s: float


def run(plan: Plan, progress: Callable[[str], None]) -> dict[str, Any]:
    model = plan.model
    started = time.monotonic()
    largest = max(plan.blocks) * max(model.bytes_per_block(d) for d in plan.dtypes)
    buffer_bytes = max(CONNECTOR_BUFFER_BYTES, 2 * largest)
    results: list[Result] = []
    skipped: list[dict[str, Any]] = []
    decode = DecodeProcess(
        model, buffer_bytes, wait_s=CONNECTOR_SEND_TIMEOUT_S + largest / SLOWEST_RATE
    )
    try:
        hello = decode.answer(START_TIMEOUT_S)
        progress(f"decode process pid {hello['pid']}, KV port {hello['port']} on {LOOPBACK}")
        for dtype in plan.dtypes:
            if time.monotonic() - started > plan.budget_s:
                skipped.extend({"dtype": dtype, "blocks": b} for b in plan.blocks)
                continue
            decode.tell("setup", dtype=dtype)
            prefill = PrefillSide(model, dtype, decode, hello["port"])
            try:
                decode.answer(SETUP_TIMEOUT_S)
                for blocks in plan.blocks:
                    if time.monotonic() - started > plan.budget_s:
                        skipped.append({"dtype": dtype, "blocks": blocks})
                        continue
                    result = measure(prefill, blocks, plan.repeats, started + plan.budget_s)
                    results.append(result)
                    progress(row_line(result.summary()))
            finally:
                prefill.close()
    finally:
        decode.stop()
    return {
        "results": [r.summary() for r in results],
        "skipped": skipped,
        "elapsed_s": time.monotonic() - started,
        "decode_pid": hello["pid"],
    }


def device_meta(device: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"device": device, "torch": torch.__version__}
    if device.startswith("cuda"):
        meta["device_name"] = torch.cuda.get_device_name(torch.device(device))
        meta["cuda"] = torch.version.cuda
    else:
        meta["device_name"] = platform.processor() or platform.machine()
    return meta


# ---- output -------------------------------------------------------------------------------


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


def row_line(row: dict[str, Any]) -> str:
    rates = row["gb_s_median"]
    parts = ", ".join(f"{part} {_rate(rates.get(part))}" for part in TABLE_PARTS[1:])
    return (
        f"  {row['dtype']:>8} {row['blocks']:>5} blocks: path {_rate(rates.get('path'))} GB/s "
        f"({parts}), copy via host {_rate(rates.get('copy_via_host'))} GB/s; "
        f"{row['repeats']}/{row['repeats_asked']} requests; "
        f"bit-exact {'yes' if row['bit_exact'] else 'NO'}"
    )


TABLE_PARTS = ("path", "gather", "stage", "save_layer", "transport", "scatter")


def size_text(size: int) -> str:
    return f"{size / MIB:,.1f} MiB" if size >= MIB else f"{size / 1024:,.1f} KiB"


def table(rows: Sequence[dict[str, Any]], cuda: bool) -> str:
    """GB/s of each part and baseline (medians), the path's time, and the check's finding."""
    baselines = ("copy_via_host", "d2h", "h2d", *(("copy_via_pinned",) if cuda else ()))
    names = [*TABLE_PARTS, *baselines]
    header = (
        "| dtype | blocks | size | path ms | "
        + " | ".join(names)
        + " | path / copy_via_host | bit-exact |"
    )
    lines = [header, "| --- " + "| ---: " * (len(names) + 4) + "| --- |"]
    for row in rows:
        rates = row["gb_s_median"]
        ratio = row["path_to_copy"]
        lines.append(
            f"| {row['dtype']} | {row['blocks']:,} | {size_text(row['bytes'])} "
            f"| {row['ms_median']['path']:,.2f} | "
            + " | ".join(_rate(rates.get(name)) for name in names)
            + f" | {'-' if ratio is None else f'{ratio:.0%}'} | "
            + ("yes" if row["bit_exact"] else f"**NO**: {'; '.join(row['mismatches'][:3])}")
            + " |"
        )
    return "\n".join(lines)


# ---- command line -------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="pdproxy's KV connector path (gather, stage, TCP, scatter) between two "
        "processes, on CUDA when available: bit-for-bit check and GB/s against a plain copy."
    )
    add = parser.add_argument
    add("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    add("--blocks", type=positive_ints, default=None, help="KV blocks per request: 1,16,128")
    add("--layers", type=positive_int, default=None, help="attention layers (default 32)")
    add("--heads", type=positive_int, default=None, help="KV heads of the rank (default 8)")
    add("--head-dim", type=positive_int, default=None, help="default 128")
    add("--block-size", type=positive_int, default=None, help="tokens per block (default 16)")
    add("--dtypes", default="float16,bfloat16", help="comma-separated (default float16,bfloat16)")
    add(
        "--cache-format",
        choices=["auto", *FORMATS],
        default="auto",
        help="auto: BHNC on CUDA, BHNC_CPU on CPU (what the connector picks)",
    )
    add("--repeats", type=positive_int, default=None, help="measured requests per size (10)")
    add(
        "--budget-s",
        type=float,
        default=420.0,
        help="sizes not started within this many seconds are skipped (default 420)",
    )
    add("--quick", action="store_true", help="a tiny model and sizes, for tests (seconds)")
    add("--json", default=None, metavar="PATH", help="also write every figure here")
    return parser.parse_args(argv)


def plan_of(args: argparse.Namespace) -> Plan:
    quick: dict[str, Any] = QUICK if args.quick else {}

    def pick(name: str, default: Any) -> Any:
        value = getattr(args, name)
        return value if value is not None else quick.get(name, default)

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise CheckError("--device cuda, but torch sees no CUDA device")
    cache_format = args.cache_format
    if cache_format == "auto":
        cache_format = "BHNC" if device.startswith("cuda") else "BHNC_CPU"
    dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
    for dtype in dtypes:
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise CheckError(f"--dtypes: {dtype!r} is not a torch dtype")
    blocks = tuple(pick("blocks", DEFAULT_BLOCKS))
    model = Model(
        layers=pick("layers", 32),
        heads=pick("heads", 8),
        head_dim=pick("head_dim", 128),
        block_size=pick("block_size", 16),
        cache_blocks=2 * max(blocks),  # the request's blocks lie among others it must not touch
        cache_format=cache_format,
        device=device,
    )
    return Plan(model, dtypes, blocks, pick("repeats", 10), args.budget_s)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = run_unwound(lambda: plan_of(args), (CheckError,))
    model = plan.model
    meta: dict[str, Any] = {
        "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        **device_meta(model.device),
        "model": asdict(model),
        "bytes_per_block": {d: model.bytes_per_block(d) for d in plan.dtypes},
        "dtypes": list(plan.dtypes),
        "repeats": plan.repeats,
        "quick": args.quick,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "loadavg_before": os.getloadavg(),
        "command": [sys.executable, *sys.argv],
    }
    print(
        f"pdproxy KV path on {meta['device']} ({meta['device_name']}), torch {meta['torch']}; "
        f"{model.layers} layers x {model.heads} KV heads x head_dim {model.head_dim}, blocks of "
        f"{model.block_size} tokens, cache format {model.cache_format}; "
        f"{plan.repeats} requests per size",
        flush=True,
    )
    report = run_unwound(
        lambda: run(plan, lambda line: print(line, flush=True)),
        (CheckError, TimeoutError, OSError, queue.Empty),
    )
    meta["loadavg_after"] = os.getloadavg()
    report = {"meta": meta, **report}
    report["bit_exact"] = bool(report["results"]) and all(r["bit_exact"] for r in report["results"])
    print()
    print(table(report["results"], model.device.startswith("cuda")))
    print(
        "\nGB/s = 10^9 bytes of KV (all layers) per second, medians of the measured requests; "
        "path = the first save_layer until the decode cache is written (pipelined, two processes, "
        "TCP on 127.0.0.1); copy_via_host = the same bytes device -> pageable host -> device "
        "(d2h and h2d its two hops; copy_via_pinned through pinned memory)."
    )
    if report["skipped"]:
        print(f"skipped (over --budget-s): {report['skipped']}")
    print(
        f"bit-exact: {'yes' if report['bit_exact'] else 'NO'}; {report['elapsed_s']:.1f}s; "
        f"load average {meta['loadavg_before'][0]:.2f} before, {meta['loadavg_after'][0]:.2f} "
        f"after ({meta['cpu_count']} CPUs, {meta['torch_threads']} torch threads, "
        f"OMP_WAIT_POLICY={meta['omp_wait_policy'] or 'unset'})"
    )
    if args.json:
        write_json_report(args.json, report)
    return 0 if report["bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
