"""The plain-TCP KV transport (`kv_tcp`) over real loopback sockets: frames arrive whole and in
place, receive memory is reused, every cap and every wait holds, and peers that misbehave cost
only their own connection."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pdproxy.demo.processes import free_port, free_port_run, wait_until
from pdproxy.pairing.geometry import KvGeometry, KvLayout
from pdproxy.vllm_side.kv import CacheFormat, gather_kv, scatter_kv, wire_from_bytes
from pdproxy.vllm_side.kv_buffer import Loss, Transfer, TransferBuffer
from pdproxy.vllm_side.kv_keys import transfer_key
from pdproxy.vllm_side.kv_schedule import LoadSpec, SendSpec
from pdproxy.vllm_side.kv_tcp import TcpReceiver, TcpSender
from pdproxy.vllm_side.kv_wire import LayerHeader, frame_prefix
from pdproxy.vllm_side.kv_worker import ConsumerWorker, ProducerWorker, TransferRecord
from tests.integration import test_kv_transfer_tp as tp
from tests.integration.kv_support import random_caches
from tests.integration.support import closed_by_peer

MIB = 1 << 20
LOCAL = "127.0.0.1"


def header(key: str, layer: int = 0, layers: int = 1, tokens: int = 4) -> LayerHeader:
    """One layer of `tokens` tokens: 2 x tokens x 1 head x 128 float32 = tokens KiB."""
    return LayerHeader(key, layer, layers, 0, 1, (2, tokens, 1, 128), "float32", (0, 1), "p:1")


def payload_for(h: LayerHeader, seed: int = 0) -> memoryview:
    data = bytearray(h.payload_bytes)
    pattern = bytes((seed + i) % 251 for i in range(251))
    for at in range(0, len(data), len(pattern)):
        data[at : at + len(pattern)] = pattern[: len(data) - at]
    return memoryview(data)


def raw_frame(h: LayerHeader, payload: bytes | memoryview) -> bytes:
    encoded = h.encode()
    return frame_prefix(len(encoded), len(payload)) + encoded + bytes(payload)


class Outcomes:
    def __init__(self) -> None:
        self.sent: list[tuple[str, int, bool]] = []
        self.lock = threading.Lock()

    def __call__(self, h: LayerHeader, ok: bool) -> None:
        with self.lock:
            self.sent.append((h.key, h.layer, ok))

    def results(self) -> list[bool]:
        with self.lock:
            return [ok for _, _, ok in self.sent]


class Link:
    """A sender and a receiver on a free loopback port."""

    def __init__(self, max_bytes: int = 256 * MIB, ttl: float = 30.0, **receiver: Any) -> None:
        self.port = free_port()
        self.address = f"{LOCAL}:{self.port}"
        self.buffer = TransferBuffer(max_bytes, ttl)
        self.receiver = TcpReceiver(LOCAL, self.port, self.buffer, **receiver)
        self.outcomes = Outcomes()
        self.sender = TcpSender(self.outcomes, max_queued_bytes=512 * MIB, send_timeout=2.0)

    def send(self, h: LayerHeader, payload: memoryview) -> None:
        assert self.sender.send(self.address, h, payload)

    def arrived(self, key: str, timeout: float = 10.0) -> Transfer:
        found: list[Transfer] = []

        def whole() -> bool:
            got = self.receiver.take(key)
            if isinstance(got, Transfer):
                found.append(got)
            assert not isinstance(got, Loss), got
            return bool(found)

        wait_until(whole, timeout, f"transfer {key}")
        return found[0]

    def loss(self, key: str, timeout: float = 10.0) -> Loss:
        wait_until(lambda: isinstance(self.receiver.take(key), Loss), timeout, f"loss of {key}")
        got = self.receiver.take(key)
        assert isinstance(got, Loss)
        return got

    def raw(self) -> socket.socket:
        sock = socket.create_connection((LOCAL, self.port), timeout=5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


@pytest.fixture
def link() -> Iterator[Link]:
    made = Link()
    try:
        yield made
    finally:
        made.close()


# -- frames arrive whole, in place -----------------------------------------------------------


@pytest.mark.parametrize("tokens", [0, 1, 63, 64, 300, 4096])
def test_frames_of_every_size_arrive_whole(link: Link, tokens: int) -> None:
    key = f"size-{tokens}"
    frames = [
        (header(key, layer, 3, tokens), payload_for(header(key, 0, 3, tokens), layer))
        for layer in range(3)
    ]
    for h, payload in frames:
        link.send(h, payload)
    transfer = link.arrived(key)
    assert transfer.size == sum(p.nbytes for _, p in frames)
    for h, payload in frames:
        got_header, got = transfer.frames[(h.layer, 0)]
        assert got_header == h and bytes(got) == bytes(payload)
        assert not memoryview(got).readonly  # wire_from_bytes uses it in place
    wait_until(lambda: link.outcomes.results() == [True] * 3, 5, "sent callbacks")


def test_many_transfers_interleaved_over_one_connection(link: Link) -> None:
    keys = [f"many-{i}" for i in range(20)]
    for layer in range(4):
        for i, key in enumerate(keys):
            h = header(key, layer, 4, tokens=8 * (i + 1))
            link.send(h, payload_for(h, i + layer))
    for i, key in enumerate(keys):
        transfer = link.arrived(key)
        for layer in range(4):
            h = header(key, layer, 4, tokens=8 * (i + 1))
            assert bytes(transfer.frames[(layer, 0)][1]) == bytes(payload_for(h, i + layer))


def test_two_senders_to_one_receiver(link: Link) -> None:
    other = TcpSender(link.outcomes, max_queued_bytes=64 * MIB, send_timeout=2.0)
    try:
        for layer in range(2):
            h = header("two", layer, 2, tokens=1024)
            (link.sender if layer else other).send(link.address, h, payload_for(h, layer))
        transfer = link.arrived("two")
        assert transfer.complete and transfer.size == 2 * 1024 * 1024
    finally:
        other.close()


# -- receive memory is reused and bounded ----------------------------------------------------


def test_receive_memory_is_reused_once_the_transfer_is_dropped(link: Link) -> None:
    for round_ in range(3):
        key = f"reuse-{round_}"
        for layer in range(4):
            h = header(key, layer, 4, tokens=1024)  # 1 MiB: pooled
            link.send(h, payload_for(h, layer))
        transfer = link.arrived(key)
        tensors = [wire_from_bytes(p, h.shape, torch.float32) for h, p in transfer.frames.values()]
        assert all(t.shape == (2, 1024, 1, 128) for t in tensors)
        del transfer, tensors  # scattered: nothing refers to the memory any more
    stats = link.receiver.pool_stats()
    assert stats.mapped == 4 and stats.reused == 8 and stats.unpooled == 0
    assert stats.total_bytes == 4 * MIB


def test_memory_still_held_is_not_reused(link: Link) -> None:
    h = header("held", 0, 1, tokens=1024)
    link.send(h, payload_for(h, 1))
    kept = link.arrived("held")
    h2 = header("next", 0, 1, tokens=1024)
    link.send(h2, payload_for(h2, 2))
    fresh = link.arrived("next")
    assert bytes(kept.frames[(0, 0)][1]) == bytes(payload_for(h, 1))  # not overwritten
    assert bytes(fresh.frames[(0, 0)][1]) == bytes(payload_for(h2, 2))
    assert link.receiver.pool_stats().mapped == 2


def test_an_expired_transfer_gives_its_memory_back() -> None:
    link = Link(ttl=0.3)
    try:
        h = header("late", 0, 2, tokens=1024)
        link.send(h, payload_for(h))
        wait_until(lambda: link.receiver.partial("late")[0] == 1, 5, "one frame buffered")
        assert link.loss("late") is Loss.EXPIRED
        wait_until(lambda: link.receiver.pool_stats().lent == 0, 5, "the buffer back in the pool")
        assert link.buffer.size == 0
    finally:
        link.close()


def test_a_frame_larger_than_the_cap_is_refused_and_never_allocated() -> None:
    link = Link(max_bytes=2 * MIB)
    try:
        big = header("big", 0, 1, tokens=4096)  # 4 MiB
        link.send(big, payload_for(big))
        assert link.loss("big") is Loss.OVER_CAPACITY
        small = header("small", 0, 1, tokens=512)
        link.send(small, payload_for(small, 3))  # the same connection is still in step
        assert bytes(link.arrived("small").frames[(0, 0)][1]) == bytes(payload_for(small, 3))
        assert link.receiver.pool_stats().mapped == 1  # only the small one's
        wait_until(lambda: link.outcomes.results() == [True, True], 5, "both sent")
    finally:
        link.close()


def test_a_full_buffer_refuses_new_transfers_and_counts_what_is_being_received() -> None:
    link = Link(max_bytes=3 * MIB)
    try:
        first = header("first", 0, 2, tokens=1024)
        link.send(first, payload_for(first))
        wait_until(lambda: link.buffer.size == MIB, 5, "first frame buffered")
        # A second connection starts a 1 MiB frame and holds back its last byte: reserved.
        slow = link.raw()
        part = raw_frame(
            header("slow", 0, 1, tokens=1024), payload_for(header("slow", tokens=1024))
        )
        slow.sendall(part[:-1])
        time.sleep(0.3)
        # 1 MiB buffered + 1 MiB being received + 2 MiB more would be 4 MiB > 3 MiB.
        wide = header("wide", 0, 1, tokens=2048)
        link.send(wide, payload_for(wide))
        assert link.loss("wide") is Loss.OVER_CAPACITY
        slow.sendall(part[-1:])
        assert link.arrived("slow").size == MIB
        assert link.buffer.size == MIB  # "first" is still waiting for its second layer
        slow.close()
    finally:
        link.close()


# -- peers that misbehave --------------------------------------------------------------------


def test_a_peer_that_is_not_pdproxy_is_disconnected(link: Link) -> None:
    stranger = link.raw()
    stranger.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert closed_by_peer(stranger)
    stranger.close()
    h = header("after", 0, 1, tokens=8)
    link.send(h, payload_for(h))
    assert link.arrived("after").complete


def test_a_bad_header_costs_only_its_frame(link: Link) -> None:
    peer = link.raw()
    junk_header = b"\x92\x01\x02"  # msgpack, but not a header
    peer.sendall(frame_prefix(len(junk_header), 5) + junk_header + b"12345")
    good = header("good", 0, 1, tokens=8)
    peer.sendall(raw_frame(good, payload_for(good, 7)))
    assert bytes(link.arrived("good").frames[(0, 0)][1]) == bytes(payload_for(good, 7))
    peer.close()


def test_a_header_that_disagrees_with_its_payload_length_loses_the_transfer(link: Link) -> None:
    peer = link.raw()
    h = header("liar", 0, 1, tokens=8)
    encoded = h.encode()
    peer.sendall(frame_prefix(len(encoded), 100) + encoded + bytes(100))
    assert link.loss("liar") is Loss.INCONSISTENT
    good = header("fine", 0, 1, tokens=8)
    peer.sendall(raw_frame(good, payload_for(good)))
    assert link.arrived("fine").complete
    peer.close()


@pytest.mark.parametrize("cut", ["prefix", "header", "payload"])
def test_a_peer_that_closes_mid_frame_leaves_nothing_behind(link: Link, cut: str) -> None:
    h = header("cut", 0, 1, tokens=2048)  # 2 MiB: pooled
    frame = raw_frame(h, payload_for(h))
    at = {"prefix": 7, "header": 20, "payload": len(frame) // 2}[cut]
    peer = link.raw()
    peer.sendall(frame[:at])
    time.sleep(0.2)
    peer.close()
    wait_until(lambda: link.receiver.pool_stats().lent == 0, 5, "memory back")
    assert link.receiver.partial("cut") == (0, 0) and link.buffer.size == 0
    again = header("again", 0, 1, tokens=2048)
    link.send(again, payload_for(again))
    assert link.arrived("again").complete
    # The interrupted frame's reservation was given back: a full-cap transfer still fits.
    assert link.receiver.pool_stats().mapped == 1


def test_a_connection_that_stalls_mid_frame_is_closed() -> None:
    link = Link(stall_timeout=0.3)
    try:
        peer = link.raw()
        h = header("stall", 0, 1, tokens=64)
        peer.sendall(raw_frame(h, payload_for(h))[:100])
        started = time.monotonic()
        assert closed_by_peer(peer)
        assert 0.3 <= time.monotonic() - started < 3
        peer.close()
        idle = link.raw()  # a connection between frames may stay open
        assert not closed_by_peer(idle, timeout=0.6)
        idle.close()
    finally:
        link.close()


def test_connections_past_the_limit_are_refused() -> None:
    link = Link(max_connections=1)
    try:
        first = link.raw()
        h = header("one", 0, 1, tokens=8)
        first.sendall(raw_frame(h, payload_for(h)))
        assert link.arrived("one").complete
        second = link.raw()
        assert closed_by_peer(second)
        first.close()
        second.close()
    finally:
        link.close()


# -- every wait is bounded -------------------------------------------------------------------


def test_a_destination_nobody_listens_on_fails_within_the_send_timeout() -> None:
    outcomes = Outcomes()
    sender = TcpSender(outcomes, max_queued_bytes=64 * MIB, send_timeout=0.5)
    try:
        address = f"{LOCAL}:{free_port()}"
        started = time.monotonic()
        first = header("nowhere", 0, 4)
        assert sender.send(address, first, payload_for(first))
        wait_until(lambda: outcomes.results() == [False], 5, "the first frame to fail")
        assert 0.5 <= time.monotonic() - started < 1.5
        # The rest of that transfer fails at once: one timeout per transfer, not per frame.
        started = time.monotonic()
        for layer in range(1, 4):
            h = header("nowhere", layer, 4)
            assert sender.send(address, h, payload_for(h))
        wait_until(lambda: len(outcomes.results()) == 4, 5, "all frames reported")
        assert outcomes.results() == [False] * 4 and time.monotonic() - started < 0.3
        # Another transfer to the same place gets its own chance.
        started = time.monotonic()
        other = header("other", 0, 1)
        assert sender.send(address, other, payload_for(other))
        wait_until(lambda: len(outcomes.results()) == 5, 5, "the other transfer reported")
        assert time.monotonic() - started >= 0.5
    finally:
        sender.close()


def test_a_receiver_that_stops_reading_fails_the_send_within_the_timeout() -> None:
    with socket.create_server((LOCAL, 0)) as server:
        server.settimeout(5)
        outcomes = Outcomes()
        sender = TcpSender(outcomes, max_queued_bytes=512 * MIB, send_timeout=0.5)
        try:
            h = header("stuck", 0, 1, tokens=64 * 1024)  # 64 MiB: more than any socket buffer
            started = time.monotonic()
            assert sender.send(f"{LOCAL}:{server.getsockname()[1]}", h, payload_for(h))
            conn, _ = server.accept()
            wait_until(lambda: outcomes.results() == [False], 5, "the send to fail")
            assert time.monotonic() - started < 2.5
            conn.close()
        finally:
            sender.close()


def test_close_interrupts_a_blocked_send_and_fails_what_is_queued() -> None:
    with socket.create_server((LOCAL, 0)) as server:
        outcomes = Outcomes()
        sender = TcpSender(outcomes, max_queued_bytes=512 * MIB, send_timeout=30.0)
        address = f"{LOCAL}:{server.getsockname()[1]}"
        for layer in range(3):
            h = header("closing", layer, 3, tokens=32 * 1024)  # 32 MiB each, never read
            assert sender.send(address, h, payload_for(h))
        time.sleep(0.3)
        started = time.monotonic()
        sender.close()
        assert time.monotonic() - started < 2
        assert outcomes.results() == [False] * 3
        assert not sender.send(address, header("late"), payload_for(header("late")))


def test_the_send_queue_is_capped_in_bytes() -> None:
    with socket.create_server((LOCAL, 0)) as server:
        outcomes = Outcomes()
        sender = TcpSender(outcomes, max_queued_bytes=3 * MIB, send_timeout=5.0, delay=5.0)
        address = f"{LOCAL}:{server.getsockname()[1]}"
        h = header("queue", 0, 4, tokens=1024)  # 1 MiB
        assert [sender.send(address, h, payload_for(h)) for _ in range(4)] == [True] * 3 + [False]
        sender.close()


def test_the_sender_reconnects_to_a_restarted_receiver() -> None:
    port = free_port()
    outcomes = Outcomes()
    sender = TcpSender(outcomes, max_queued_bytes=64 * MIB, send_timeout=2.0)
    address = f"{LOCAL}:{port}"
    try:
        for attempt in range(2):
            receiver = TcpReceiver(LOCAL, port, TransferBuffer(64 * MIB, 30.0))
            try:
                key = f"restart-{attempt}"
                h = header(key, 0, 1, tokens=64)
                assert sender.send(address, h, payload_for(h))
                wait_until(lambda: isinstance(receiver.take(key), Transfer), 5, key)  # noqa: B023
            finally:
                receiver.close()
        assert outcomes.results() == [True, True]
    finally:
        sender.close()


def test_closing_the_receiver_frees_its_port_and_stops_its_thread() -> None:
    port = free_port()
    before = set(threading.enumerate())
    receiver = TcpReceiver(LOCAL, port, TransferBuffer(MIB, 30.0))
    (thread,) = set(threading.enumerate()) - before
    peer = socket.create_connection((LOCAL, port), timeout=5)
    started = time.monotonic()
    receiver.close()
    assert time.monotonic() - started < 1.5
    assert closed_by_peer(peer)
    peer.close()
    assert not thread.is_alive()
    TcpReceiver(LOCAL, port, TransferBuffer(MIB, 30.0)).close()  # bindable again


# -- the connector's workers over TCP --------------------------------------------------------

LAYERS, HEADS, HEAD_DIM, BLOCK, BLOCKS = 3, 2, 64, 16, 40
GEOMETRY = KvGeometry(1, BLOCK, LAYERS, HEADS, HEAD_DIM, "float32", False, KvLayout.HND)
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def caches(seed: int) -> dict[str, torch.Tensor]:
    return random_caches(NAMES, (BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM), seed)


def load_once(consumer: ConsumerWorker, request: str) -> None:
    done: set[str] = set()

    def finished() -> bool:
        loaded, failed = consumer.poll()
        assert not failed
        done.update(loaded)
        return request in done

    wait_until(finished, 10, "the load")


def test_kv_lands_at_the_decodes_own_blocks_and_the_memory_is_reused() -> None:
    records: list[TransferRecord] = []
    port = free_port()
    prefill_caches, decode_caches = caches(1), caches(2)
    producer = ProducerWorker(0, GEOMETRY, CacheFormat.BHNC_CPU, f"{LOCAL}:1", records.append)
    producer.register(prefill_caches)
    sender = TcpSender(producer.sent, max_queued_bytes=256 * MIB, send_timeout=2.0)
    producer.attach(sender)
    consumer = ConsumerWorker(0, BLOCK, CacheFormat.BHNC_CPU, 5.0, records.append)
    consumer.register(decode_caches)
    receiver = TcpReceiver(LOCAL, port, TransferBuffer(256 * MIB, 30.0))
    consumer.attach(receiver)
    tag = f"___prefill_addr_{LOCAL}:1___decode_addr_{LOCAL}:{port}"
    try:
        blocks = 32  # 32 blocks x 16 tokens x 2 heads x 64 x 2 x 4 bytes = 512 KiB per layer
        prefill_ids = list(range(BLOCKS))[3 : 3 + blocks]
        decode_ids = list(reversed(range(BLOCKS)))[:blocks]
        tokens = blocks * BLOCK
        for round_ in range(3):
            found = transfer_key(f"cmpl-{tag}_{'c' * 31}{round_}-0-12345678")
            assert found is not None
            consumer.start([LoadSpec(f"d-{round_}", found, tuple(decode_ids), 0, tokens)], [])
            spec = SendSpec(f"p-{round_}", found, tuple(prefill_ids), tokens)
            for name in NAMES:
                producer.save_layer(name, prefill_caches[name], [spec])
            load_once(consumer, f"d-{round_}")
            for name in NAMES:
                expected = prefill_caches[name][prefill_ids]
                assert torch.equal(decode_caches[name][decode_ids], expected)
        stats = receiver.pool_stats()
        assert stats.mapped == LAYERS and stats.reused == 2 * LAYERS
        assert [r.outcome for r in records if r.side == "decode"] == ["ok"] * 3
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (2, 4)])
def test_every_decode_rank_gets_its_heads_over_tcp(p_tp: int, d_tp: int) -> None:
    """Fan-in (several prefill ranks into one receiver) and fan-out over TCP; the layout
    checks are the ZMQ test's (`test_kv_transfer_tp`)."""
    heads = 4
    prefill, decode = tp.geometry(p_tp, heads, tp.P_BLOCK), tp.geometry(d_tp, heads, tp.D_BLOCK)
    base = free_port_run(d_tp)
    key = transfer_key(f"cmpl-___prefill_addr_{LOCAL}:1___decode_addr_{LOCAL}:{base}_{'d' * 32}-0")
    assert key is not None
    records: list[TransferRecord] = []
    closers: list[TcpSender | TcpReceiver] = []
    try:
        producers, prefill_caches = [], []
        for rank in range(p_tp):
            producer = ProducerWorker(
                rank, prefill, CacheFormat.BHNC_CPU, f"{LOCAL}:{1 + rank}", records.append
            )
            caches = {
                name: torch.zeros(tp.BLOCKS, prefill.heads_per_rank, tp.P_BLOCK, 2 * tp.HEAD_DIM)
                for name in tp.NAMES
            }
            producer.register(caches)
            sender = TcpSender(producer.sent, max_queued_bytes=64 * MIB, send_timeout=2.0)
            closers.append(sender)
            producer.attach(sender)
            producers.append(producer)
            prefill_caches.append(caches)
        consumers, decode_caches = [], []
        for rank in range(d_tp):
            consumer = ConsumerWorker(rank, tp.D_BLOCK, CacheFormat.NHD, 5.0, records.append)
            shape = (2, tp.BLOCKS, tp.D_BLOCK, decode.heads_per_rank, tp.HEAD_DIM)
            caches = {name: torch.full(shape, -1.0) for name in tp.NAMES}
            consumer.register(caches)
            receiver = TcpReceiver(LOCAL, base + rank, TransferBuffer(64 * MIB, 30.0))
            closers.append(receiver)
            consumer.attach(receiver)
            consumers.append(consumer)
            decode_caches.append(caches)
        fleet = tp.Fleet(
            prefill, decode, key, producers, prefill_caches, consumers, decode_caches, records
        )
        model = tp.reference(heads)
        prefill_blocks, decode_blocks = (7, 2, 9), (4, 0)
        for rank, caches in enumerate(prefill_caches):
            held = prefill.rank_heads(rank)
            for name, layer in zip(tp.NAMES, model, strict=True):
                part = layer[:, :, held.start : held.stop].contiguous()
                scatter_kv(part, caches[name], CacheFormat.BHNC_CPU, prefill_blocks)
        fleet.load(decode_blocks)
        fleet.send(d_tp, prefill_blocks)
        outcomes = fleet.wait()
        assert all(loaded == {"d-req"} and not failed for loaded, failed in outcomes)
        for rank, caches in enumerate(decode_caches):
            held = decode.rank_heads(rank)
            for name, layer in zip(tp.NAMES, model, strict=True):
                got = gather_kv(caches[name], CacheFormat.NHD, decode_blocks, tp.TOKENS)
                assert torch.equal(got, layer[:, :, held.start : held.stop]), (rank, name)
    finally:
        for closer in closers:
            closer.close()
