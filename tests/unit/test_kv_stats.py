"""pdproxy.registry.kv_stats: rank reports in, each transfer counted once, with the decode's
view, else (after the TTL) the prefill's, else as incomplete. Pure; time is an argument."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.base.roles import Role
from pdproxy.registry.kv_stats import (
    COUNTED_OUTCOMES,
    INCOMPLETE,
    SEVERITY,
    KvTransferStats,
    RankReport,
    TransferRecord,
)
from pdproxy.registry.messages import TransferOutcome

PROFILE = settings(derandomize=True, database=None, deadline=None)
TTL = 10.0
P, D = "10.0.0.1:8100", "10.0.0.2:8200"
UID = "0123456789abcdef0123456789abcdef"
OK, TIMEOUT, ERROR = TransferOutcome.OK, TransferOutcome.TIMEOUT, TransferOutcome.ERROR


def tid(n: int = 0) -> str:
    return f"{UID}-{n}"


def report(
    role: Role,
    rank: int = 0,
    ranks: int = 1,
    *,
    transfer: str = tid(),
    bytes_: int = 100,
    blocks: int = 1,
    seconds: float = 0.5,
    outcome: TransferOutcome = OK,
    instance: str | None = None,
) -> RankReport:
    if instance is None:
        instance = P if role is Role.PREFILL else D
    peer = D if role is Role.PREFILL else P
    return RankReport(transfer, role, instance, peer, rank, ranks, bytes_, blocks, seconds, outcome)


def prefill(rank: int = 0, ranks: int = 1, **kw: object) -> RankReport:
    return report(Role.PREFILL, rank, ranks, **kw)  # type: ignore[arg-type]


def decode(rank: int = 0, ranks: int = 1, **kw: object) -> RankReport:
    return report(Role.DECODE, rank, ranks, **kw)  # type: ignore[arg-type]


def test_one_decode_rank_counts_at_once_with_its_view() -> None:
    stats = KvTransferStats(TTL)
    records = stats.report(decode(bytes_=4096, blocks=3, seconds=0.25), 0.0)
    assert records == [TransferRecord(tid(), "ok", P, D, 4096, 3, 0.25, Role.DECODE)]


def test_a_side_completes_only_when_every_rank_reported() -> None:
    stats = KvTransferStats(TTL)
    assert stats.report(decode(0, 3, bytes_=10, seconds=0.1), 0.0) == []
    assert stats.report(decode(2, 3, bytes_=20, seconds=0.3, blocks=2), 0.1) == []
    [record] = stats.report(decode(1, 3, bytes_=30, seconds=0.2), 0.2)
    # Ranks move their slices in parallel: bytes and blocks add up, the slowest rank's time.
    assert (record.bytes, record.blocks, record.seconds) == (60, 4, 0.3)


def test_a_repeated_rank_is_ignored_not_counted_twice() -> None:
    stats = KvTransferStats(TTL)
    assert stats.report(decode(0, 2, bytes_=10), 0.0) == []
    assert stats.report(decode(0, 2, bytes_=10), 0.1) == []  # rank 0 again: still one missing
    [record] = stats.report(decode(1, 2, bytes_=5), 0.2)
    assert record.bytes == 15


@pytest.mark.parametrize(("better", "worse"), list(pairwise(SEVERITY)))
def test_the_worst_outcome_of_the_ranks_wins(
    better: TransferOutcome, worse: TransferOutcome
) -> None:
    for order in ((better, worse), (worse, better)):
        stats = KvTransferStats(TTL)
        stats.report(decode(0, 2, outcome=order[0]), 0.0)
        [record] = stats.report(decode(1, 2, outcome=order[1]), 0.0)
        assert record.outcome == worse.value


def test_severity_order_is_fixed() -> None:
    assert [o.value for o in SEVERITY] == ["ok", "dropped", "missing", "timeout", "error"]
    assert set(SEVERITY) == set(TransferOutcome)
    assert COUNTED_OUTCOMES == ("ok", "dropped", "missing", "timeout", "error", INCOMPLETE)


def test_prefill_then_decode_counts_once_with_the_decode_view() -> None:
    stats = KvTransferStats(TTL)
    assert stats.report(prefill(bytes_=100, seconds=0.1), 0.0) == []  # waits for the decode
    [record] = stats.report(decode(bytes_=90, seconds=0.4, outcome=TIMEOUT), 1.0)
    assert (record.outcome, record.bytes, record.seconds, record.seen_by) == (
        "timeout",
        90,
        0.4,
        Role.DECODE,
    )
    assert (record.prefill, record.decode) == (P, D)
    assert stats.expire(1.0 + 2 * TTL) == []  # nothing more, ever


def test_decode_then_prefill_counts_once() -> None:
    stats = KvTransferStats(TTL)
    assert len(stats.report(decode(), 0.0)) == 1
    assert stats.report(prefill(), 5.0) == []  # the other side, late: ignored
    assert stats.expire(5.0 + TTL) == []
    assert len(stats) == 0


def test_a_counted_id_is_remembered_for_a_ttl_after_counting() -> None:
    stats = KvTransferStats(TTL)
    stats.report(prefill(0, 2), 0.0)
    assert len(stats.report(decode(), TTL - 1)) == 1  # counted just before the deadline
    assert stats.expire(TTL + 1) == []
    assert stats.report(prefill(1, 2), TTL + 1) == []  # still remembered: ignored
    assert len(stats) == 1
    assert stats.expire(2 * TTL - 1) == []
    assert len(stats) == 0


def test_a_prefill_only_transfer_counts_at_its_deadline_with_the_prefill_view() -> None:
    stats = KvTransferStats(TTL)
    assert stats.report(prefill(0, 2, bytes_=7, outcome=ERROR, seconds=0.2), 0.0) == []
    assert stats.report(prefill(1, 2, bytes_=3, seconds=0.9), 1.0) == []
    assert stats.expire(TTL - 0.001) == []
    [record] = stats.expire(TTL)
    assert record == TransferRecord(tid(), "error", P, D, 10, 2, 0.9, Role.PREFILL)


def test_a_partial_decode_does_not_stop_the_prefill_view_at_the_deadline() -> None:
    stats = KvTransferStats(TTL)
    stats.report(prefill(), 0.0)
    stats.report(decode(0, 2, outcome=TIMEOUT), 0.5)
    [record] = stats.expire(TTL)
    assert (record.outcome, record.seen_by) == ("ok", Role.PREFILL)


def test_missing_ranks_make_an_incomplete_transfer_without_bytes_or_duration() -> None:
    stats = KvTransferStats(TTL)
    stats.report(decode(0, 2, bytes_=50), 0.0)
    stats.report(prefill(0, 4, bytes_=50), 0.0)
    [record] = stats.expire(TTL)
    assert record == TransferRecord(tid(), INCOMPLETE, P, D, 0, 0, None, None)


@pytest.mark.parametrize(
    ("first", "expected"),
    [
        (prefill(0, 2), (P, D)),  # the prefill names itself, its peer the decode
        (decode(0, 2), (P, D)),
        (replace(prefill(0, 2), peer=None), (P, None)),  # a peer the registry did not know
        (replace(decode(0, 2), peer=None), (None, D)),
    ],
)
def test_an_incomplete_transfer_names_what_it_knows(
    first: RankReport, expected: tuple[str | None, str | None]
) -> None:
    stats = KvTransferStats(TTL)
    stats.report(first, 0.0)
    [record] = stats.expire(TTL)
    assert (record.prefill, record.decode) == expected


def test_each_side_names_itself_before_its_peer_does() -> None:
    stats = KvTransferStats(TTL)
    stats.report(replace(prefill(instance="10.0.0.9:1"), peer="10.0.0.9:2"), 0.0)
    [record] = stats.report(replace(decode(), peer="10.0.0.9:3"), 0.0)
    assert (record.prefill, record.decode) == ("10.0.0.9:1", D)


def test_reports_disagreeing_on_who_a_side_is_are_ignored() -> None:
    stats = KvTransferStats(TTL)
    stats.report(decode(0, 2), 0.0)
    assert stats.report(decode(1, 4), 0.0) == []  # another TP size
    assert stats.report(decode(1, 2, instance="10.0.0.3:8200"), 0.0) == []  # another instance
    assert len(stats.report(decode(1, 2), 0.0)) == 1


def test_the_deadline_is_not_moved_by_later_reports() -> None:
    # A sender dripping one rank now and then cannot keep an id alive forever.
    stats = KvTransferStats(TTL)
    stats.report(decode(0, 3), 0.0)
    stats.report(decode(1, 3), TTL - 1)
    [record] = stats.expire(TTL)
    assert record.outcome == INCOMPLETE


def test_a_full_table_settles_its_oldest_transfer_early() -> None:
    stats = KvTransferStats(TTL, capacity=2)
    stats.report(prefill(transfer=tid(1)), 0.0)
    stats.report(decode(0, 2, transfer=tid(2)), 1.0)
    records = stats.report(decode(0, 2, transfer=tid(3)), 2.0)
    assert [(r.transfer_id, r.outcome, r.seen_by) for r in records] == [
        (tid(1), "ok", Role.PREFILL)
    ]
    assert len(stats) == 2
    [early] = stats.report(decode(0, 2, transfer=tid(4)), 3.0)
    assert (early.transfer_id, early.outcome) == (tid(2), INCOMPLETE)
    # A counted id gives its place up silently.
    stats = KvTransferStats(TTL, capacity=1)
    assert len(stats.report(decode(transfer=tid(1)), 0.0)) == 1
    assert stats.report(prefill(transfer=tid(2)), 0.0) == []
    assert len(stats) == 1


def test_bounds_are_validated() -> None:
    with pytest.raises(ValueError, match="ttl"):
        KvTransferStats(0)
    with pytest.raises(ValueError, match="capacity"):
        KvTransferStats(TTL, capacity=0)


def test_many_ids_stay_bounded() -> None:
    stats = KvTransferStats(TTL, capacity=100)
    counted = 0
    for n in range(1000):
        counted += len(stats.report(prefill(0, 2, transfer=tid(n)), float(n) / 1000))
        assert len(stats) <= 100
    counted += len(stats.expire(math.inf))
    assert counted == 1000 and len(stats) == 0


# -- any order of reports ------------------------------------------------------------------------


@dataclass(frozen=True)
class Side:
    ranks: int
    values: tuple[tuple[int, int, float, TransferOutcome], ...]  # per rank
    reporting: frozenset[int]  # the ranks that do report

    @property
    def complete(self) -> bool:
        return len(self.reporting) == self.ranks

    def view(self) -> tuple[str, int, int, float]:
        chosen = [self.values[r] for r in sorted(self.reporting)]
        worst = max((v[3] for v in chosen), key=SEVERITY.index)
        return (
            worst.value,
            sum(v[0] for v in chosen),
            sum(v[1] for v in chosen),
            max(v[2] for v in chosen),
        )


@st.composite
def sides(draw: st.DrawFn) -> Side | None:
    if draw(st.booleans()):
        return None
    ranks = draw(st.integers(1, 4))
    values = tuple(
        (
            draw(st.integers(0, 10**6)),
            draw(st.integers(0, 100)),
            draw(st.floats(0, 60)),
            draw(st.sampled_from(SEVERITY)),
        )
        for _ in range(ranks)
    )
    reporting = draw(st.frozensets(st.integers(0, ranks - 1), min_size=1))
    return Side(ranks, values, reporting)


def reports_of(transfer: str, role: Role, side: Side | None) -> list[RankReport]:
    if side is None:
        return []
    return [
        report(
            role,
            rank,
            side.ranks,
            transfer=transfer,
            bytes_=side.values[rank][0],
            blocks=side.values[rank][1],
            seconds=side.values[rank][2],
            outcome=side.values[rank][3],
        )
        for rank in side.reporting
    ]


@settings(PROFILE, max_examples=300)
@given(
    transfers=st.lists(st.tuples(sides(), sides()), max_size=8),
    seed=st.integers(0, 2**32),
    duplicates=st.integers(0, 5),
)
def test_any_order_counts_each_transfer_once_with_the_right_view(
    transfers: list[tuple[Side | None, Side | None]], seed: int, duplicates: int
) -> None:
    shuffler = random.Random(seed)
    stream = [
        r
        for n, (p_side, d_side) in enumerate(transfers)
        for r in reports_of(tid(n), Role.PREFILL, p_side) + reports_of(tid(n), Role.DECODE, d_side)
    ]
    # A rank's report may arrive twice (a retried send): it must change nothing.
    stream += [shuffler.choice(stream) for _ in range(duplicates)] if stream else []
    shuffler.shuffle(stream)
    stats = KvTransferStats(TTL)
    records: list[TransferRecord] = []
    for step, item in enumerate(stream):
        records += stats.report(item, step * TTL / (2 * len(stream)))  # all within the TTL
    before_deadline = {r.transfer_id for r in records}
    records += stats.expire(math.inf)
    assert len(stats) == 0
    by_id = {r.transfer_id: r for r in records}
    assert len(by_id) == len(records)  # once per id
    expected_ids = {tid(n) for n, (p, d) in enumerate(transfers) if p or d}
    assert set(by_id) == expected_ids
    for n, (p_side, d_side) in enumerate(transfers):
        if p_side is None and d_side is None:
            continue
        record = by_id[tid(n)]
        if d_side is not None and d_side.complete:
            assert record.seen_by is Role.DECODE and record.transfer_id in before_deadline
            view = d_side.view()
        elif p_side is not None and p_side.complete:
            assert record.seen_by is Role.PREFILL and record.transfer_id not in before_deadline
            view = p_side.view()
        else:
            assert record.outcome == INCOMPLETE and record.seen_by is None
            assert (record.bytes, record.seconds) == (0, None)
            continue
        assert (record.outcome, record.bytes, record.blocks, record.seconds) == view
        assert (record.prefill, record.decode) == (P, D)
