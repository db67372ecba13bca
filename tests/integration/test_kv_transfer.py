"""pdproxy's KV connector without vLLM: a prefill rank's caches gathered and sent over real
loopback TCP sockets, received and scattered into a decode rank's caches at other block ids."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from pdproxy.demo.processes import free_ports, wait_until
from pdproxy.pairing.geometry import KvGeometry, KvLayout
from pdproxy.vllm_side.kv import CacheFormat
from pdproxy.vllm_side.kv_buffer import TransferBuffer
from pdproxy.vllm_side.kv_keys import transfer_key
from pdproxy.vllm_side.kv_schedule import LoadSpec, SendSpec
from pdproxy.vllm_side.kv_tcp import TcpReceiver, TcpSender
from pdproxy.vllm_side.kv_worker import ConsumerWorker, ProducerWorker, TransferRecord
from tests.integration.kv_support import random_caches

LAYERS, HEADS, HEAD_DIM, BLOCK, BLOCKS = 3, 2, 8, 16, 12
GEOMETRY = KvGeometry(1, BLOCK, LAYERS, HEADS, HEAD_DIM, "float32", False, KvLayout.HND)
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def caches(seed: int) -> dict[str, torch.Tensor]:
    return random_caches(NAMES, (BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM), seed)


def token_kv(cache: torch.Tensor, block_ids: list[int], token: int) -> torch.Tensor:
    """Token `token`'s K and V for every head, read the slow obvious way from the CPU page
    layout (K transposed (head_dim, block) then V (block, head_dim) per block and head)."""
    block, offset = block_ids[token // BLOCK], token % BLOCK
    page = cache[block].reshape(HEADS, -1)
    keys = page[:, : HEAD_DIM * BLOCK].reshape(HEADS, HEAD_DIM, BLOCK)[:, :, offset]
    values = page[:, HEAD_DIM * BLOCK :].reshape(HEADS, BLOCK, HEAD_DIM)[:, offset, :]
    return torch.stack([keys, values])


class Pair:
    def __init__(self, delay: float = 0.0, timeout: float = 5.0) -> None:
        self.records: list[TransferRecord] = []
        port = free_ports(1)[0]
        self.prefill_caches, self.decode_caches = caches(1), caches(2)
        self.decode_before = {n: t.clone() for n, t in self.decode_caches.items()}
        self.producer = ProducerWorker(
            0, GEOMETRY, CacheFormat.BHNC_CPU, "127.0.0.1:1", self.records.append
        )
        self.producer.register(self.prefill_caches)
        self.sender = TcpSender(
            self.producer.sent, max_queued_bytes=1 << 24, send_timeout=2.0, delay=delay
        )
        self.producer.attach(self.sender)
        self.consumer = ConsumerWorker(0, BLOCK, CacheFormat.BHNC_CPU, timeout, self.records.append)
        self.consumer.register(self.decode_caches)
        self.receiver = TcpReceiver("127.0.0.1", port, TransferBuffer(1 << 24, 30.0))
        self.consumer.attach(self.receiver)
        found = transfer_key(
            f"cmpl-___prefill_addr_127.0.0.1:1___decode_addr_127.0.0.1:{port}_{'a' * 32}-0-12345678"
        )
        assert found is not None
        self.key = found

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()

    def send(self, block_ids: list[int], tokens: int) -> None:
        spec = SendSpec("p-req", self.key, tuple(block_ids), tokens)
        for name in NAMES:
            self.producer.save_layer(name, self.prefill_caches[name], [spec])

    def poll_until_done(self, timeout: float = 10.0) -> tuple[set[str], set[str]]:
        loaded: set[str] = set()
        failed: set[str] = set()

        def done() -> bool:
            got_loaded, got_failed = self.consumer.poll()
            loaded.update(got_loaded)
            failed.update(got_failed)
            return bool(loaded or failed)

        wait_until(done, timeout, "the load to finish")
        return loaded, failed


@pytest.fixture
def pair() -> Iterator[Pair]:
    made = Pair()
    try:
        yield made
    finally:
        made.close()


@pytest.mark.parametrize("tokens", [1, 15, 16, 17, 70])
def test_kv_lands_at_the_decodes_own_blocks(pair: Pair, tokens: int) -> None:
    prefill_blocks = [9, 2, 7, 0, 5][: -(-tokens // BLOCK)]
    decode_blocks = [3, 11, 1, 6, 10][: -(-tokens // BLOCK)]
    pair.consumer.start([LoadSpec("d-req", pair.key, tuple(decode_blocks), 0, tokens)], [])
    pair.send(prefill_blocks, tokens)
    loaded, failed = pair.poll_until_done()
    assert loaded == {"d-req"} and failed == set()
    for name in NAMES:
        for token in range(tokens):
            expected = token_kv(pair.prefill_caches[name], prefill_blocks, token)
            got = token_kv(pair.decode_caches[name], decode_blocks, token)
            assert torch.equal(got, expected), (name, token)
        untouched = [b for b in range(BLOCKS) if b not in decode_blocks]
        assert torch.equal(pair.decode_caches[name][untouched], pair.decode_before[name][untouched])
    received = [r for r in pair.records if r.side == "decode"]
    wait_until(lambda: len([r for r in pair.records if r.side == "prefill"]) == 1, 5, "send record")
    sent = [r for r in pair.records if r.side == "prefill"]
    expected_bytes = LAYERS * 2 * tokens * HEADS * HEAD_DIM * 4
    assert sent[0].outcome == "ok" and sent[0].bytes == expected_bytes
    assert received[0].outcome == "ok" and received[0].bytes == expected_bytes
    assert received[0].blocks == len(decode_blocks)


def test_kv_that_arrives_first_waits_for_its_request(pair: Pair) -> None:
    pair.send([4, 8], 20)
    wait_until(lambda: pair.receiver.partial(pair.key.key)[0] == LAYERS, 5, "all layers buffered")
    pair.consumer.start([LoadSpec("d-req", pair.key, (0, 1), 0, 20)], [])
    loaded, _ = pair.poll_until_done()
    assert loaded == {"d-req"}


def test_a_local_prefix_is_not_written_again(pair: Pair) -> None:
    pair.consumer.start([LoadSpec("d-req", pair.key, (3, 4, 5), BLOCK, 40)], [])
    pair.send([0, 1, 2], 40)
    loaded, _ = pair.poll_until_done()
    assert loaded == {"d-req"}
    for name in NAMES:
        assert torch.equal(pair.decode_caches[name][3], pair.decode_before[name][3])
        for token in range(BLOCK, 40):
            expected = token_kv(pair.prefill_caches[name], [0, 1, 2], token)
            assert torch.equal(token_kv(pair.decode_caches[name], [3, 4, 5], token), expected)


def test_kv_that_never_comes_fails_the_load_within_the_timeout() -> None:
    pair = Pair(timeout=0.5)
    try:
        started = time.monotonic()
        pair.consumer.start([LoadSpec("d-req", pair.key, (0,), 0, 10)], [])
        loaded, failed = pair.poll_until_done(timeout=5)
        assert failed == {"d-req"} and not loaded
        assert 0.5 <= time.monotonic() - started < 3
        assert [r.outcome for r in pair.records if r.side == "decode"] == ["timeout"]
    finally:
        pair.close()


def test_a_prefill_that_dies_before_sending_leaves_the_decode_failing_cleanly() -> None:
    pair = Pair(delay=5.0, timeout=0.5)
    try:
        pair.consumer.start([LoadSpec("d-req", pair.key, (0,), 0, 10)], [])
        pair.send([0], 10)
        pair.sender.close()  # the prefill goes away with its frames still held back
        _, failed = pair.poll_until_done(timeout=5)
        assert failed == {"d-req"}
    finally:
        pair.receiver.close()


def test_a_cancelled_load_drops_what_arrives_for_it(pair: Pair) -> None:
    pair.consumer.start([LoadSpec("d-req", pair.key, (0,), 0, 10)], [])
    pair.consumer.start([], ["d-req"])
    pair.send([0], 10)
    time.sleep(0.3)
    assert pair.consumer.poll() == (set(), set())
    assert pair.receiver.partial(pair.key.key) == (0, 0)
    untouched = all(torch.equal(pair.decode_caches[n], pair.decode_before[n]) for n in NAMES)
    assert untouched
