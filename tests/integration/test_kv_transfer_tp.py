"""pdproxy's KV connector between instances of different TP sizes, without vLLM: every prefill
rank and every decode rank with its own caches and its own transport, over real loopback ZMQ
sockets. Each prefill rank holds its share of a model's heads; after the transfer every decode
rank must hold exactly its own share, at its own block ids, whatever the two TP sizes."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import pytest
import torch

from pdproxy.demo.processes import free_port_run, wait_until
from pdproxy.pairing.geometry import KvGeometry, KvLayout
from pdproxy.vllm_side.kv import CacheFormat, gather_kv, plan_reads, scatter_kv
from pdproxy.vllm_side.kv_buffer import TransferBuffer
from pdproxy.vllm_side.kv_keys import TransferKey, transfer_key
from pdproxy.vllm_side.kv_schedule import LoadSpec, SendSpec
from pdproxy.vllm_side.kv_tcp import TcpReceiver, TcpSender
from pdproxy.vllm_side.kv_worker import ConsumerWorker, ProducerWorker, TransferRecord

LAYERS, HEAD_DIM, BLOCKS = 2, 8, 10
P_BLOCK, D_BLOCK = 16, 32
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
TOKENS = 45


def geometry(tp: int, heads: int, block: int) -> KvGeometry:
    return KvGeometry(tp, block, LAYERS, heads, HEAD_DIM, "float32", False, KvLayout.HND)


def reference(heads: int) -> list[torch.Tensor]:
    """Every layer's KV of the whole model: (kv, tokens, heads, head_dim)."""
    generator = torch.Generator().manual_seed(heads)
    return [torch.randn(2, TOKENS, heads, HEAD_DIM, generator=generator) for _ in NAMES]


@dataclass
class Fleet:
    prefill: KvGeometry
    decode: KvGeometry
    key: TransferKey
    producers: list[ProducerWorker]
    prefill_caches: list[dict[str, torch.Tensor]]
    consumers: list[ConsumerWorker]
    decode_caches: list[dict[str, torch.Tensor]]
    records: list[TransferRecord]

    def send(self, decode_tp: int | None, block_ids: tuple[int, ...]) -> None:
        spec = SendSpec("p-req", self.key, block_ids, TOKENS, decode_tp)
        for producer, caches in zip(self.producers, self.prefill_caches, strict=True):
            for name in NAMES:
                producer.save_layer(name, caches[name], [spec])

    def load(self, block_ids: tuple[int, ...]) -> None:
        for consumer in self.consumers:
            consumer.start([LoadSpec("d-req", self.key, block_ids, 0, TOKENS)], [])

    def wait(self, timeout: float = 10.0) -> list[tuple[set[str], set[str]]]:
        """Each decode rank's (loaded, failed), once every rank has an outcome."""
        outcomes: list[tuple[set[str], set[str]]] = [(set(), set()) for _ in self.consumers]

        def done() -> bool:
            for consumer, (loaded, failed) in zip(self.consumers, outcomes, strict=True):
                got_loaded, got_failed = consumer.poll()
                loaded.update(got_loaded)
                failed.update(got_failed)
            return all(loaded or failed for loaded, failed in outcomes)

        wait_until(done, timeout, "every decode rank to finish its load")
        return outcomes


@pytest.fixture
def fleets() -> Iterator[Callable[..., Fleet]]:
    with ExitStack() as stack:

        def build(p_tp: int, d_tp: int, heads: int, timeout: float = 5.0) -> Fleet:
            prefill, decode = geometry(p_tp, heads, P_BLOCK), geometry(d_tp, heads, D_BLOCK)
            base = free_port_run(d_tp)
            key = transfer_key(
                f"cmpl-___prefill_addr_127.0.0.1:1___decode_addr_127.0.0.1:{base}_{'b' * 32}-0"
            )
            assert key is not None
            records: list[TransferRecord] = []
            producers, prefill_caches = [], []
            for rank in range(p_tp):
                producer = ProducerWorker(
                    rank, prefill, CacheFormat.BHNC_CPU, f"127.0.0.1:{1 + rank}", records.append
                )
                caches = {
                    name: torch.zeros(BLOCKS, prefill.heads_per_rank, P_BLOCK, 2 * HEAD_DIM)
                    for name in NAMES
                }
                producer.register(caches)
                sender = TcpSender(producer.sent, max_queued_bytes=1 << 24, send_timeout=2.0)
                stack.callback(sender.close)
                producer.attach(sender)
                producers.append(producer)
                prefill_caches.append(caches)
            consumers, decode_caches = [], []
            for rank in range(d_tp):
                consumer = ConsumerWorker(rank, D_BLOCK, CacheFormat.NHD, timeout, records.append)
                caches = {
                    name: torch.full((2, BLOCKS, D_BLOCK, decode.heads_per_rank, HEAD_DIM), -1.0)
                    for name in NAMES
                }
                consumer.register(caches)
                receiver = TcpReceiver("127.0.0.1", base + rank, TransferBuffer(1 << 24, 30.0))
                stack.callback(receiver.close)
                consumer.attach(receiver)
                consumers.append(consumer)
                decode_caches.append(caches)
            fleet = Fleet(
                prefill, decode, key, producers, prefill_caches, consumers, decode_caches, records
            )
            return fleet

        yield build


Build = Callable[..., Fleet]

TP_PAIRS = [(p, d) for p, d in itertools.product((1, 2, 4), repeat=2) if max(p, d) % min(p, d) == 0]


@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS)
@pytest.mark.parametrize("heads", [4, 2])
def test_every_decode_rank_gets_exactly_its_heads(
    fleets: Build, p_tp: int, d_tp: int, heads: int
) -> None:
    fleet = fleets(p_tp, d_tp, heads)
    model = reference(heads)
    prefill_blocks, decode_blocks = (7, 2, 9), (4, 0)
    for rank, caches in enumerate(fleet.prefill_caches):
        held = fleet.prefill.rank_heads(rank)
        for name, layer in zip(NAMES, model, strict=True):
            scatter_kv(
                layer[:, :, held.start : held.stop].contiguous(),
                caches[name],
                CacheFormat.BHNC_CPU,
                prefill_blocks,
            )
    fleet.load(decode_blocks)
    fleet.send(d_tp, prefill_blocks)
    outcomes = fleet.wait()
    assert all(loaded == {"d-req"} and not failed for loaded, failed in outcomes)
    for rank, caches in enumerate(fleet.decode_caches):
        held = fleet.decode.rank_heads(rank)
        for name, layer in zip(NAMES, model, strict=True):
            got = gather_kv(caches[name], CacheFormat.NHD, decode_blocks, TOKENS)
            assert torch.equal(got, layer[:, :, held.start : held.stop]), (rank, name)
            # Past the request's tokens the decode's blocks keep what they held.
            assert bool((caches[name][:, 1, TOKENS - D_BLOCK :] == -1).all())
    # Every byte each decode rank needs arrives once (replicated heads are not sent twice).
    received = [r for r in fleet.records if r.side == "decode"]
    per_rank = 2 * LAYERS * TOKENS * fleet.decode.heads_per_rank * HEAD_DIM * 4
    assert sorted(r.rank for r in received) == list(range(d_tp))
    assert all(r.outcome == "ok" and r.bytes == per_rank for r in received)
    # Prefill ranks holding only replicas of heads another rank sends have nothing to send.
    senders = len({read.prefill_rank for read in plan_reads(fleet.prefill, fleet.decode)})
    assert senders == (min(p_tp, heads) if p_tp > d_tp else p_tp)
    wait_until(
        lambda: len([r for r in fleet.records if r.side == "prefill"]) == senders, 5, "send records"
    )
    sent = sum(r.bytes for r in fleet.records if r.side == "prefill")
    assert sent == d_tp * per_rank


def test_a_decode_tp_the_prefill_cannot_serve_fails_the_load_not_the_prefill(
    fleets: Build,
) -> None:
    # The proxy never pairs these; a forged or stale size must still fail cleanly: nothing is
    # sent, the prefill records the error once, the decode times out.
    fleet = fleets(2, 1, 4, timeout=0.5)
    fleet.load((0, 1))
    fleet.send(3, (0, 1, 2))
    [(loaded, failed)] = fleet.wait()
    assert failed == {"d-req"} and not loaded
    sent = [r for r in fleet.records if r.side == "prefill"]
    assert [(r.outcome, r.bytes) for r in sent] == [("error", 0), ("error", 0)]


def test_without_a_decode_tp_the_prefill_assumes_its_own(
    fleets: Build,
) -> None:
    fleet = fleets(2, 2, 4)
    fleet.load((0, 1))
    fleet.send(None, (0, 1, 2))
    assert all(loaded == {"d-req"} for loaded, _ in fleet.wait())
