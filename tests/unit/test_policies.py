"""pdproxy.pairing.policies: each selection policy on constructed candidate sets. Pure.

Policies are functions of the candidates (announced load), the proxy's legs in flight, the
request's features and a ticket; every test below builds those by hand.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from pdproxy.ids import Address
from pdproxy.pairing.candidates import Candidates
from pdproxy.pairing.features import RequestFeatures
from pdproxy.pairing.inflight import InFlight
from pdproxy.pairing.planner import Pair, Planner
from pdproxy.pairing.policies import make_policy
from pdproxy.pairing.policies.least_kv import LeastKv
from pdproxy.pairing.policies.least_loaded import LeastLoaded
from pdproxy.pairing.policies.power_of_two import PowerOfTwo, mix64
from pdproxy.pairing.policies.prefix_affinity import PrefixAffinity
from pdproxy.pairing.policies.round_robin import RoundRobin
from pdproxy.pairing.scoreboard import LoadKind
from pdproxy.registry.messages import Load, Role
from pdproxy.registry.table import Instance, Snapshot, Source

CAPACITY = 1000
NO_PREFIX = RequestFeatures("m")


def p(n: int, load: Load | None = None) -> Instance:
    return Instance(
        Role.PREFILL,
        Address(f"10.0.{n // 250}.{n % 250}", 8100),
        Address(f"10.0.{n // 250}.{n % 250}", 21001),
        Source.V1,
        model="m",
        load=load,
    )


def d(n: int, load: Load | None = None) -> Instance:
    return Instance(
        Role.DECODE,
        Address(f"10.1.0.{n}", 8200),
        Address(f"10.1.0.{n}", 22001),
        Source.V1,
        model="m",
        load=load,
    )


def cands(
    instances: tuple[Instance, ...], inflight: InFlight | None = None, capacity: int = CAPACITY
) -> Candidates:
    return Candidates(instances, inflight if inflight is not None else InFlight(), capacity)


def keyed(key: int) -> RequestFeatures:
    return RequestFeatures("m", 100, 200, key)


def keys(n: int, seed: int = 7) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# make_policy


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("round_robin", RoundRobin),
        ("least_loaded", LeastLoaded),
        ("power_of_two", PowerOfTwo),
        ("prefix_affinity", PrefixAffinity),
        ("least_kv", LeastKv),
    ],
)
def test_make_policy_builds_each_policy_by_name(name: str, cls: type) -> None:
    policy = make_policy(name)
    assert isinstance(policy, cls)
    assert policy.name == name


def test_make_policy_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown policy 'random'"):
        make_policy("random")


def test_make_policy_forwards_seed_and_load_factor() -> None:
    candidates = cands(tuple(p(i) for i in range(10)))
    seeded = make_policy("power_of_two", seed=12345)
    reference = PowerOfTwo(12345)
    default = make_policy("power_of_two")
    chosen = [seeded.choose(candidates, NO_PREFIX, t) for t in range(50)]
    assert chosen == [reference.choose(candidates, NO_PREFIX, t) for t in range(50)]
    assert chosen != [default.choose(candidates, NO_PREFIX, t) for t in range(50)]
    with pytest.raises(ValueError, match="load_factor"):
        make_policy("prefix_affinity", load_factor=0.99)
    assert isinstance(make_policy("prefix_affinity", load_factor=1.0), PrefixAffinity)


# ---------------------------------------------------------------------------------------------
# round robin


def test_round_robin_cycles_by_ticket_whatever_the_load() -> None:
    instances = (p(1, Load(running=100)), p(2), p(3, Load(waiting=7)))
    inflight = InFlight()
    inflight.add(instances[0].http_address, 0)
    candidates = cands(instances, inflight)
    policy = RoundRobin()
    assert [policy.choose(candidates, keyed(5), t) for t in range(7)] == [
        instances[t % 3] for t in range(7)
    ]
    assert policy.choose(candidates, NO_PREFIX, 3_000_000_001) == instances[3_000_000_001 % 3]


# ---------------------------------------------------------------------------------------------
# least loaded


def test_least_loaded_follows_announced_running_and_waiting() -> None:
    policy = LeastLoaded()
    instances = (
        p(1, Load(running=3, waiting=0)),
        p(2, Load(running=1, waiting=1)),
        p(3, Load(running=0, waiting=4)),
    )
    assert policy.choose(cands(instances), NO_PREFIX, 0) == instances[1]
    instances = (p(1, Load(running=2)), p(2, Load(waiting=2)), p(3, Load(running=1, waiting=2)))
    assert policy.choose(cands(instances), NO_PREFIX, 0) == instances[0]  # tie: first


def test_least_loaded_treats_unknown_load_as_idle() -> None:
    policy = LeastLoaded()
    instances = (p(1, Load(running=1)), p(2, None), p(3, Load(kv_usage=1.0)))
    assert policy.choose(cands(instances), NO_PREFIX, 0) == instances[1]


def test_least_loaded_counts_the_proxys_own_legs() -> None:
    policy = LeastLoaded()
    instances = (p(1, Load(running=2)), p(2), p(3))
    inflight = InFlight()
    candidates = cands(instances, inflight)
    chosen = []
    for _ in range(8):
        choice = policy.choose(candidates, NO_PREFIX, 0)
        chosen.append(instances.index(choice))
        inflight.add(choice.http_address, 0)
    # p1 starts with 2 announced: the others catch up first, then all take turns.
    assert chosen == [1, 2, 1, 2, 0, 1, 2, 0]
    inflight.remove(instances[2].http_address, 0)
    assert policy.choose(candidates, NO_PREFIX, 0) == instances[2]


def test_least_loaded_ignores_features_and_tickets() -> None:
    policy = LeastLoaded()
    instances = (p(1, Load(running=5)), p(2, Load(running=4)))
    candidates = cands(instances)
    assert {policy.choose(candidates, keyed(k), t) for t, k in enumerate(keys(20))} == {
        instances[1]
    }


# ---------------------------------------------------------------------------------------------
# least kv


def test_least_kv_prefers_the_emptiest_kv_cache() -> None:
    policy = LeastKv()
    instances = (d(1, Load(kv_usage=0.7)), d(2, Load(kv_usage=0.2)), d(3, Load(kv_usage=0.4)))
    assert policy.choose(cands(instances), NO_PREFIX, 0) == instances[1]


def test_least_kv_ignores_request_counts() -> None:
    policy = LeastKv()
    instances = (d(1, Load(running=100, waiting=50, kv_usage=0.1)), d(2, Load(kv_usage=0.5)))
    assert policy.choose(cands(instances), NO_PREFIX, 0) == instances[0]


def test_least_kv_shifts_as_inflight_tokens_grow() -> None:
    policy = LeastKv()
    instances = (d(1, Load(kv_usage=0.0)), d(2, Load(kv_usage=0.1)))
    inflight = InFlight()
    candidates = cands(instances, inflight, capacity=1000)
    assert policy.choose(candidates, NO_PREFIX, 0) == instances[0]
    inflight.add(instances[0].http_address, 150)  # 0.15 > 0.1
    assert policy.choose(candidates, NO_PREFIX, 0) == instances[1]
    inflight.remove(instances[0].http_address, 150)
    assert policy.choose(candidates, NO_PREFIX, 0) == instances[0]


def test_least_kv_weighs_tokens_by_capacity() -> None:
    policy = LeastKv()
    instances = (d(1, Load(kv_usage=0.0)), d(2, Load(kv_usage=0.1)))
    inflight = InFlight()
    inflight.add(instances[0].http_address, 150)
    assert policy.choose(cands(instances, inflight, 1000), NO_PREFIX, 0) == instances[1]
    assert policy.choose(cands(instances, inflight, 10_000), NO_PREFIX, 0) == instances[0]


def test_least_kv_through_the_planner_spreads_by_decode_tokens() -> None:
    prefills = (p(1),)
    decodes = (d(1, Load(kv_usage=0.0)), d(2, Load(kv_usage=0.05)))
    snapshot = Snapshot(1, prefills, decodes)
    planner = Planner(RoundRobin(), LeastKv(), kv_capacity_tokens=1000)
    chosen = []
    for _ in range(4):
        result = planner.plan(snapshot, RequestFeatures("m", 10, 30))
        assert isinstance(result, Pair)
        chosen.append(result.decode)
    # d1: 0.0 -> 0.03 -> 0.06 > 0.05 -> d2 (0.08) -> d1 (0.09)
    assert chosen == [decodes[0], decodes[0], decodes[1], decodes[0]]
    planner.release(decodes[1].http_address, 30)
    result = planner.plan(snapshot, RequestFeatures("m", 10, 30))
    assert isinstance(result, Pair)
    assert result.decode == decodes[1]


# ---------------------------------------------------------------------------------------------
# power of two


def draws(ticket: int, seed: int, n: int) -> tuple[int, int]:
    """The two candidates PowerOfTwo draws, re-derived from mix64."""
    draw = mix64(ticket ^ seed)
    first = draw % n
    second = (draw >> 32) % (n - 1)
    return first, second + (second >= first)


def test_mix64_is_splitmix64() -> None:
    # splitmix64's first three outputs from state 0 (Vigna's reference implementation).
    golden = 0x9E3779B97F4A7C15
    mask = (1 << 64) - 1
    assert mix64(0) == 0xE220A8397B1DCDAF
    assert mix64(golden) == 0x6E789E6AA1B965F4
    assert mix64((2 * golden) & mask) == 0x06C45D188009454F


def test_power_of_two_with_one_candidate() -> None:
    only = p(1, Load(running=9))
    candidates = cands((only,))
    assert {PowerOfTwo(s).choose(candidates, NO_PREFIX, t) for s in range(3) for t in range(9)} == {
        only
    }


def test_power_of_two_is_close_to_uniform_over_an_idle_fleet() -> None:
    n, rounds = 8, 16_000
    candidates = cands(tuple(p(i) for i in range(n)))
    policy = PowerOfTwo(seed=3)
    counts = Counter(policy.choose(candidates, NO_PREFIX, t) for t in range(rounds))
    assert len(counts) == n
    expected = rounds / n
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    assert chi2 < 24.3  # chi-square, 7 degrees of freedom, p = 0.001
    assert all(abs(c - expected) < 0.1 * expected for c in counts.values())


@pytest.mark.parametrize("n", [2, 3, 5, 16])
@pytest.mark.parametrize("seed", [0, 1, 0xDEADBEEF])
def test_power_of_two_never_picks_the_more_loaded_of_its_draws(n: int, seed: int) -> None:
    rng = random.Random(n * 1000 + seed)
    instances = tuple(p(i, Load(running=rng.randint(0, 3))) for i in range(n))
    inflight = InFlight()
    candidates = cands(instances, inflight)
    values = candidates.board(LoadKind.REQUESTS).values
    policy = PowerOfTwo(seed)
    for ticket in range(600):
        if ticket % 7 == 0:  # loads move between decisions
            inflight.add(instances[rng.randrange(n)].http_address, 0)
        first, second = draws(ticket, seed, n)
        assert first != second
        choice = instances.index(policy.choose(candidates, NO_PREFIX, ticket))
        assert choice in (first, second)
        other = second if choice == first else first
        assert values[choice] <= values[other]
        if values[first] == values[second]:
            assert choice == first


def test_power_of_two_never_picks_the_unique_most_loaded() -> None:
    n = 6
    instances = tuple(p(i, Load(running=i)) for i in range(n))
    candidates = cands(instances)
    policy = PowerOfTwo(seed=11)
    counts = Counter(
        instances.index(policy.choose(candidates, NO_PREFIX, t)) for t in range(15_000)
    )
    assert counts[n - 1] == 0
    # Rank k (0 = least loaded) wins when drawn with a more loaded one:
    # P = 2 (n - 1 - k) / (n (n - 1)).
    total = sum(counts.values())
    for k in range(n - 1):
        expected = total * 2 * (n - 1 - k) / (n * (n - 1))
        assert abs(counts[k] - expected) < 0.1 * expected, (k, counts)


def test_power_of_two_is_deterministic_per_ticket_and_seed() -> None:
    candidates = cands(tuple(p(i) for i in range(7)))
    a = [PowerOfTwo(42).choose(candidates, NO_PREFIX, t) for t in range(200)]
    b = [PowerOfTwo(42).choose(candidates, NO_PREFIX, t) for t in range(200)]
    c = [PowerOfTwo(43).choose(candidates, NO_PREFIX, t) for t in range(200)]
    assert a == b
    assert a != c
    # The features do not matter, only the ticket.
    assert a == [PowerOfTwo(42).choose(candidates, keyed(t), t) for t in range(200)]


def test_power_of_two_keeps_inflight_legs_even() -> None:
    n = 10
    instances = tuple(p(i) for i in range(n))
    inflight = InFlight()
    candidates = cands(instances, inflight)
    policy = PowerOfTwo(seed=5)
    for ticket in range(2000):
        inflight.add(policy.choose(candidates, NO_PREFIX, ticket).http_address, 0)
    loads = [inflight.get(i.http_address).requests for i in instances]
    assert sum(loads) == 2000
    # Two choices keep the gap O(log log n); one random choice would be about 3 sqrt(200).
    assert max(loads) - min(loads) <= 4, loads


# ---------------------------------------------------------------------------------------------
# prefix affinity


def owners(policy: PrefixAffinity, instances: tuple[Instance, ...], ks: list[int]) -> list[str]:
    """Where each key goes over an idle fleet, by instance name."""
    candidates = cands(instances)
    return [policy.choose(candidates, keyed(k), 0).name for k in ks]


def test_prefix_affinity_rejects_load_factor_below_one() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        PrefixAffinity(0.5)


def test_same_prefix_lands_on_the_same_prefill_while_balanced() -> None:
    policy = PrefixAffinity()
    instances = tuple(p(i) for i in range(8))
    inflight = InFlight()
    candidates = cands(instances, inflight)
    ks = keys(50)
    home = {key: policy.choose(candidates, keyed(key), 0) for key in ks}
    for ticket in range(1, 4):
        for key in ks:
            # Each leg ends before the next starts.
            choice = policy.choose(candidates, keyed(key), ticket)
            assert choice == home[key]
            inflight.add(choice.http_address, 100)
            inflight.remove(choice.http_address, 100)
        # Every instance equally busy with other work: still balanced, still home.
        for instance in instances:
            inflight.add(instance.http_address, 100)
    assert all(policy.choose(candidates, keyed(key), 9) == home[key] for key in ks)


def test_prefix_affinity_ignores_ticket_and_token_counts() -> None:
    policy = PrefixAffinity()
    candidates = cands(tuple(p(i) for i in range(5)))
    for key in keys(30):
        chosen = {
            policy.choose(candidates, RequestFeatures("m", tokens, 2 * tokens, key), ticket)
            for ticket, tokens in ((0, 1), (7, 10), (99, 10_000))
        }
        assert len(chosen) == 1


def test_distinct_prefixes_spread_evenly() -> None:
    n = 8
    counts = Counter(owners(PrefixAffinity(), tuple(p(i) for i in range(n)), keys(10_000)))
    assert len(counts) == n
    mean = 10_000 / n
    assert all(0.6 * mean <= c <= 1.5 * mean for c in counts.values()), counts


def test_mapping_does_not_depend_on_candidate_order() -> None:
    instances = tuple(p(i) for i in range(6))
    shuffled = list(instances)
    random.Random(3).shuffle(shuffled)
    ks = keys(2000)
    assert owners(PrefixAffinity(), instances, ks) == owners(PrefixAffinity(), tuple(shuffled), ks)


@pytest.mark.parametrize("n", [4, 8, 16])
def test_adding_one_prefill_moves_about_one_in_n_plus_one(n: int) -> None:
    policy = PrefixAffinity()
    ks = keys(10_000, seed=n)
    before = owners(policy, tuple(p(i) for i in range(n)), ks)
    newcomer = p(n)
    # The newcomer is placed first: positions shift, names must not.
    after = owners(policy, (newcomer, *(p(i) for i in range(n))), ks)
    moved = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    assert all(b == newcomer.name for _, b in moved)  # keys only ever move to the newcomer
    assert len(moved) / len(ks) <= 1 / (n + 1) + 0.05
    assert len(moved) / len(ks) >= 1 / (n + 1) / 2  # and the newcomer does get its share


@pytest.mark.parametrize("n", [4, 8, 16])
def test_removing_one_prefill_moves_only_its_keys(n: int) -> None:
    policy = PrefixAffinity()
    instances = tuple(p(i) for i in range(n))
    ks = keys(5000, seed=100 + n)
    before = owners(policy, instances, ks)
    gone = instances[n // 2]  # from the middle: positions after it shift
    after = owners(policy, tuple(i for i in instances if i != gone), ks)
    for a, b in zip(before, after, strict=True):
        if a == gone.name:
            assert b != gone.name
        else:
            assert b == a
    # The orphaned keys spread over several survivors, not onto one neighbour.
    assert len({b for a, b in zip(before, after, strict=True) if a == gone.name}) >= min(3, n - 1)


@pytest.mark.parametrize("n", [2, 3, 8])
@pytest.mark.parametrize("load_factor", [1.0, 1.25, 1.5, 2.0])
def test_flooding_one_prefix_respects_the_load_bound(n: int, load_factor: float) -> None:
    policy = PrefixAffinity(load_factor)
    instances = tuple(p(i) for i in range(n))
    inflight = InFlight()
    candidates = cands(instances, inflight)
    hot = keyed(0x1234_5678_9ABC_DEF0)
    home = policy.choose(candidates, hot, 0)
    spilled: set[Instance] = set()
    for ticket in range(300):
        choice = policy.choose(candidates, hot, ticket)
        inflight.add(choice.http_address, 1)  # the legs stay in flight
        spilled.add(choice)
        total = ticket + 1
        bound = math.ceil(load_factor * total / n)
        loads = [inflight.get(i.http_address).requests for i in instances]
        assert max(loads) <= bound, (ticket, loads, bound)
    loads = [inflight.get(i.http_address).requests for i in instances]
    # The prefix's own instance carries the most; at load factor 1 everyone is even.
    assert inflight.get(home.http_address).requests == max(loads)
    if load_factor == 1.0:
        assert max(loads) - min(loads) <= 1


def test_hot_prefix_spills_to_few_neighbours_first() -> None:
    n = 8
    policy = PrefixAffinity(1.25)
    instances = tuple(p(i) for i in range(n))
    inflight = InFlight()
    candidates = cands(instances, inflight)
    # Every instance busy with 10 legs of other prefixes: the cap leaves room for a few more.
    for instance in instances:
        for _ in range(10):
            inflight.add(instance.http_address, 1)
    hot = keyed(42)
    seen = []
    for ticket in range(12):
        choice = policy.choose(candidates, hot, ticket)
        inflight.add(choice.http_address, 1)
        seen.append(choice)
    # The cap, ceil(1.25 (80 + k + 1) / 8), rises from 13 to 15 over these 12 legs: the
    # prefix's home takes the first few, then its ring successors, never the whole fleet.
    home = policy.choose(cands(instances), hot, 0)
    assert seen[:3] == [home] * 3
    assert 2 <= len(set(seen)) <= 3


def test_overloaded_home_is_passed_over() -> None:
    policy = PrefixAffinity(1.25)
    instances = tuple(p(i) for i in range(4))
    key = keyed(987654321)
    home = policy.choose(cands(instances), key, 0)
    hot = tuple(
        p(i, Load(running=100)) if inst == home else inst for i, inst in enumerate(instances)
    )
    choice = policy.choose(cands(hot), key, 0)
    assert choice.http_address != home.http_address
    # Announced load relieved: the key goes home again.
    assert policy.choose(cands(instances), key, 0) == home


def test_no_prefix_goes_to_the_least_loaded() -> None:
    policy = PrefixAffinity()
    instances = (p(1, Load(running=3)), p(2, Load(running=1)), p(3, Load(running=2)))
    inflight = InFlight()
    candidates = cands(instances, inflight)
    assert policy.choose(candidates, NO_PREFIX, 0) == instances[1]
    inflight.add(instances[1].http_address, 0)
    inflight.add(instances[1].http_address, 0)
    assert policy.choose(candidates, NO_PREFIX, 0) == instances[2]


def test_single_candidate_always_wins() -> None:
    only = p(1, Load(running=1000))
    candidates = cands((only,))
    policy = PrefixAffinity()
    assert {policy.choose(candidates, keyed(k), 0) for k in keys(20)} == {only}


def test_rings_are_reused_for_the_same_membership_and_bounded() -> None:
    policy = PrefixAffinity()
    members = tuple(p(i) for i in range(5))
    # A load-only snapshot change: same addresses, new instances, new candidate sets.
    reloaded = tuple(p(i, Load(running=i)) for i in range(5))
    policy.choose(cands(members), keyed(1), 0)
    (ring,) = policy._rings.values()
    policy.choose(cands(reloaded), keyed(1), 0)
    assert list(policy._rings.values()) == [ring]
    assert next(iter(policy._rings.values())) is ring  # reused, not rebuilt
    for extra in range(10):
        policy.choose(cands((*members, p(10 + extra))), keyed(1), 0)
    assert len(policy._rings) <= 4
    ks = keys(500)
    assert owners(policy, members, ks) == owners(PrefixAffinity(), members, ks)


def test_prefix_affinity_through_the_planner_keeps_conversations_home() -> None:
    prefills = tuple(p(i) for i in range(6))
    decodes = (d(1), d(2))
    snapshot = Snapshot(1, prefills, decodes)
    planner = Planner(make_policy("prefix_affinity"), make_policy("least_kv"))
    homes: dict[int, set[Instance]] = {}
    for _ in range(5):
        for key in keys(40):
            result = planner.plan(snapshot, keyed(key))
            assert isinstance(result, Pair)
            homes.setdefault(key, set()).add(result.prefill)
            # Each request finishes before the next: loads stay balanced.
            planner.release(result.prefill.http_address, result.prefill_tokens)
            planner.release(result.decode.http_address, result.decode_tokens)
    assert all(len(home) == 1 for home in homes.values())
    assert len({next(iter(home)) for home in homes.values()}) >= 4
    assert planner.inflight.total_requests() == 0
