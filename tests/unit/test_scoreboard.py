"""pdproxy.pairing.inflight, scoreboard and candidates: the proxy's own legs in flight and the
load scores kept exact from them. Pure.

The oracle recomputes every score from scratch (announced load plus InFlight) and compares it
with what the min tree kept up to date incrementally.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pdproxy.ids import Address
from pdproxy.pairing.candidates import Candidates
from pdproxy.pairing.features import RequestFeatures
from pdproxy.pairing.inflight import Busy, InFlight
from pdproxy.pairing.planner import Pair, Planner
from pdproxy.pairing.policies.least_loaded import LeastLoaded
from pdproxy.pairing.scoreboard import LoadKind, ScoreBoard, kv_load, request_load
from pdproxy.registry.messages import Load, Role
from pdproxy.registry.table import Instance, Snapshot, Source

# Deterministic and load-tolerant: same examples every run, no deadline, no example database.
PROFILE = settings(derandomize=True, database=None, deadline=None)

CAPACITY = 1000


def inst(n: int, load: Load | None = None, role: Role = Role.DECODE) -> Instance:
    host = f"10.0.{0 if role is Role.PREFILL else 1}.{n}"
    return Instance(
        role, Address(host, 8200), Address(host, 22001), Source.V1, model="m", load=load
    )


def addr(n: int) -> Address:
    return inst(n).http_address


def oracle(instances: tuple[Instance, ...], inflight: InFlight, kind: LoadKind) -> list[float]:
    """Every score recomputed from scratch."""
    out = []
    for instance in instances:
        busy = inflight.get(instance.http_address)
        load = instance.load
        if kind is LoadKind.REQUESTS:
            announced = 0 if load is None else (load.running or 0) + (load.waiting or 0)
            out.append(float(busy.requests + announced))
        else:
            usage = 0.0 if load is None or load.kv_usage is None else load.kv_usage
            out.append(usage + busy.tokens / CAPACITY)
    return out


def assert_board_exact(board: ScoreBoard, expected: list[float]) -> None:
    assert board.values == expected
    assert board.total == pytest.approx(math.fsum(expected), rel=1e-9, abs=1e-9)
    best = board.best()
    # The least loaded; ties go to the lowest position.
    assert best == expected.index(min(expected))
    assert board.value_of(best) == min(expected)


# ---------------------------------------------------------------------------------------------
# InFlight


def test_idle_address_reads_as_zero() -> None:
    inflight = InFlight()
    assert inflight.get(addr(1)) == Busy(0, 0)
    assert inflight.total_requests() == 0


def test_add_and_remove_count_requests_and_tokens() -> None:
    inflight = InFlight()
    inflight.add(addr(1), 5)
    inflight.add(addr(1), 7)
    inflight.add(addr(2), 3)
    assert inflight.get(addr(1)) == Busy(2, 12)
    assert inflight.get(addr(2)) == Busy(1, 3)
    assert inflight.total_requests() == 3
    inflight.remove(addr(1), 5)
    assert inflight.get(addr(1)) == Busy(1, 7)
    assert inflight.total_requests() == 2


def test_entries_vanish_when_requests_reach_zero() -> None:
    inflight = InFlight()
    for n in range(50):
        inflight.add(addr(n), n)
    for n in range(50):
        inflight.remove(addr(n), n)
    assert inflight._busy == {}
    assert inflight.total_requests() == 0
    assert inflight.get(addr(3)) == Busy(0, 0)


def test_adding_to_one_address_leaves_idle_ones_idle() -> None:
    inflight = InFlight()
    idle = inflight.get(addr(1))
    inflight.add(addr(2), 10)
    inflight.remove(addr(2), 10)
    inflight.add(addr(2), 10)
    assert idle == Busy(0, 0)
    assert inflight.get(addr(1)) == Busy(0, 0)
    assert inflight.get(addr(3)) == Busy(0, 0)


def test_remove_of_an_idle_address_raises() -> None:
    inflight = InFlight()
    with pytest.raises(ValueError, match=r"10\.0\.1\.1:8200"):
        inflight.remove(addr(1), 0)
    inflight.add(addr(1), 4)
    inflight.remove(addr(1), 4)
    with pytest.raises(ValueError, match="no leg in flight"):
        inflight.remove(addr(1), 4)  # released twice
    assert inflight.total_requests() == 0


def test_failed_remove_changes_nothing_and_notifies_nobody() -> None:
    inflight = InFlight()
    heard: list[Address] = []
    inflight.add(addr(2), 9)
    inflight.listen(heard.append)
    with pytest.raises(ValueError):
        inflight.remove(addr(1), 1)
    assert heard == []
    assert inflight.get(addr(2)) == Busy(1, 9)


def test_listeners_hear_every_change_in_order_until_cleared() -> None:
    inflight = InFlight()
    first: list[Address] = []
    second: list[Address] = []
    inflight.listen(first.append)
    inflight.listen(second.append)
    inflight.add(addr(1), 1)
    inflight.add(addr(2), 1)
    inflight.remove(addr(1), 1)
    assert first == second == [addr(1), addr(2), addr(1)]
    inflight.clear_listeners()
    inflight.remove(addr(2), 1)
    inflight.add(addr(3), 1)
    assert first == second == [addr(1), addr(2), addr(1)]


def test_listener_sees_the_count_after_the_change() -> None:
    inflight = InFlight()
    seen: list[Busy] = []
    inflight.listen(lambda a: seen.append(Busy(inflight.get(a).requests, inflight.get(a).tokens)))
    inflight.add(addr(1), 10)
    inflight.add(addr(1), 5)
    inflight.remove(addr(1), 10)
    inflight.remove(addr(1), 5)
    assert seen == [Busy(1, 10), Busy(2, 15), Busy(1, 5), Busy(0, 0)]


# ---------------------------------------------------------------------------------------------
# Scores


@pytest.mark.parametrize(
    ("load", "busy", "expected"),
    [
        (None, Busy(0, 0), 0.0),
        (None, Busy(3, 100), 3.0),
        (Load(running=2, waiting=5), Busy(0, 0), 7.0),
        (Load(running=2, waiting=5), Busy(4, 0), 11.0),
        (Load(running=None, waiting=5), Busy(1, 0), 6.0),
        (Load(running=2, waiting=None), Busy(1, 0), 3.0),
        (Load(kv_usage=0.9), Busy(1, 10**6), 1.0),  # kv_usage is no request count
    ],
)
def test_request_load(load: Load | None, busy: Busy, expected: float) -> None:
    assert request_load(inst(1, load), busy) == expected


@pytest.mark.parametrize(
    ("load", "busy", "capacity", "expected"),
    [
        (None, Busy(0, 0), 1000, 0.0),
        (None, Busy(1, 250), 1000, 0.25),
        (Load(kv_usage=0.5), Busy(0, 0), 1000, 0.5),
        (Load(kv_usage=0.5), Busy(2, 100), 1000, 0.6),
        (Load(kv_usage=0.5), Busy(2, 100), 10_000, 0.51),
        (Load(running=50, waiting=50), Busy(0, 0), 1000, 0.0),  # counts are no KV
        (Load(running=1, kv_usage=None), Busy(1, 500), 1000, 0.5),
    ],
)
def test_kv_load(load: Load | None, busy: Busy, capacity: int, expected: float) -> None:
    assert kv_load(inst(1, load), busy, capacity) == pytest.approx(expected)


# ---------------------------------------------------------------------------------------------
# ScoreBoard


def board_of(
    instances: tuple[Instance, ...], inflight: InFlight, kind: LoadKind = LoadKind.REQUESTS
) -> ScoreBoard:
    board = Candidates(instances, inflight, CAPACITY).board(kind)
    return board


def test_board_starts_from_the_current_inflight_counts() -> None:
    inflight = InFlight()
    instances = (inst(1), inst(2, Load(running=1)), inst(3))
    inflight.add(addr(1), 0)
    inflight.add(addr(1), 0)
    board = board_of(instances, inflight)
    assert board.values == [2.0, 1.0, 0.0]
    assert board.total == 3.0
    assert board.best() == 2


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 9])
def test_ties_go_to_the_lowest_position(n: int) -> None:
    instances = tuple(inst(i) for i in range(n))
    inflight = InFlight()
    board = board_of(instances, inflight)
    assert board.best() == 0
    order = []
    for _ in range(2 * n):
        best = board.best()
        order.append(best)
        inflight.add(instances[best].http_address, 0)
    assert order == [*range(n), *range(n)]


def test_board_follows_adds_and_removes() -> None:
    instances = (inst(1), inst(2), inst(3))
    inflight = InFlight()
    board = board_of(instances, inflight)
    inflight.add(addr(1), 0)
    inflight.add(addr(2), 0)
    assert board.best() == 2
    inflight.add(addr(3), 0)
    inflight.add(addr(3), 0)
    assert board.best() == 0
    inflight.remove(addr(3), 0)
    inflight.remove(addr(3), 0)
    inflight.remove(addr(2), 0)
    assert board.best() == 1
    assert board.values == [1.0, 0.0, 0.0]
    assert board.total == 1.0


def test_board_ignores_addresses_it_does_not_hold() -> None:
    instances = (inst(1), inst(2))
    inflight = InFlight()
    board = board_of(instances, inflight)
    for _ in range(5):
        inflight.add(addr(9), 100)
    assert board.values == [0.0, 0.0]
    assert board.total == 0.0
    board.changed(addr(42))  # never seen at all
    assert board.values == [0.0, 0.0]


def test_kv_board_counts_tokens_against_capacity() -> None:
    instances = (inst(1, Load(kv_usage=0.0)), inst(2, Load(kv_usage=0.1)))
    inflight = InFlight()
    board = board_of(instances, inflight, LoadKind.KV)
    assert board.best() == 0
    inflight.add(addr(1), 99)  # 0.099 < 0.1
    assert board.best() == 0
    inflight.add(addr(1), 2)  # 0.101 > 0.1
    assert board.best() == 1
    assert board.values == pytest.approx([0.101, 0.1])
    inflight.remove(addr(1), 99)
    assert board.best() == 0


class ScoreBoardMachine(RuleBasedStateMachine):
    """Random legs starting and ending over random candidates with random announced loads:
    both kinds of board always equal a from-scratch recomputation."""

    def __init__(self) -> None:
        super().__init__()
        self.inflight = InFlight()
        self.instances: tuple[Instance, ...] = ()
        self.boards: dict[LoadKind, ScoreBoard] = {}
        # Legs in flight, as the caller would hold them: (address, tokens).
        self.legs: list[tuple[Address, int]] = []

    @initialize(
        loads=st.lists(
            st.none()
            | st.builds(
                Load,
                running=st.none() | st.integers(0, 20),
                waiting=st.none() | st.integers(0, 20),
                kv_usage=st.none() | st.floats(0.0, 1.0),
            ),
            min_size=1,
            max_size=12,
        ),
        strangers=st.integers(0, 2),
    )
    def build(self, loads: list[Load | None], strangers: int) -> None:
        self.instances = tuple(inst(i, load) for i, load in enumerate(loads))
        # Some legs already in flight, some on addresses the board does not hold.
        for i in range(strangers):
            self.start(100 + i, 7)
        candidates = Candidates(self.instances, self.inflight, CAPACITY)
        self.boards = {kind: candidates.board(kind) for kind in LoadKind}

    def start(self, n: int, tokens: int) -> None:
        address = addr(n)
        self.inflight.add(address, tokens)
        self.legs.append((address, tokens))

    @rule(data=st.data(), tokens=st.integers(0, 5000))
    def add(self, data: st.DataObject, tokens: int) -> None:
        n = data.draw(st.integers(0, len(self.instances) + 1))  # may be a stranger
        self.start(n, tokens)

    @precondition(lambda self: bool(self.legs))
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        address, tokens = self.legs.pop(data.draw(st.integers(0, len(self.legs) - 1)))
        self.inflight.remove(address, tokens)

    @rule(data=st.data())
    def remove_idle(self, data: st.DataObject) -> None:
        n = data.draw(st.integers(0, len(self.instances) + 1))
        if self.inflight.get(addr(n)).requests == 0:
            with pytest.raises(ValueError):
                self.inflight.remove(addr(n), 0)

    @invariant()
    def boards_are_exact(self) -> None:
        for kind, board in self.boards.items():
            assert_board_exact(board, oracle(self.instances, self.inflight, kind))

    @invariant()
    def inflight_matches_the_legs(self) -> None:
        assert self.inflight.total_requests() == len(self.legs)
        held = {address for address, _ in self.legs}
        assert set(self.inflight._busy) == held  # no entry outlives its last leg
        for address in held:
            mine = [tokens for a, tokens in self.legs if a == address]
            assert self.inflight.get(address) == Busy(len(mine), sum(mine))


ScoreBoardMachine.TestCase.settings = settings(PROFILE, max_examples=60, stateful_step_count=30)
TestScoreBoardMachine = ScoreBoardMachine.TestCase


@pytest.mark.parametrize("n", [1, 7, 64, 100])
def test_long_random_sequences_match_brute_force(n: int) -> None:
    rng = random.Random(n)
    instances = tuple(
        inst(i, Load(rng.randint(0, 9), rng.randint(0, 9), rng.random())) for i in range(n)
    )
    inflight = InFlight()
    candidates = Candidates(instances, inflight, CAPACITY)
    boards = {kind: candidates.board(kind) for kind in LoadKind}
    legs: list[tuple[Address, int]] = []
    for step in range(3000):
        if legs and rng.random() < 0.45:
            address, tokens = legs.pop(rng.randrange(len(legs)))
            inflight.remove(address, tokens)
        else:
            address, tokens = instances[rng.randrange(n)].http_address, rng.randint(0, 4000)
            inflight.add(address, tokens)
            legs.append((address, tokens))
        if step % 100 == 0:
            for kind, board in boards.items():
                assert_board_exact(board, oracle(instances, inflight, kind))
    while legs:
        address, tokens = legs.pop()
        inflight.remove(address, tokens)
    assert inflight._busy == {}
    for kind, board in boards.items():
        assert_board_exact(board, oracle(instances, inflight, kind))


@settings(PROFILE, max_examples=100)
@given(
    counts=st.lists(st.integers(0, 6), min_size=1, max_size=20),
    announced=st.lists(st.integers(0, 6), min_size=20, max_size=20),
)
def test_board_built_late_equals_board_built_early(counts: list[int], announced: list[int]) -> None:
    instances = tuple(inst(i, Load(running=announced[i])) for i in range(len(counts)))
    inflight = InFlight()
    early = board_of(instances, inflight)
    for i, count in enumerate(counts):
        for _ in range(count):
            inflight.add(addr(i), 1)
    late = board_of(instances, inflight)
    assert early.values == late.values
    assert early.best() == late.best()
    assert early.total == late.total


# ---------------------------------------------------------------------------------------------
# Candidates


def test_candidate_set_is_never_empty() -> None:
    with pytest.raises(ValueError, match="never empty"):
        Candidates((), InFlight(), CAPACITY)


def test_candidates_iterate_in_order() -> None:
    instances = (inst(3), inst(1), inst(2))
    candidates = Candidates(instances, InFlight(), CAPACITY)
    assert len(candidates) == 3
    assert list(candidates) == list(instances)


def test_boards_are_built_once_per_kind_and_listen_once() -> None:
    inflight = InFlight()
    candidates = Candidates((inst(1), inst(2)), inflight, CAPACITY)
    assert inflight._listeners == []  # lazily: nothing until a policy asks
    requests = candidates.board(LoadKind.REQUESTS)
    assert candidates.board(LoadKind.REQUESTS) is requests
    kv = candidates.board(LoadKind.KV)
    assert kv is not requests
    assert candidates.board(LoadKind.KV) is kv
    assert len(inflight._listeners) == 2


def test_kv_board_uses_the_candidates_capacity() -> None:
    inflight = InFlight()
    inflight.add(addr(1), 500)
    small = Candidates((inst(1),), inflight, 1000).board(LoadKind.KV)
    large = Candidates((inst(1),), inflight, 100_000).board(LoadKind.KV)
    assert small.values == [0.5]
    assert large.values == [0.005]


def test_derived_is_built_once_per_candidate_set() -> None:
    calls: list[tuple[Instance, ...]] = []

    def build(instances: tuple[Instance, ...]) -> int:
        calls.append(instances)
        return len(calls)

    instances = (inst(1), inst(2))
    candidates = Candidates(instances, InFlight(), CAPACITY)
    assert candidates.derived("x", build) == 1
    assert candidates.derived("x", build) == 1
    assert candidates.derived("y", build) == 2
    assert calls == [instances, instances]
    other = Candidates(instances, InFlight(), CAPACITY)
    assert other.derived("x", build) == 3  # a new set derives afresh


# ---------------------------------------------------------------------------------------------
# The planner moving to a new snapshot


def p(n: int) -> Instance:
    return inst(n, role=Role.PREFILL)


def test_old_boards_stop_updating_and_new_boards_see_current_counts() -> None:
    pl = Planner(LeastLoaded(), LeastLoaded())
    prefills, decodes = (p(1), p(2)), (inst(1), inst(2))
    old = Snapshot(1, prefills, decodes)
    request = RequestFeatures("m", 10, 20)
    first = pl.plan(old, request)
    second = pl.plan(old, request)
    assert isinstance(first, Pair) and isinstance(second, Pair)
    assert {first.prefill, second.prefill} == set(prefills)  # least loaded spreads
    old_view = pl.index(old).view("m")
    assert old_view.prefills is not None
    old_board = old_view.prefills.board(LoadKind.REQUESTS)
    assert old_board.values == [1.0, 1.0]

    new = Snapshot(2, prefills, decodes)  # same members, a new snapshot object
    new_index = pl.index(new)
    new_view = new_index.view("m")
    assert new_view.prefills is not None
    new_board = new_view.prefills.board(LoadKind.REQUESTS)
    assert new_board.values == [1.0, 1.0]  # it starts from what is in flight

    pl.release(first.prefill.http_address, first.prefill_tokens)
    assert new_board.values[prefills.index(first.prefill)] == 0.0
    assert old_board.values == [1.0, 1.0]  # the old index's board no longer listens
    third = pl.plan(new, request)
    assert isinstance(third, Pair)
    assert third.prefill == first.prefill  # decided on the new, exact board
    assert new_board.values == [1.0, 1.0]
    assert old_board.values == [1.0, 1.0]
    # Only the new index's boards listen: its prefill and decode boards.
    assert len(pl.inflight._listeners) == 2


def test_release_after_a_snapshot_change_still_balances() -> None:
    pl = Planner(LeastLoaded(), LeastLoaded())
    snapshots = [Snapshot(v, (p(1), p(2), p(3)), (inst(1), inst(2))) for v in range(5)]
    held: list[Pair] = []
    for round_ in range(5):
        for _ in range(6):
            result = pl.plan(snapshots[round_], RequestFeatures("m", 3, 4))
            assert isinstance(result, Pair)
            held.append(result)
    assert pl.inflight.total_requests() == 60
    view = pl.index(snapshots[-1]).view("m")
    assert view.prefills is not None
    prefill_board = view.prefills.board(LoadKind.REQUESTS)
    decode_board = view.decodes_for(p(1)).board(LoadKind.REQUESTS)
    # Every snapshot's least_loaded saw the legs planned under the earlier ones.
    assert prefill_board.values == [10.0, 10.0, 10.0]
    assert decode_board.values == [15.0, 15.0]
    for pair in held:
        pl.release(pair.prefill.http_address, pair.prefill_tokens)
        pl.release(pair.decode.http_address, pair.decode_tokens)
    assert pl.inflight._busy == {}
    assert prefill_board.values == [0.0, 0.0, 0.0]
    assert decode_board.values == [0.0, 0.0]
    assert prefill_board.total == decode_board.total == 0.0
