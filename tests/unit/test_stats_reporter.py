"""pdproxy.vllm_side.stats_reporter: never blocks, drops (and counts) when full, batches within the
registry's limits, signs, and every message it sends is one the proxy's decoder accepts."""

from __future__ import annotations

import threading
import time
from typing import Any

import msgpack
import pytest

from pdproxy.base.roles import Role
from pdproxy.registry.auth import RegistryGate, Verifier
from pdproxy.registry.messages import MAX_TRANSFERS, Stats, decode_frame
from pdproxy.vllm_side.announcement import TransferStat
from pdproxy.vllm_side.stats_reporter import MAX_MESSAGE_BYTES, StatsReporter, stats_identity

UID = "0123456789abcdef0123456789abcdef"
HTTP = "10.0.0.2:8200"


class Recorder:
    """A FanOutClient stand-in: keeps the frames it is given, or refuses them."""

    def __init__(self, accept: bool = True) -> None:
        self.frames: list[bytes] = []
        self.accept = accept
        self.closed = False
        self.events: list[str] = []  # "refresh" and "send", in order

    def refresh(self) -> None:
        self.events.append("refresh")

    def send(self, message: dict[str, Any]) -> bool:
        self.events.append("send")
        if not self.accept:
            return False
        self.frames.append(msgpack.packb(message))
        return True

    def close(self) -> None:
        self.closed = True

    def decoded(self) -> list[Stats]:
        messages = [decode_frame(frame) for frame in self.frames]
        assert all(isinstance(m, Stats) for m in messages)
        return [m for m in messages if isinstance(m, Stats)]


def entry(n: int = 0, suffix: str = "0", peer: str = "10.0.0.1:21001") -> TransferStat:
    return TransferStat(f"{UID[:-6]}{n:06x}-{suffix}", peer, 100 + n, 1, 0.01)


def reporter(client: Recorder, **kw: Any) -> StatsReporter:
    return StatsReporter(client, Role.DECODE, HTTP, rank=1, ranks=2, **kw)


def test_reports_arrive_as_decodable_stats_of_this_rank() -> None:
    client = Recorder()
    stats = reporter(client)
    assert stats.report(entry(1)) and stats.report(entry(2))
    assert stats.flush() == 2
    [message] = client.decoded()
    assert (message.role, str(message.http_address), message.rank, message.ranks) == (
        Role.DECODE,
        HTTP,
        1,
        2,
    )
    assert [t.bytes for t in message.transfers] == [101, 102]


def test_a_full_queue_drops_and_counts_without_blocking() -> None:
    stats = reporter(Recorder(), queue_size=2)
    started = time.monotonic()
    results = [stats.report(entry(n)) for n in range(5)]
    assert time.monotonic() - started < 1.0
    assert results == [True, True, False, False, False]
    assert stats.dropped == 3


def test_an_entry_the_registry_would_refuse_is_refused_here() -> None:
    client = Recorder()
    stats = reporter(client)
    assert not stats.report(TransferStat("not-an-id", "h:1", 1, 1, 0.1))
    assert not stats.report(TransferStat(f"{UID}-0", "h:1", -1, 1, 0.1))
    assert not stats.report(TransferStat(f"{UID}-0", "h:1", 1, 1, float("nan")))
    assert stats.report(entry())
    assert (stats.invalid, stats.dropped) == (3, 0)
    assert stats.flush() == 1  # the good entry went out alone: one bad one would sink it


def test_batches_respect_the_count_limit() -> None:
    client = Recorder()
    stats = reporter(client)
    for n in range(600):
        stats.report(entry(n))
    assert stats.flush() == 600
    sizes = [len(m.transfers) for m in client.decoded()]
    assert sizes == [MAX_TRANSFERS, MAX_TRANSFERS, 600 - 2 * MAX_TRANSFERS]


def test_batches_respect_the_byte_limit() -> None:
    client = Recorder()
    stats = reporter(client)
    long_peer = f"{'d' * 60}.{'e' * 60}.{'f' * 60}.example:22001"  # ~200 bytes an entry
    for n in range(MAX_TRANSFERS):
        stats.report(entry(n, suffix="s" * 63, peer=long_peer))
    assert stats.flush() == MAX_TRANSFERS
    assert len(client.frames) >= 2
    assert all(len(frame) <= MAX_MESSAGE_BYTES + 512 for frame in client.frames)
    assert sum(len(m.transfers) for m in client.decoded()) == MAX_TRANSFERS


def test_what_the_client_refuses_is_counted_as_dropped() -> None:
    stats = reporter(Recorder(accept=False))
    for n in range(3):
        stats.report(entry(n))
    assert stats.flush() == 0
    assert stats.dropped == 3


def test_messages_are_signed_with_the_secret() -> None:
    key = b"stats-secret-0123456789"
    client = Recorder()
    stats = reporter(client, secret=key, wall_clock=lambda: 5000.0)
    stats.report(entry())
    stats.flush()
    [frame] = client.frames
    admitted = RegistryGate(Verifier(key)).admit(frame, 5000.0)
    assert admitted.signed and admitted.message == decode_frame(frame)


def test_a_bad_rank_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="rank"):
        StatsReporter(Recorder(), Role.PREFILL, HTTP, rank=2, ranks=2)
    with pytest.raises(ValueError, match="queue_size"):
        StatsReporter(Recorder(), Role.PREFILL, HTTP, rank=0, ranks=1, queue_size=0)


def test_the_thread_sends_what_many_threads_report_and_stop_flushes() -> None:
    client = Recorder()
    stats = reporter(client, queue_size=100_000)
    stats.start()

    def burst(base: int) -> None:
        for n in range(500):
            stats.report(entry(base + n))

    threads = [threading.Thread(target=burst, args=(k * 1000,)) for k in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stats.stop()
    assert client.closed
    ids = [t.transfer_id for m in client.decoded() for t in m.transfers]
    assert len(ids) == len(set(ids)) == 8 * 500
    assert stats.dropped == 0


def test_each_reporter_has_an_identity_of_its_own() -> None:
    # Not the announcer's (the zmq address), and a restarted rank never reuses its last one.
    first, second = stats_identity(HTTP, 3), stats_identity(HTTP, 3)
    assert first.startswith(f"{HTTP}/stats/3/") and first != second


def test_the_sender_looks_the_registry_up_first_and_again_every_refresh_s() -> None:
    client = Recorder()
    stats = reporter(client, refresh_s=0.05)
    assert stats.report(entry(1))
    stats.start()
    try:
        deadline = time.monotonic() + 10
        while client.events.count("refresh") < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        stats.stop()
    # The name is looked up before anything is sent (a name has no socket before that).
    assert client.events[:2] == ["refresh", "send"]
    assert client.events.count("refresh") >= 4
    assert [t.bytes for m in client.decoded() for t in m.transfers] == [101]


def test_refresh_s_must_be_positive() -> None:
    with pytest.raises(ValueError, match="refresh_s"):
        reporter(Recorder(), refresh_s=0)
