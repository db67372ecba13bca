"""The worker side of pdproxy's KV connector: gather and send on a prefill rank, receive and
scatter on a decode rank. Torch; sockets only through the transport.

A prefill rank gathers each layer of a finished prompt as soon as vLLM wrote it
(`save_kv_layer`) and hands it to the sender thread: the forward pass never waits on the
network. A decode rank writes a transfer into its own blocks once all of it arrived, between
steps (`get_finished`), while vLLM keeps the request waiting; a transfer that does not arrive
within the timeout fails the request (vLLM's kv_load_failure_policy then fails or recomputes
it).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch

from pdproxy.base.roles import Role
from pdproxy.pairing.geometry import KvGeometry
from pdproxy.vllm_side.announcement import TransferOutcome
from pdproxy.vllm_side.kv import (
    CacheFormat,
    HeadRead,
    gather_kv,
    plan_reads,
    scatter_kv,
    wire_from_bytes,
    wire_to_bytes,
)
from pdproxy.vllm_side.kv_buffer import Loss, Transfer
from pdproxy.vllm_side.kv_schedule import LoadSpec, SendSpec
from pdproxy.vllm_side.kv_transport import KvReceiver, KvSender
from pdproxy.vllm_side.kv_wire import LayerHeader

log = logging.getLogger("pdproxy.vllm_side.kv")

_LAYER_NUMBER = re.compile(r"\d+")
_REMEMBERED_REFUSALS = 4096


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """One rank's view of one transfer, for the proxy's statistics and the tests."""

    transfer: str  # TransferKey.stats_id
    side: Role  # PREFILL sent, DECODE received
    rank: int
    peer: str  # the other side's KV address (rank 0)
    bytes: int
    blocks: int
    seconds: float
    outcome: TransferOutcome


Recorder = Callable[[TransferRecord], None]


def layer_order(names: Iterable[str]) -> dict[str, int]:
    """Attention layers by position in the model ("model.layers.10..." after "...9...")."""

    def numbers(name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in _LAYER_NUMBER.findall(name))

    return {name: index for index, name in enumerate(sorted(names, key=lambda n: (numbers(n), n)))}


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass(slots=True)
class _Outgoing:
    spec: SendSpec
    frames_left: int
    bytes: int
    started: float
    failed: bool = False


class ProducerWorker:
    def __init__(
        self,
        rank: int,
        geometry: KvGeometry,
        cache_format: CacheFormat,
        sender_address: str,
        record: Recorder,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._rank = rank
        self._geometry = geometry
        self._format = cache_format
        self._address = sender_address
        self._record = record
        self._clock = clock
        self._layers: dict[str, int] = {}
        # This rank's reads toward a decode of each TP size seen so far, or why there are none.
        self._reads_by_tp: dict[int, list[tuple[HeadRead, int, int]] | str] = {}
        # Transfers with no reads, oldest first: each is logged and recorded once.
        self._refused: dict[str, None] = {}
        self._sender: KvSender | None = None
        self._lock = threading.Lock()
        self._outgoing: dict[str, _Outgoing] = {}

    def attach(self, sender: KvSender) -> None:
        self._sender = sender

    def register(self, caches: dict[str, torch.Tensor]) -> None:
        self._layers = layer_order(caches)

    def reads(self, decode: KvGeometry) -> list[tuple[HeadRead, int, int]]:
        """This rank's reads toward `decode`: (read, its index among its decode rank's reads,
        how many reads that decode rank expects per layer)."""
        plan = plan_reads(self._geometry, decode)
        mine = []
        for read in plan:
            if read.prefill_rank != self._rank:
                continue
            peers = [r for r in plan if r.decode_rank == read.decode_rank]
            mine.append((read, peers.index(read), len(peers)))
        return mine

    def reads_toward(self, decode_tp: int | None) -> list[tuple[HeadRead, int, int]] | str:
        """This rank's reads toward a decode of `decode_tp` ranks (None: this side's own TP),
        or why it cannot send to one. The rest of the decode's geometry is this model's: the
        pairing rules pair only those, and the wire is independent of block size and layout."""
        tp = self._geometry.tp_size if decode_tp is None else decode_tp
        known = self._reads_by_tp.get(tp)
        if known is None:
            try:
                known = self.reads(replace(self._geometry, tp_size=tp))
            except ValueError as exc:
                known = f"cannot send to a decode of tp {tp}: {exc}"
            self._reads_by_tp[tp] = known
        return known

    def save_layer(self, layer_name: str, cache: torch.Tensor, sends: list[SendSpec]) -> None:
        layer = self._layers.get(layer_name)
        if layer is None or not sends or self._sender is None:
            return
        for spec in sends:
            reads = self.reads_toward(spec.decode_tp)
            if isinstance(reads, str):
                self._refuse(spec, reads)
            else:
                self._send_layer(layer, cache, spec, reads)

    def _refuse(self, spec: SendSpec, why: str) -> None:
        """Nothing can be sent: the decode side then fails the request at its timeout."""
        key = spec.key.key
        with self._lock:
            if key in self._refused:
                return
            self._refused[key] = None
            if len(self._refused) > _REMEMBERED_REFUSALS:
                del self._refused[next(iter(self._refused))]
        log.error("pdproxy connector: KV for %s not sent: %s", key, why)
        self._record(
            TransferRecord(
                spec.key.stats_id,
                Role.PREFILL,
                self._rank,
                str(spec.key.decode),
                0,
                0,
                0.0,
                "error",
            )
        )

    def _send_layer(
        self,
        layer: int,
        cache: torch.Tensor,
        spec: SendSpec,
        reads: list[tuple[HeadRead, int, int]],
    ) -> None:
        assert self._sender is not None
        key = spec.key.key
        with self._lock:
            if key not in self._outgoing:
                frames = len(self._layers) * len(reads)
                self._outgoing[key] = _Outgoing(spec, frames, 0, self._clock())
        for read, index, count in reads:
            wire = gather_kv(
                cache, self._format, spec.block_ids, spec.num_tokens, read.prefill_heads
            )
            header = LayerHeader(
                key=key,
                layer=layer,
                layers=len(self._layers),
                read=index,
                reads=count,
                shape=(wire.shape[0], wire.shape[1], wire.shape[2], wire.shape[3]),
                dtype=str(wire.dtype).removeprefix("torch."),
                heads=(read.decode_heads.start, read.decode_heads.stop),
                sender=self._address,
            )
            address = f"{spec.key.decode.host}:{spec.key.decode.port + read.decode_rank}"
            payload = memoryview(wire_to_bytes(wire))
            if not self._sender.send(address, header, payload):
                log.warning("pdproxy connector: send queue full; KV for %s not sent", key)
                self.sent(header, False)

    def sent(self, header: LayerHeader, ok: bool) -> None:
        """The transport's word on one frame (from its thread)."""
        with self._lock:
            outgoing = self._outgoing.get(header.key)
            if outgoing is None:
                return
            outgoing.frames_left -= 1
            outgoing.bytes += header.payload_bytes if ok else 0
            outgoing.failed |= not ok
            if outgoing.frames_left > 0:
                return
            del self._outgoing[header.key]
        spec = outgoing.spec
        self._record(
            TransferRecord(
                spec.key.stats_id,
                Role.PREFILL,
                self._rank,
                str(spec.key.decode),
                outgoing.bytes,
                blocks_for(spec.num_tokens, self._geometry.block_size),
                self._clock() - outgoing.started,
                "error" if outgoing.failed else "ok",
            )
        )


@dataclass(slots=True)
class _Waiting:
    spec: LoadSpec
    since: float


class ConsumerWorker:
    def __init__(
        self,
        rank: int,
        block_size: int,
        cache_format: CacheFormat,
        timeout: float,
        record: Recorder,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._rank = rank
        self._block_size = block_size
        self._format = cache_format
        self._timeout = timeout
        self._record = record
        self._clock = clock
        self._caches: list[torch.Tensor] = []
        self._receiver: KvReceiver | None = None
        self._waiting: dict[str, _Waiting] = {}

    def attach(self, receiver: KvReceiver) -> None:
        self._receiver = receiver

    def register(self, caches: dict[str, torch.Tensor]) -> None:
        order = layer_order(caches)
        self._caches = [caches[name] for name in sorted(order, key=order.__getitem__)]

    def start(self, loads: list[LoadSpec], cancelled: list[str]) -> None:
        for request_id in cancelled:
            waiting = self._waiting.pop(request_id, None)
            if waiting is not None and self._receiver is not None:
                self._receiver.forget(waiting.spec.key.key)
        now = self._clock()
        for spec in loads:
            self._waiting[spec.request_id] = _Waiting(spec, now)

    def poll(self) -> tuple[set[str], set[str]]:
        """(loaded, failed) request ids since the last poll."""
        loaded: set[str] = set()
        failed: set[str] = set()
        if not self._waiting or self._receiver is None:
            return loaded, failed
        now = self._clock()
        for request_id, waiting in list(self._waiting.items()):
            key = waiting.spec.key.key
            got = self._receiver.take(key)
            outcome: TransferOutcome
            if isinstance(got, Transfer):
                outcome = self._write(waiting.spec, got)
            elif isinstance(got, Loss):
                outcome = "dropped"
            elif now - waiting.since >= self._timeout:
                self._receiver.forget(key)
                outcome = "timeout"
            else:
                continue
            del self._waiting[request_id]
            (loaded if outcome == "ok" else failed).add(request_id)
            size = got.size if isinstance(got, Transfer) else 0
            self._finish(waiting, outcome, size, now)
        return loaded, failed

    def _write(self, spec: LoadSpec, transfer: Transfer) -> TransferOutcome:
        if transfer.layers != len(self._caches):
            log.error(
                "pdproxy connector: KV for %s has %d layers, this model %d",
                spec.key.key,
                transfer.layers,
                len(self._caches),
            )
            return "error"
        skip_blocks = spec.skip_tokens // self._block_size
        try:
            for (layer, _), (header, payload) in sorted(transfer.frames.items()):
                wire = wire_from_bytes(payload, header.shape, getattr(torch, header.dtype))
                scatter_kv(
                    wire[:, spec.skip_tokens :],
                    self._caches[layer],
                    self._format,
                    spec.block_ids[skip_blocks:],
                    range(*header.heads),
                )
        except (ValueError, RuntimeError, IndexError) as exc:
            log.error("pdproxy connector: KV for %s does not fit: %s", spec.key.key, exc)
            return "error"
        return "ok"

    def _finish(self, waiting: _Waiting, outcome: TransferOutcome, size: int, now: float) -> None:
        spec = waiting.spec
        if outcome != "ok":
            log.warning(
                "pdproxy connector: no usable KV for %s from %s (%s after %.1fs)",
                spec.request_id,
                spec.key.prefill,
                outcome,
                now - waiting.since,
            )
        self._record(
            TransferRecord(
                spec.key.stats_id,
                Role.DECODE,
                self._rank,
                str(spec.key.prefill),
                size,
                blocks_for(spec.num_tokens - spec.skip_tokens, self._block_size),
                now - waiting.since,
                outcome,
            )
        )
