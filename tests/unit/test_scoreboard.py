"""pdproxy.pairing.inflight, scoreboard and candidates: the proxy's own legs in flight and the
load scores kept exact from them. Pure.

A score is the proxy's own legs there now plus others' load, where others' load is what the
instance announced minus the proxy's own legs there when that announcement was first seen
(never below 0); prefill work instead scales the proxy's own legs by the fleet's share of
others' requests (fleet_scale). The oracle recomputes every score from scratch by that formula
(from the busy state recorded when the reports were first seen) and compares it with what the
min tree kept up to date incrementally.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pdproxy.base.roles import Role
from pdproxy.ids import Address
from pdproxy.pairing.candidates import Candidates
from pdproxy.pairing.features import RequestFeatures
from pdproxy.pairing.inflight import REPORT_SMOOTHING, Busy, InFlight, Report, requests_in
from pdproxy.pairing.planner import Pair, Planner
from pdproxy.pairing.policies.least_loaded import LeastLoaded
from pdproxy.pairing.scoreboard import (
    LoadKind,
    ScoreBoard,
    Scoring,
    announced_kv,
    announced_requests,
    fleet_scale,
    own_requests,
    scoring,
)
from pdproxy.registry.messages import Load
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


def own_of(kind: LoadKind, busy: Busy) -> float:
    """The proxy's own part of a score, restated from the design."""
    if kind is LoadKind.REQUESTS:
        return float(busy.requests)
    if kind is LoadKind.KV:
        return busy.tokens / CAPACITY
    return float(busy.tokens)


def announced_of(kind: LoadKind, instance: Instance) -> float:
    """The announced part of a score, restated from the design."""
    load = instance.load
    if kind is LoadKind.REQUESTS:
        return 0.0 if load is None else float((load.running or 0) + (load.waiting or 0))
    if kind is LoadKind.KV:
        return 0.0 if load is None or load.kv_usage is None else load.kv_usage
    return 0.0  # prefill work: the own legs are scaled instead


def scale_of(instances: tuple[Instance, ...], seen: list[Busy]) -> float:
    """1 + others' requests / own requests, from one report per instance."""
    own = sum(busy.requests for busy in seen)
    others = sum(
        max(0, requests_in(i.load) - busy.requests) for i, busy in zip(instances, seen, strict=True)
    )
    return 1.0 + others / own if own else 1.0


def busy_now(instances: tuple[Instance, ...], inflight: InFlight) -> list[Busy]:
    """A copy of what is in flight on each instance (InFlight hands out its live counters)."""
    out = []
    for instance in instances:
        busy = inflight.get(instance.http_address)
        out.append(Busy(busy.requests, busy.tokens))
    return out


def oracle(
    instances: tuple[Instance, ...], inflight: InFlight, kind: LoadKind, built: list[Busy]
) -> list[float]:
    """Every score recomputed from scratch; `built`: the busy state when the reports were
    first seen."""
    if kind is LoadKind.PREFILL_WORK:
        scale = scale_of(instances, built)
        return [scale * inflight.get(i.http_address).tokens for i in instances]
    out = []
    for instance, then in zip(instances, built, strict=True):
        others = max(0.0, announced_of(kind, instance) - own_of(kind, then))
        out.append(own_of(kind, inflight.get(instance.http_address)) + others)
    return out


def assert_tree_consistent(board: ScoreBoard) -> None:
    """Every node of the min tree, not only the root, holds the least loaded candidate under
    it (ties: the lowest position), recomputed by brute force from the values."""
    n, size, tree = len(board.values), board._size, board._best
    assert len(tree) == 2 * size
    for node in range(1, 2 * size):
        first = node
        width = 1
        while first < size:
            first, width = 2 * first, 2 * width
        under = [i for i in range(first - size, first - size + width) if i < n]
        expected = min(under, key=lambda i: (board.values[i], i)) if under else -1
        assert tree[node] == expected, (node, tree[node], expected, board.values)


def assert_board_exact(board: ScoreBoard, expected: list[float]) -> None:
    assert board.values == expected
    assert board.total == pytest.approx(math.fsum(expected), rel=1e-9, abs=1e-9)
    best = board.best()
    # The least loaded; ties go to the lowest position.
    assert best == expected.index(min(expected))
    assert board.value_of(best) == min(expected)
    assert_tree_consistent(board)


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


def hear(into: list[Address]) -> Callable[[Address, Busy], None]:
    """A listener that notes the addresses it is told of."""
    return lambda address, busy: into.append(address)


def test_failed_remove_changes_nothing_and_notifies_nobody() -> None:
    inflight = InFlight()
    heard: list[Address] = []
    inflight.add(addr(2), 9)
    inflight.listen((addr(1), addr(2)), hear(heard))
    with pytest.raises(ValueError):
        inflight.remove(addr(1), 1)
    assert heard == []
    assert inflight.get(addr(2)) == Busy(1, 9)


def test_listeners_hear_every_change_in_order_until_cleared() -> None:
    inflight = InFlight()
    first: list[Address] = []
    second: list[Address] = []
    inflight.listen((addr(1), addr(2), addr(3)), hear(first))
    inflight.listen((addr(1), addr(2), addr(3)), hear(second))
    inflight.add(addr(1), 1)
    inflight.add(addr(2), 1)
    inflight.remove(addr(1), 1)
    assert first == second == [addr(1), addr(2), addr(1)]
    inflight.clear_listeners()
    inflight.remove(addr(2), 1)
    inflight.add(addr(3), 1)
    assert first == second == [addr(1), addr(2), addr(1)]


def test_listeners_hear_only_the_addresses_they_hold() -> None:
    inflight = InFlight()
    odd: list[Address] = []
    even: list[Address] = []
    inflight.listen((addr(1), addr(3)), hear(odd))
    inflight.listen([addr(2)], hear(even))
    for n in (1, 2, 3, 4):
        inflight.add(addr(n), 1)
    for n in (4, 3, 2, 1):
        inflight.remove(addr(n), 1)
    assert odd == [addr(1), addr(3), addr(3), addr(1)]
    assert even == [addr(2), addr(2)]


def test_listeners_on_a_shared_address_all_hear_it_in_listen_order() -> None:
    inflight = InFlight()
    heard: list[tuple[str, Address]] = []
    inflight.listen((addr(1), addr(2)), lambda a, busy: heard.append(("a", a)))
    inflight.listen((addr(2), addr(3)), lambda a, busy: heard.append(("b", a)))
    inflight.add(addr(2), 1)
    inflight.add(addr(3), 1)
    inflight.add(addr(1), 1)
    assert heard == [("a", addr(2)), ("b", addr(2)), ("b", addr(3)), ("a", addr(1))]


def test_listen_takes_any_iterable_of_addresses_once() -> None:
    inflight = InFlight()
    heard: list[Address] = []
    inflight.listen((addr(n) for n in (5, 6)), hear(heard))  # a generator, as Candidates does
    inflight.add(addr(6), 1)
    inflight.add(addr(5), 1)
    inflight.add(addr(7), 1)
    assert heard == [addr(6), addr(5)]


def test_listener_count_counts_listen_calls_since_the_last_clear() -> None:
    inflight = InFlight()
    assert inflight.listener_count() == 0
    inflight.listen((addr(1), addr(2), addr(3)), lambda a, busy: None)  # one call, three addresses
    assert inflight.listener_count() == 1
    inflight.listen([], lambda a, busy: None)  # a listener of nothing is still a listen call
    assert inflight.listener_count() == 2
    inflight.listen([addr(1)], lambda a, busy: None)
    assert inflight.listener_count() == 3
    inflight.clear_listeners()
    assert inflight.listener_count() == 0
    heard: list[Address] = []
    inflight.listen([addr(1)], hear(heard))
    assert inflight.listener_count() == 1
    inflight.add(addr(1), 1)
    assert heard == [addr(1)]  # listening again after a clear works


def test_listener_sees_the_count_after_the_change() -> None:
    inflight = InFlight()
    seen: list[Busy] = []

    def record(a: Address, busy: Busy) -> None:
        assert busy == inflight.get(a)  # what it is handed is the count now
        seen.append(Busy(busy.requests, busy.tokens))

    inflight.listen([addr(1)], record)
    inflight.add(addr(1), 10)
    inflight.add(addr(1), 5)
    inflight.remove(addr(1), 10)
    inflight.remove(addr(1), 5)
    assert seen == [Busy(1, 10), Busy(2, 15), Busy(1, 5), Busy(0, 0)]


# ---------------------------------------------------------------------------------------------
# Scoring: own and announced parts


@pytest.mark.parametrize(
    ("load", "expected"),
    [
        (None, 0.0),
        (Load(running=2, waiting=5), 7.0),
        (Load(running=None, waiting=5), 5.0),
        (Load(running=2, waiting=None), 2.0),
        (Load(running=0, waiting=0), 0.0),
        (Load(kv_usage=0.9), 0.0),  # kv_usage is no request count
    ],
)
def test_announced_requests(load: Load | None, expected: float) -> None:
    assert announced_requests(inst(1, load)) == expected
    assert scoring(LoadKind.REQUESTS, CAPACITY).announced(inst(1, load)) == expected


@pytest.mark.parametrize(
    ("load", "expected"),
    [
        (None, 0.0),
        (Load(kv_usage=None), 0.0),
        (Load(running=50, waiting=50), 0.0),  # counts are no KV
        (Load(kv_usage=0.25), 0.25),
        (Load(running=3, kv_usage=1.0), 1.0),
    ],
)
def test_announced_kv(load: Load | None, expected: float) -> None:
    assert announced_kv(inst(1, load)) == expected
    for capacity in (1, 1000, 10**6):  # an announcement is already a fraction
        assert scoring(LoadKind.KV, capacity).announced(inst(1, load)) == expected


@pytest.mark.parametrize(
    ("busy", "requests", "kv_1000", "kv_10000", "prefill_work"),
    [
        (Busy(0, 0), 0.0, 0.0, 0.0, 0.0),
        (Busy(3, 0), 3.0, 0.0, 0.0, 0.0),
        (Busy(1, 250), 1.0, 0.25, 0.025, 250.0),
        (Busy(2, 100), 2.0, 0.1, 0.01, 100.0),
        (Busy(4, 5000), 4.0, 5.0, 0.5, 5000.0),
    ],
)
def test_own_parts(
    busy: Busy, requests: float, kv_1000: float, kv_10000: float, prefill_work: float
) -> None:
    assert own_requests(busy) == requests
    assert scoring(LoadKind.REQUESTS, CAPACITY).own(busy) == requests
    assert scoring(LoadKind.KV, 1000).own(busy) == pytest.approx(kv_1000)
    assert scoring(LoadKind.KV, 10_000).own(busy) == pytest.approx(kv_10000)
    assert scoring(LoadKind.PREFILL_WORK, CAPACITY).own(busy) == prefill_work


def test_only_prefill_work_is_scaled() -> None:
    assert scoring(LoadKind.PREFILL_WORK, CAPACITY).scaled
    assert not scoring(LoadKind.REQUESTS, CAPACITY).scaled
    assert not scoring(LoadKind.KV, CAPACITY).scaled


def test_scoring_returns_a_scoring_per_kind() -> None:
    for kind in LoadKind:
        assert isinstance(scoring(kind, CAPACITY), Scoring)
    assert {kind.value for kind in LoadKind} == {"requests", "kv", "prefill_work"}


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
    assert board.others == [0.0, 1.0, 0.0]
    assert board.total == 3.0
    assert board.best() == 2


def test_announced_load_adds_to_legs_started_after_the_board() -> None:
    # The design's example: announced running=2 and no leg of the proxy's there scores 2;
    # three legs started after the board was built are not in that announcement: 5.
    inflight = InFlight()
    instances = (inst(1, Load(running=2)),)
    board = board_of(instances, inflight)
    assert board.values == [2.0]
    assert board.others == [2.0]
    for expected in (3.0, 4.0, 5.0):
        inflight.add(addr(1), 0)
        assert board.values == [expected]
    assert board.total == 5.0
    for expected in (4.0, 3.0, 2.0):
        inflight.remove(addr(1), 0)
        assert board.values == [expected]
    assert board.others == [2.0]  # others' load is fixed for the board's life
    assert board.total == 2.0


def test_announced_load_already_includes_the_legs_in_flight_at_build() -> None:
    # Built while the proxy has 3 legs there and the instance announced 2: the announcement
    # is taken to hold (some of) those legs, others = max(0, 2 - 3) = 0, score 3.
    inflight = InFlight()
    for _ in range(3):
        inflight.add(addr(1), 0)
    board = board_of((inst(1, Load(running=2)),), inflight)
    assert board.others == [0.0]
    assert board.values == [3.0]
    for expected in (2.0, 1.0, 0.0):
        inflight.remove(addr(1), 0)
        assert board.values == [expected]
    assert board.total == 0.0


def test_others_are_the_announcement_less_the_legs_at_build() -> None:
    inflight = InFlight()
    for _ in range(4):
        inflight.add(addr(1), 0)
    inflight.add(addr(2), 0)
    instances = (
        inst(1, Load(running=5, waiting=2)),  # 7 announced, 4 ours: 3 are others'
        inst(2, Load(running=1)),  # 1 announced, 1 ours: none are others'
        inst(3, Load(waiting=6)),  # 6 announced, none ours
        inst(4),  # nothing announced
    )
    board = board_of(instances, inflight)
    assert board.others == [3.0, 0.0, 6.0, 0.0]
    assert board.values == [7.0, 1.0, 6.0, 0.0]
    assert board.total == 14.0
    inflight.add(addr(1), 0)
    inflight.remove(addr(2), 0)
    for _ in range(2):
        inflight.add(addr(4), 0)
    assert board.values == [8.0, 0.0, 6.0, 2.0]
    assert board.total == 16.0
    assert board.best() == 1
    assert board.others == [3.0, 0.0, 6.0, 0.0]


def test_kv_others_are_the_usage_less_the_tokens_at_build() -> None:
    inflight = InFlight()
    inflight.add(addr(1), 300)  # 0.3 of the capacity
    inflight.add(addr(2), 600)  # 0.6: more than announced
    instances = (inst(1, Load(kv_usage=0.5)), inst(2, Load(kv_usage=0.4)), inst(3))
    board = board_of(instances, inflight, LoadKind.KV)
    assert board.others == pytest.approx([0.2, 0.0, 0.0])
    assert board.values == pytest.approx([0.5, 0.6, 0.0])
    inflight.remove(addr(1), 300)
    inflight.remove(addr(2), 600)
    inflight.add(addr(3), 100)
    assert board.values == pytest.approx([0.2, 0.0, 0.1])
    assert board.best() == 1


def test_prefill_work_board_scales_the_proxys_work_by_the_fleets_share() -> None:
    inflight = InFlight()
    inflight.add(addr(1), 300)
    inflight.add(addr(2), 100)
    instances = (
        inst(1, Load(running=3)),  # 3 announced, 1 ours: 2 others'
        inst(2, Load(running=1, waiting=2)),  # 3 announced, 1 ours: 2 others'
        inst(3, Load(waiting=2)),  # 2 announced, none ours
    )
    board = board_of(instances, inflight, LoadKind.PREFILL_WORK)
    # 6 others' requests to 2 of ours: the proxy holds a quarter of the fleet's.
    assert board.scale == 4.0
    assert board.others == [0.0, 0.0, 0.0]
    assert board.values == [1200.0, 400.0, 0.0]
    assert board.best() == 2  # its announced queue is not added per instance
    inflight.add(addr(3), 50)
    inflight.add(addr(3), 50)
    assert board.values == [1200.0, 400.0, 400.0]
    assert board.best() == 1  # tie at 400: the lower position
    inflight.remove(addr(1), 300)
    assert board.values == [0.0, 400.0, 400.0]
    assert board.total == 800.0


def test_prefill_work_board_alone_counts_the_proxys_work_as_it_is() -> None:
    inflight = InFlight()
    inflight.add(addr(1), 700)
    # Announcements that hold exactly the proxy's legs (one proxy, no other client): scale 1.
    instances = (inst(1, Load(running=1)), inst(2, Load(running=0)), inst(3))
    board = board_of(instances, inflight, LoadKind.PREFILL_WORK)
    assert board.scale == 1.0
    assert board.values == [700.0, 0.0, 0.0]
    inflight.add(addr(2), 250)
    inflight.add(addr(2), 250)
    assert board.values == [700.0, 500.0, 0.0]
    # Tokens, not requests: two legs of 250 weigh less than one of 700.
    assert board.total == 1200.0


def test_prefill_work_announced_as_it_arrives_is_the_others_part() -> None:
    inflight = InFlight()
    inflight.follow_work()
    inflight.add(addr(1), 300)
    # Announced work: each figure includes the proxy's own legs that reached the instance.
    inflight.announced_work(addr(1), 1300)  # 1000 beyond the own 300
    inflight.announced_work(addr(2), 0)
    instances = (inst(1, Load(prefill_tokens=9)), inst(2, Load(prefill_tokens=9)))
    candidates = Candidates(instances, inflight, CAPACITY)
    board = candidates.board(LoadKind.PREFILL_WORK)
    assert board.scale == 1.0  # the others' work is known: nothing is scaled
    assert board.others == [1000.0, 0.0]
    assert board.values == [1300.0, 0.0]
    # A report rescores its instance at once, with no rebuild (the snapshot still says 9).
    inflight.announced_work(addr(2), 4000)
    assert board.values == [1300.0, 4000.0]
    assert board.best() == 0
    # The own legs move the score between reports; the others' part stays as reported.
    inflight.add(addr(2), 500)
    assert board.values == [1300.0, 4500.0]
    inflight.remove(addr(1), 300)
    assert board.values == [1000.0, 4500.0]
    # A report taken with the own leg in it: only the rest is the others'.
    inflight.announced_work(addr(2), 600)
    assert board.others == [1000.0, 100.0]
    assert board.values == [1000.0, 600.0]
    assert board.best() == 1


def test_announced_work_is_used_only_when_followed_and_known_for_every_candidate() -> None:
    followed = InFlight()
    followed.follow_work()
    announcing = (inst(1, Load(running=1, prefill_tokens=800)), inst(2, Load(prefill_tokens=0)))
    mixed = (inst(1, Load(running=1, prefill_tokens=800)), inst(2, Load(running=0)))
    assert scoring(LoadKind.PREFILL_WORK, CAPACITY, announcing, followed).announced_work
    # One candidate without the figure (a stock vLLM behind the sidecar): scaled, as before.
    assert scoring(LoadKind.PREFILL_WORK, CAPACITY, mixed, followed).scaled
    # Not followed as it arrives (an HTTP worker's copy of the table): scaled too.
    assert scoring(LoadKind.PREFILL_WORK, CAPACITY, announcing, InFlight()).scaled
    # From the snapshot alone, before any live report: net of the own legs when first seen.
    fresh = InFlight()
    fresh.follow_work()
    fresh.add(addr(1), 300)
    board = Candidates(announcing, fresh, CAPACITY).board(LoadKind.PREFILL_WORK)
    assert board.others == [500.0, 0.0]
    assert board.values == [800.0, 0.0]


def test_announced_work_is_forgotten_with_the_instance() -> None:
    inflight = InFlight()
    inflight.follow_work()
    inflight.announced_work(addr(1), 100)
    inflight.announced_work(addr(2), 200)
    inflight.keep_reports([addr(2)])
    assert inflight.others_work(addr(1), None) is None
    assert inflight.others_work(addr(2), None) == 200.0


@pytest.mark.parametrize(
    ("own", "others", "expected"),
    [
        ([], [], 1.0),
        ([0.0, 0.0], [5.0, 1.0], 1.0),  # no leg of its own reported yet: alone, as far as known
        ([1.0, 1.0], [0.0, 0.0], 1.0),
        ([1.0, 2.0], [2.0, 4.0], 3.0),
        ([0.5, 0.0], [0.25, 3.0], 7.5),
    ],
)
def test_fleet_scale(own: list[float], others: list[float], expected: float) -> None:
    reports = [Report(None, Busy(), oth, mine) for mine, oth in zip(own, others, strict=True)]
    assert fleet_scale(reports) == pytest.approx(expected)


def test_a_custom_scoring_is_applied_with_the_same_formula() -> None:
    inflight = InFlight()
    inflight.add(addr(1), 4)
    weird = Scoring(lambda busy: 10.0 * busy.tokens, lambda instance: 100.0)
    board = ScoreBoard((inst(1), inst(2)), weird, inflight)
    assert board.others == [60.0, 100.0]  # max(0, 100 - 40), max(0, 100 - 0)
    assert board.values == [100.0, 100.0]
    inflight.listen((addr(1), addr(2)), board.changed)
    inflight.add(addr(1), 7)
    inflight.add(addr(2), 1)
    assert board.values == [170.0, 110.0]
    assert board.best() == 1


def test_a_board_alone_does_not_listen() -> None:
    inflight = InFlight()
    board = ScoreBoard((inst(1),), scoring(LoadKind.REQUESTS, CAPACITY), inflight)
    assert inflight.listener_count() == 0
    inflight.add(addr(1), 0)
    assert board.values == [0.0]  # Candidates wires boards to InFlight, not the board itself
    board.changed(addr(1), inflight.get(addr(1)))
    assert board.values == [1.0]


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
    # Its candidates wired it to their own addresses only.
    assert set(inflight._listeners) == {addr(1), addr(2)}
    for _ in range(5):
        inflight.add(addr(9), 100)
    assert board.values == [0.0, 0.0]
    assert board.total == 0.0
    board.changed(addr(42), inflight.get(addr(42)))  # never seen at all
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


def test_a_change_that_keeps_a_subtrees_best_still_reaches_the_root() -> None:
    # The walk up the tree stops early only when a node's best is unchanged and is not the
    # candidate that changed: the changed candidate's own path must always reach the root.
    instances = tuple(inst(i) for i in range(8))
    inflight = InFlight()
    for i in range(1, 8):
        for _ in range(10):
            inflight.add(addr(i), 0)
    board = board_of(instances, inflight)
    assert board.best() == 0
    # 0 stays best in every subtree holding it, while its value climbs past the others.
    for step in range(1, 12):
        inflight.add(addr(0), 0)
        assert_tree_consistent(board)
        assert board.best() == (0 if step <= 10 else 1)
    # And back down below them, one leg at a time.
    for _ in range(11):
        inflight.remove(addr(0), 0)
        assert_tree_consistent(board)
    assert board.best() == 0


def test_a_change_deep_in_one_subtree_leaves_the_others_exact() -> None:
    instances = tuple(inst(i) for i in range(16))
    inflight = InFlight()
    board = board_of(instances, inflight)
    rng = random.Random(5)
    for _ in range(500):
        i = rng.randrange(16)
        if inflight.get(addr(i)).requests and rng.random() < 0.5:
            inflight.remove(addr(i), 0)
        else:
            inflight.add(addr(i), 0)
        assert_tree_consistent(board)  # at every step, every node
        assert board.values == [float(inflight.get(addr(i)).requests) for i in range(16)]


class ScoreBoardMachine(RuleBasedStateMachine):
    """Random legs starting and ending over random candidates with random announced loads,
    some in flight before the boards are built, and boards rebuilt along the way: every kind
    of board always equals a from-scratch recomputation from the busy state at its build."""

    def __init__(self) -> None:
        super().__init__()
        self.inflight = InFlight()
        self.instances: tuple[Instance, ...] = ()
        # Each generation of boards, with the busy state when their reports were first seen.
        self.generations: list[tuple[list[Busy], dict[LoadKind, ScoreBoard]]] = []
        self.first_seen: list[Busy] | None = None
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
        early=st.lists(st.tuples(st.integers(0, 11), st.integers(0, 900)), max_size=12),
    )
    def build(self, loads: list[Load | None], strangers: int, early: list[tuple[int, int]]) -> None:
        self.instances = tuple(inst(i, load) for i, load in enumerate(loads))
        # Some legs already in flight, some on addresses the board does not hold.
        for i in range(strangers):
            self.start(100 + i, 7)
        for n, tokens in early:
            self.start(n % len(self.instances), tokens)
        self.rebuild()

    def start(self, n: int, tokens: int) -> None:
        address = addr(n)
        self.inflight.add(address, tokens)
        self.legs.append((address, tokens))

    @rule()
    def rebuild(self) -> None:
        """A new snapshot's candidate set with the same reports: its boards start from what is
        in flight now, and read the reports net of the legs there when first seen."""
        if len(self.generations) == 3:
            self.generations.pop(0)  # no longer checked (it still listens: harmless)
        if self.first_seen is None:
            self.first_seen = busy_now(self.instances, self.inflight)
        built = self.first_seen
        candidates = Candidates(self.instances, self.inflight, CAPACITY)
        self.generations.append((built, {kind: candidates.board(kind) for kind in LoadKind}))

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
        for built, boards in self.generations:
            assert set(boards) == set(LoadKind)
            for kind, board in boards.items():
                assert_board_exact(board, oracle(self.instances, self.inflight, kind, built))

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


@pytest.mark.parametrize("n", [1, 2, 7, 64, 100])
@pytest.mark.parametrize("early_legs", [0, 40])
def test_long_random_sequences_match_brute_force(n: int, early_legs: int) -> None:
    rng = random.Random(n * 100 + early_legs)
    instances = tuple(
        inst(i, Load(rng.randint(0, 9), rng.randint(0, 9), rng.random())) for i in range(n)
    )
    inflight = InFlight()
    legs: list[tuple[Address, int]] = []

    def start(address: Address, tokens: int) -> None:
        inflight.add(address, tokens)
        legs.append((address, tokens))

    for _ in range(early_legs):  # in flight before the boards: part of the announcements
        start(instances[rng.randrange(n)].http_address, rng.randint(0, 400))
    built = busy_now(instances, inflight)
    candidates = Candidates(instances, inflight, CAPACITY)
    boards = {kind: candidates.board(kind) for kind in LoadKind}
    for step in range(3000):
        if legs and rng.random() < 0.45:
            address, tokens = legs.pop(rng.randrange(len(legs)))
            inflight.remove(address, tokens)
        else:
            # Few distinct token counts: ties are common, and so are early exits.
            start(instances[rng.randrange(n)].http_address, rng.choice((0, 1, 100, 4000)))
        if step % 100 == 0 or n <= 7:
            for kind, board in boards.items():
                assert_board_exact(board, oracle(instances, inflight, kind, built))
        elif step % 10 == 0:
            for board in boards.values():
                assert board.best() == min(range(n), key=lambda i: (board.values[i], i))
    while legs:
        address, tokens = legs.pop()
        inflight.remove(address, tokens)
    assert inflight._busy == {}
    for kind, board in boards.items():
        assert_board_exact(board, oracle(instances, inflight, kind, built))
        # Every leg ended: what is left is others' load, as estimated at build.
        assert board.values == board.others


@settings(PROFILE, max_examples=100)
@given(
    counts=st.lists(st.integers(0, 6), min_size=1, max_size=20),
    announced=st.lists(st.integers(0, 6), min_size=20, max_size=20),
)
def test_a_report_first_seen_late_is_read_as_including_earlier_legs(
    counts: list[int], announced: list[int]
) -> None:
    n = len(counts)
    instances = tuple(inst(i, Load(running=announced[i])) for i in range(n))
    # The next reports, with the same counts (waiting now said): new reports all the same.
    newer = tuple(inst(i, Load(running=announced[i], waiting=0)) for i in range(n))
    inflight = InFlight()
    early = board_of(instances, inflight)
    for i, count in enumerate(counts):
        for _ in range(count):
            inflight.add(addr(i), 1)
    same = board_of(instances, inflight)
    late = board_of(newer, inflight)
    # Seen before the legs: they come on top of the announcement, on every board built while
    # that report is the latest (the legs were placed after it).
    on_top = [float(c + a) for c, a in zip(counts, announced, strict=False)]
    assert early.values == on_top
    assert same.values == on_top
    # First seen after: the announcement is taken to include them.
    assert late.values == [float(max(c, a)) for c, a in zip(counts, announced, strict=False)]
    assert early.total == sum(counts) + sum(announced[:n])
    assert late.total == sum(max(c, a) for c, a in zip(counts, announced, strict=False))
    for i, count in enumerate(counts):
        for _ in range(count):
            inflight.remove(addr(i), 1)
    assert early.values == [float(a) for a in announced[:n]]
    assert late.values == [float(max(0, a - c)) for c, a in zip(counts, announced, strict=False)]
    for board in (early, same, late):
        assert board.best() == min(range(n), key=lambda i: (board.values[i], i))


def test_rebuilt_boards_keep_others_load_until_the_next_report() -> None:
    # 3 announced, none ours: 3 others'. The proxy places 4 legs, and another instance's
    # report brings a new snapshot: this instance's report is the same, still 3 others'.
    inflight = InFlight()
    reported = inst(1, Load(running=3))
    first = board_of((reported, inst(2)), inflight)
    assert first.others == [3.0, 0.0]
    for _ in range(4):
        inflight.add(addr(1), 0)
    rebuilt = board_of((reported, inst(2, Load(running=1))), inflight)
    assert rebuilt.others == [3.0, 1.0]
    assert rebuilt.values == [7.0, 1.0]
    # Its next report holds the 4 legs and 3 others': read net of the legs then.
    fresh = board_of((inst(1, Load(running=7)), inst(2, Load(running=1))), inflight)
    assert fresh.others == [3.0, 1.0]
    assert fresh.values == [7.0, 1.0]


# ---------------------------------------------------------------------------------------------
# InFlight.report


def test_a_report_is_taken_once_with_the_legs_when_first_seen() -> None:
    inflight = InFlight()
    inflight.add(addr(1), 40)
    load = Load(running=5)
    first = inflight.report(addr(1), load)
    assert first == Report(load, Busy(1, 40), 4.0, 1.0)
    inflight.add(addr(1), 60)
    assert inflight.report(addr(1), Load(running=5)) is first  # an equal report: the same
    inflight.add(addr(1), 1)
    second = inflight.report(addr(1), Load(running=2))
    assert second.own == Busy(3, 101)
    # Averages move by REPORT_SMOOTHING towards the new report's 0 others' and 3 own.
    assert second.others_requests == pytest.approx(4.0 + REPORT_SMOOTHING * (0.0 - 4.0))
    assert second.own_requests == pytest.approx(1.0 + REPORT_SMOOTHING * (3.0 - 1.0))
    # Held apart from the live counters: later legs change nothing in it.
    inflight.remove(addr(1), 1)
    assert second.own == Busy(3, 101)


def test_reports_are_per_instance_and_forgotten_with_the_instance() -> None:
    inflight = InFlight()
    one = inflight.report(addr(1), Load(running=1))
    two = inflight.report(addr(2), Load(running=1))
    assert one is not two
    inflight.keep_reports([addr(2)])
    assert inflight.report(addr(2), Load(running=1)) is two
    again = inflight.report(addr(1), Load(running=1))
    assert again is not one and again == one  # forgotten: taken anew (no average behind it)
    assert len(inflight._reports) == 2
    inflight.keep_reports([])
    assert inflight._reports == {}


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
    assert inflight.listener_count() == 0  # lazily: nothing until a policy asks
    requests = candidates.board(LoadKind.REQUESTS)
    assert candidates.board(LoadKind.REQUESTS) is requests
    assert inflight.listener_count() == 1
    kv = candidates.board(LoadKind.KV)
    assert kv is not requests
    assert candidates.board(LoadKind.KV) is kv
    work = candidates.board(LoadKind.PREFILL_WORK)
    assert work is not requests and work is not kv
    assert candidates.board(LoadKind.PREFILL_WORK) is work
    assert inflight.listener_count() == 3
    inflight.add(addr(2), 250)
    assert requests.values == [0.0, 1.0]
    assert kv.values == [0.0, 0.25]
    assert work.values == [0.0, 250.0]


def test_kv_board_uses_the_candidates_capacity() -> None:
    inflight = InFlight()
    inflight.add(addr(1), 500)
    small = Candidates((inst(1),), inflight, 1000).board(LoadKind.KV)
    large = Candidates((inst(1),), inflight, 100_000).board(LoadKind.KV)
    assert small.values == [0.5]
    assert large.values == [0.005]
    inflight.add(addr(1), 500)
    assert small.values == [1.0]
    assert large.values == [0.01]


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


def p(n: int, load: Load | None = None) -> Instance:
    return inst(n, load, role=Role.PREFILL)


def addr_p(n: int) -> Address:
    return p(n).http_address


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
    assert pl.inflight.listener_count() == 2


def test_a_new_snapshots_announcements_are_read_net_of_the_legs_in_flight() -> None:
    pl = Planner(LeastLoaded(), LeastLoaded())
    decodes = (inst(1),)
    request = RequestFeatures("m", 10, 20)
    quiet = Snapshot(1, (p(1), p(2)), decodes)
    first, second = pl.plan(quiet, request), pl.plan(quiet, request)
    assert isinstance(first, Pair) and isinstance(second, Pair)
    assert (first.prefill.http_address, second.prefill.http_address) == (addr_p(1), addr_p(2))
    # The next reports: p1 runs our leg only; p2 runs ours and 3 of other clients.
    reported = Snapshot(2, (p(1, Load(running=1)), p(2, Load(running=4))), decodes)
    view = pl.index(reported).view("m")
    assert view.prefills is not None
    board = view.prefills.board(LoadKind.REQUESTS)
    assert board.others == [0.0, 3.0]
    assert board.values == [1.0, 4.0]  # not [2.0, 5.0]: our legs are not counted twice
    third = pl.plan(reported, request)
    assert isinstance(third, Pair)
    assert third.prefill.http_address == addr_p(1)
    assert board.values == [2.0, 4.0]
    pl.release(second.prefill.http_address, second.prefill_tokens)
    assert board.values == [2.0, 3.0]  # other clients' 3 stay until the next report


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
