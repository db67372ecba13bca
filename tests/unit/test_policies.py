"""pdproxy.pairing.policies: each selection policy on constructed candidate sets. Pure.

Policies are functions of the candidates (announced load), the proxy's legs in flight, the
request's features and a ticket; every test below builds those by hand.

Load-based policies score an instance as the proxy's own legs there now plus others' load: the
announcement less the proxy's legs there when the candidate set's board was built (never
below 0), the report first seen). Prefix affinity balances prefill work: the prompt tokens of
the proxy's legs, less what each prefill probably holds cached (the planner's PrefixCache),
scaled by the fleet's share of others' requests in the reports.
"""

from __future__ import annotations

import bisect
import hashlib
import random
import secrets
from collections import Counter
from collections.abc import Callable

import pytest

from pdproxy.base.roles import Role
from pdproxy.config import Settings
from pdproxy.ids import Address
from pdproxy.pairing.candidates import Candidates
from pdproxy.pairing.features import PrefixWindow, RequestFeatures
from pdproxy.pairing.inflight import InFlight
from pdproxy.pairing.planner import Pair, Planner
from pdproxy.pairing.policies import make_policy
from pdproxy.pairing.policies.least_kv import LeastKv
from pdproxy.pairing.policies.least_loaded import LeastLoaded
from pdproxy.pairing.policies.power_of_two import PowerOfTwo, mix64
from pdproxy.pairing.policies.prefix_affinity import (
    _RINGS_KEPT,
    MAX_WALK,
    VIRTUAL_NODES,
    PrefixAffinity,
    build_ring,
    instance_points,
)
from pdproxy.pairing.policies.round_robin import RoundRobin
from pdproxy.pairing.prefix_cache import PrefixCache
from pdproxy.pairing.scoreboard import LoadKind
from pdproxy.proxy.state import planner_from
from pdproxy.registry.messages import Load
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


def keyed(tokens: int, key: int | None) -> tuple[PrefixWindow, ...]:
    """A prompt of `tokens` tokens whose first (and only) prefix window hashes to `key`: the
    key places the request on the ring; None is a request without a prefix."""
    return () if key is None else (PrefixWindow(min(256, tokens), key),)


def req(key: int) -> RequestFeatures:
    return RequestFeatures("m", 100, 200, keyed(100, key))


def key_of(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "big")


def chain(
    tokens: int, lead: int, shared: int | None = None, branch: object = None
) -> tuple[PrefixWindow, ...]:
    """The windows request_features gives a prompt of `tokens` tokens: 256, 512 ... tokens (at
    most 6, none for an empty prompt), the last one cut at the whole prompt. Its first `shared`
    tokens (all of them when None) are the lead `lead`, common to every prompt of that lead;
    the rest is its own (`branch`). The first window's key is `lead` itself (while within the
    lead): it places the request on the ring as req(lead) does."""
    windows: list[PrefixWindow] = []
    cut = 256
    while tokens > 0 and len(windows) < 6 and (not windows or windows[-1].tokens < tokens):
        size = min(cut, tokens)
        if shared is not None and size > shared:
            key = key_of(lead, branch, size)
        elif not windows:
            key = lead
        else:
            key = key_of(lead, size)
        windows.append(PrefixWindow(size, key))
        cut *= 2
    return tuple(windows)


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
    assert [policy.choose(candidates, req(5), t) for t in range(7)] == [
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


def test_least_loaded_counts_the_proxys_legs_started_since_the_board_on_top() -> None:
    policy = LeastLoaded()
    instances = (p(1, Load(running=2)), p(2), p(3))
    inflight = InFlight()
    candidates = cands(instances, inflight)
    chosen = []
    for _ in range(8):
        choice = policy.choose(candidates, NO_PREFIX, 0)
        chosen.append(instances.index(choice))
        inflight.add(choice.http_address, 0)
    # p1 announced 2 with none of the proxy's legs there at build: 2 is others' load, and
    # every leg since comes on top. The others catch up first, then all take turns.
    assert chosen == [1, 2, 1, 2, 0, 1, 2, 0]
    assert candidates.board(LoadKind.REQUESTS).values == [4.0, 3.0, 3.0]
    inflight.remove(instances[2].http_address, 0)
    assert policy.choose(candidates, NO_PREFIX, 0) == instances[2]


def test_least_loaded_reads_announcements_as_including_legs_in_flight_at_build() -> None:
    policy = LeastLoaded()
    # p1 announced 2 while the proxy had 3 legs there: it scores 3 (others: max(0, 2 - 3)),
    # not 5. p2 announced 4 with no leg of the proxy's: 4 of other clients.
    instances = (p(1, Load(running=2)), p(2, Load(running=4)))
    inflight = InFlight()
    for _ in range(3):
        inflight.add(instances[0].http_address, 0)
    candidates = cands(instances, inflight)
    assert candidates.board(LoadKind.REQUESTS).values == [3.0, 4.0]
    assert policy.choose(candidates, NO_PREFIX, 0) == instances[0]
    inflight.add(instances[0].http_address, 0)
    assert policy.choose(candidates, NO_PREFIX, 0) == instances[0]  # 4 vs 4: the first
    inflight.add(instances[0].http_address, 0)
    assert policy.choose(candidates, NO_PREFIX, 0) == instances[1]  # 5 vs 4
    # Legs ending do not bring the announcement back: p1 drops to its own legs only.
    for _ in range(5):
        inflight.remove(instances[0].http_address, 0)
    assert candidates.board(LoadKind.REQUESTS).values == [0.0, 4.0]
    # p2's announcement stays on top of legs the proxy starts there after the build.
    for _ in range(2):
        inflight.add(instances[1].http_address, 0)
    for _ in range(5):
        inflight.add(instances[0].http_address, 0)
    assert candidates.board(LoadKind.REQUESTS).values == [5.0, 6.0]
    assert policy.choose(candidates, NO_PREFIX, 0) == instances[0]


def test_least_loaded_ignores_features_and_tickets() -> None:
    policy = LeastLoaded()
    instances = (p(1, Load(running=5)), p(2, Load(running=4)))
    candidates = cands(instances)
    assert {policy.choose(candidates, req(k), t) for t, k in enumerate(keys(20))} == {instances[1]}


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


def test_least_kv_reads_usage_as_including_tokens_in_flight_at_build() -> None:
    policy = LeastKv()
    instances = (d(1, Load(kv_usage=0.5)), d(2, Load(kv_usage=0.45)))
    inflight = InFlight()
    inflight.add(instances[0].http_address, 300)  # 0.3 of the KV, already in the 0.5
    candidates = cands(instances, inflight, capacity=1000)
    board = candidates.board(LoadKind.KV)
    assert board.values == pytest.approx([0.5, 0.45])
    assert policy.choose(candidates, NO_PREFIX, 0) == instances[1]
    inflight.remove(instances[0].http_address, 300)  # d1: 0.2 of other clients' KV left
    assert board.values == pytest.approx([0.2, 0.45])
    assert policy.choose(candidates, NO_PREFIX, 0) == instances[0]
    inflight.add(instances[1].http_address, 100)  # d2: 0.45 + 0.1 on top
    inflight.add(instances[0].http_address, 400)  # d1: 0.2 + 0.4
    assert board.values == pytest.approx([0.6, 0.55])
    assert policy.choose(candidates, NO_PREFIX, 0) == instances[1]


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


def running(instance: Instance) -> int:
    load = instance.load
    return 0 if load is None or load.running is None else load.running


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
    built = []
    for instance in instances:  # some legs in flight before the board
        for _ in range(rng.randint(0, 4)):
            inflight.add(instance.http_address, 0)
        built.append(inflight.get(instance.http_address).requests)
    candidates = cands(instances, inflight)
    candidates.board(LoadKind.REQUESTS)  # boards are built on first use: build it now
    policy = PowerOfTwo(seed)
    for ticket in range(600):
        if ticket % 7 == 0:  # loads move between decisions
            inflight.add(instances[rng.randrange(n)].http_address, 0)
        # Restated: own legs now plus others' (announced less own legs at build, if any).
        values = [
            inflight.get(i.http_address).requests + max(0, running(i) - before)
            for i, before in zip(instances, built, strict=True)
        ]
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


def test_power_of_two_scores_announced_load_net_of_legs_at_build() -> None:
    # Two candidates: every draw is both, so the less loaded always wins (ties: the first).
    instances = (p(1, Load(running=2)), p(2, Load(running=3)))
    inflight = InFlight()
    candidates = cands(instances, inflight)
    policy = PowerOfTwo(seed=1)
    firsts = {draws(t, 1, 2)[0] for t in range(40)}
    assert firsts == {0, 1}  # both orders are drawn
    assert {policy.choose(candidates, NO_PREFIX, t) for t in range(40)} == {instances[0]}
    inflight.add(instances[0].http_address, 0)  # p1: 2 + 1 = 3 vs 3
    assert [policy.choose(candidates, NO_PREFIX, t) for t in range(40)] == [
        instances[draws(t, 1, 2)[0]] for t in range(40)
    ]
    inflight.add(instances[0].http_address, 0)  # p1: 2 + 2 = 4 vs 3
    assert {policy.choose(candidates, NO_PREFIX, t) for t in range(40)} == {instances[1]}
    # A board rebuilt with the same reports reads them as it did: p1 still 4 vs 3.
    rebuilt = cands(instances, inflight)
    assert {policy.choose(rebuilt, NO_PREFIX, t) for t in range(40)} == {instances[1]}
    # p1's next report, first seen now, holds its 2 legs: 2 vs 3.
    reported = (p(1, Load(running=2, waiting=0)), instances[1])
    assert {policy.choose(cands(reported, inflight), NO_PREFIX, t) for t in range(40)} == {
        reported[0]
    }


def test_power_of_two_is_deterministic_per_ticket_and_seed() -> None:
    candidates = cands(tuple(p(i) for i in range(7)))
    a = [PowerOfTwo(42).choose(candidates, NO_PREFIX, t) for t in range(200)]
    b = [PowerOfTwo(42).choose(candidates, NO_PREFIX, t) for t in range(200)]
    c = [PowerOfTwo(43).choose(candidates, NO_PREFIX, t) for t in range(200)]
    assert a == b
    assert a != c
    # The features do not matter, only the ticket.
    assert a == [PowerOfTwo(42).choose(candidates, req(t), t) for t in range(200)]


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

# The design, restated independently of the module: each instance owns 64 ring points, the
# 8-byte little-endian words of shake_128(str(address)); a key (the request's first prefix
# window's) walks the ring clockwise from bisect_left(points, key) for at most 8 points and
# takes the first owner whose prefill work in flight plus its work for this request would stay
# within
#     cap = max(load_factor * (total + full) / n, least + full),   full = max(1, prompt_tokens);
# else the least loaded. An owner's work for the request is `full` less the tokens of the
# request's longest window it probably holds (it was recorded there). Loads are the prefill
# work of the proxy's own legs in flight, nothing announced. A Candidates built without a
# prefix cache (cands() below) has an empty one: every owner's work is the whole prompt.

Held = dict[int, set[Address]]  # the oracle's prefix cache: window key -> its holders


def ring_words(address: Address) -> list[int]:
    stream = hashlib.shake_128(str(address).encode()).digest(8 * 64)
    return [int.from_bytes(stream[k : k + 8], "little") for k in range(0, len(stream), 8)]


def walk(instances: tuple[Instance, ...], key: int) -> list[int]:
    """Every ring point's owner (a candidate position), clockwise from where `key` lands."""
    ring = sorted(
        (point, position)
        for position, instance in enumerate(instances)
        for point in ring_words(instance.http_address)
    )
    start = bisect.bisect_left([point for point, _ in ring], key)
    return [ring[(start + step) % len(ring)][1] for step in range(len(ring))]


def distinct(owners: list[int]) -> list[int]:
    return list(dict.fromkeys(owners))


def prompt_loads(instances: tuple[Instance, ...], inflight: InFlight) -> list[int]:
    """Prefill work in flight per instance (InFlight's tokens: what the legs added)."""
    return [inflight.get(i.http_address).tokens for i in instances]


def held_tokens(held: Held, windows: tuple[PrefixWindow, ...], address: Address) -> int:
    return max((w.tokens for w in windows if address in held.get(w.key, ())), default=0)


def hold(held: Held, windows: tuple[PrefixWindow, ...], address: Address) -> None:
    for window in windows:
        held.setdefault(window.key, set()).add(address)


def expected_choice(
    instances: tuple[Instance, ...],
    inflight: InFlight,
    request: RequestFeatures,
    load_factor: float,
    held: Held | None = None,
) -> int:
    loads = prompt_loads(instances, inflight)
    least = min(range(len(loads)), key=lambda i: (loads[i], i))
    if request.prefix_key is None or len(instances) == 1:
        return least
    full = max(1, request.prompt_tokens)
    cap = max(load_factor * (sum(loads) + full) / len(loads), loads[least] + full)
    for owner in walk(instances, request.prefix_key)[:8]:
        address = instances[owner].http_address
        cached = held_tokens(held, request.prefix_windows, address) if held else 0
        if loads[owner] + full - cached <= cap:
            return owner
    return least


def home_of(instances: tuple[Instance, ...], key: int) -> Instance:
    return instances[walk(instances, key)[0]]


def owners(policy: PrefixAffinity, instances: tuple[Instance, ...], ks: list[int]) -> list[str]:
    """Where each key goes over an idle fleet, by instance name."""
    candidates = cands(instances)
    return [policy.choose(candidates, req(k), 0).name for k in ks]


def test_prefix_affinity_rejects_load_factor_below_one() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        PrefixAffinity(0.5)


@pytest.mark.parametrize("n", [0, 1, 249, 250, 777])
def test_instance_points_are_64_shake_128_words(n: int) -> None:
    address = p(n).http_address
    assert VIRTUAL_NODES == 64
    points = list(instance_points(address))
    assert points == ring_words(address)
    assert len(set(points)) == 64
    assert all(0 <= point < 1 << 64 for point in points)
    assert points != list(instance_points(p(n + 1).http_address))


def test_build_ring_sorts_every_instances_points_with_their_owner() -> None:
    instances = tuple(p(i) for i in range(5))
    addresses = tuple(i.http_address for i in instances)
    ring = build_ring(addresses)
    placed = sorted(
        (point, position)
        for position, address in enumerate(addresses)
        for point in ring_words(address)
    )
    assert ring.points == [point for point, _ in placed]
    assert ring.owners == [position for _, position in placed]
    assert Counter(ring.owners) == dict.fromkeys(range(5), 64)


def test_same_prefix_lands_on_the_same_prefill_while_balanced() -> None:
    policy = PrefixAffinity()
    instances = tuple(p(i) for i in range(8))
    inflight = InFlight()
    candidates = cands(instances, inflight)
    ks = keys(50)
    home = {key: policy.choose(candidates, req(key), 0) for key in ks}
    assert home == {key: home_of(instances, key) for key in ks}  # the ring's owner
    for ticket in range(1, 4):
        for key in ks:
            # Each leg ends before the next starts.
            choice = policy.choose(candidates, req(key), ticket)
            assert choice == home[key]
            inflight.add(choice.http_address, 100)
            inflight.remove(choice.http_address, 100)
        # Every instance equally busy with other work: still balanced, still home.
        for instance in instances:
            inflight.add(instance.http_address, 100)
    assert all(policy.choose(candidates, req(key), 9) == home[key] for key in ks)


@pytest.mark.parametrize("load_factor", [1.0, 1.25, 3.0])
@pytest.mark.parametrize("background", [0, 1, 5000])
def test_an_evenly_loaded_fleet_honours_the_prefix_whatever_the_prompts_size(
    load_factor: float, background: int
) -> None:
    # Even when the prompt alone would put its home above load_factor x the mean: the home
    # would hold no more than the least loaded instance would.
    instances = tuple(p(i, Load(running=i, waiting=i, kv_usage=0.9)) for i in range(6))
    inflight = InFlight()
    for instance in instances:
        if background:
            inflight.add(instance.http_address, background)
    candidates = cands(instances, inflight)
    policy = PrefixAffinity(load_factor)
    for key in [*keys(40), 0, (1 << 64) - 1]:
        for tokens in (0, 1, 100, 10**6):
            request = RequestFeatures("m", tokens, 2 * tokens, keyed(tokens, key))
            assert policy.choose(candidates, request, 0) == home_of(instances, key)


def test_prefix_affinity_ignores_ticket_and_token_counts() -> None:
    policy = PrefixAffinity()
    instances = tuple(p(i) for i in range(5))
    candidates = cands(instances)
    for key in keys(30):
        chosen = {
            policy.choose(
                candidates, RequestFeatures("m", tokens, 2 * tokens, keyed(tokens, key)), ticket
            )
            for ticket, tokens in ((0, 1), (7, 10), (99, 10_000))
        }
        assert chosen == {home_of(instances, key)}


def test_keys_past_the_last_point_wrap_to_the_first() -> None:
    instances = tuple(p(i) for i in range(4))
    ring = build_ring(tuple(i.http_address for i in instances))
    candidates = cands(instances)
    policy = PrefixAffinity()
    first, last = ring.points[0], ring.points[-1]
    assert policy.choose(candidates, req(last + 1), 0) == instances[ring.owners[0]]
    assert policy.choose(candidates, req((1 << 64) - 1), 0) == instances[ring.owners[0]]
    assert policy.choose(candidates, req(0), 0) == instances[ring.owners[0]]
    # A key equal to a point belongs to that point's owner (bisect_left), one past it to the
    # next point's.
    for k in (0, 1, len(ring.points) // 2, len(ring.points) - 2):
        point = ring.points[k]
        assert policy.choose(candidates, req(point), 0) == instances[ring.owners[k]]
        assert policy.choose(candidates, req(point + 1), 0) == instances[ring.owners[k + 1]]
    assert first < last


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


HOT = 0x1234_5678_9ABC_DEF0


@pytest.mark.parametrize("n", [2, 3, 8])
@pytest.mark.parametrize("load_factor", [1.0, 1.25, 1.5, 2.0])
@pytest.mark.parametrize("work", [1, 100, 5000])
def test_flooding_one_prefix_respects_the_load_bound(n: int, load_factor: float, work: int) -> None:
    policy = PrefixAffinity(load_factor)
    instances = tuple(p(i) for i in range(n))
    inflight = InFlight()
    candidates = cands(instances, inflight)
    hot = RequestFeatures("m", work, 2 * work, keyed(work, HOT))
    home = home_of(instances, HOT)
    for ticket in range(300):
        before = prompt_loads(instances, inflight)
        bound = max(load_factor * (sum(before) + work) / n, min(before) + work)
        choice = policy.choose(candidates, hot, ticket)
        assert instances.index(choice) == expected_choice(instances, inflight, hot, load_factor)
        inflight.add(choice.http_address, work)  # the legs stay in flight
        after = prompt_loads(instances, inflight)
        assert after[instances.index(choice)] <= bound, (ticket, before, bound)
        assert max(after) <= max(bound, *before)
    loads = prompt_loads(instances, inflight)
    assert sum(loads) == 300 * work
    # The prefix's own instance carries the most; at load factor 1 everyone is even.
    assert inflight.get(home.http_address).tokens == max(loads)
    if load_factor == 1.0:
        assert max(loads) - min(loads) <= work
    else:
        assert max(loads) > min(loads) + work  # the home keeps more than its even share


@pytest.mark.parametrize("load_factor", [1.0, 1.25, 2.0])
def test_flooding_with_prompts_of_every_size_respects_the_load_bound(load_factor: float) -> None:
    rng = random.Random(int(load_factor * 100))
    n = 6
    policy = PrefixAffinity(load_factor)
    instances = tuple(p(i) for i in range(n))
    inflight = InFlight()
    candidates = cands(instances, inflight)
    legs: list[tuple[Instance, int]] = []
    for ticket in range(500):
        if legs and rng.random() < 0.2:  # some legs end, most stay
            instance, tokens = legs.pop(rng.randrange(len(legs)))
            inflight.remove(instance.http_address, tokens)
        tokens = rng.choice((0, 1, 30, 700, 4000))
        key = rng.choice((HOT, HOT, HOT, 77))
        request = RequestFeatures("m", tokens, tokens, keyed(tokens, key))
        work = max(1, tokens)
        before = prompt_loads(instances, inflight)
        bound = max(load_factor * (sum(before) + work) / n, min(before) + work)
        choice = policy.choose(candidates, request, ticket)
        assert instances.index(choice) == expected_choice(instances, inflight, request, load_factor)
        inflight.add(choice.http_address, tokens)
        legs.append((choice, tokens))
        assert before[instances.index(choice)] + work <= bound


def test_the_bound_is_inclusive_and_counts_the_requests_work() -> None:
    # 4 instances, load factor 2: cap = max(2 (total + work) / 4, least + work).
    instances = tuple(p(i) for i in range(4))
    home = walk(instances, HOT)[0]
    successor = distinct(walk(instances, HOT))[1]
    policy = PrefixAffinity(2.0)

    def choose(home_tokens: int, work: int) -> Instance:
        inflight = InFlight()
        for position in range(4):
            inflight.add(instances[position].http_address, 100)
        inflight.add(instances[home].http_address, home_tokens - 100)
        return policy.choose(
            cands(instances, inflight), RequestFeatures("m", work, 0, keyed(work, HOT)), 0
        )

    # home 200, others 100: cap = 2 x 600 / 4 = 300 and 200 + 100 <= 300: home.
    assert choose(200, 100) == instances[home]
    # home 201: cap = 2 x 601 / 4 = 300.5 < 301: passed over for the ring's next owner.
    assert choose(201, 100) == instances[successor]
    # A smaller prompt fits: home 201, work 99: cap = 2 x 600 / 4 = 300 >= 300.
    assert choose(201, 99) == instances[home]


def test_an_empty_prompt_still_weighs_one_token() -> None:
    instances = tuple(p(i) for i in range(4))
    order = distinct(walk(instances, HOT))
    home, idle = order[0], order[3]
    inflight = InFlight()
    inflight.add(instances[home].http_address, 5)
    inflight.add(instances[order[1]].http_address, 6)
    inflight.add(instances[order[2]].http_address, 6)
    candidates = cands(instances, inflight)
    policy = PrefixAffinity(1.25)
    # Counted as 0 tokens, home would fit: 5 <= 1.25 x 17 / 4 = 5.3125. As 1 it does not:
    # 6 > 1.25 x 18 / 4 = 5.625, nor do its neighbours (7); the idle instance does.
    empty = RequestFeatures("m", 0, 10, keyed(0, HOT))
    assert policy.choose(candidates, empty, 0) == instances[idle]
    assert expected_choice(instances, inflight, empty, 1.25) == idle


def test_hot_prefix_spills_to_its_ring_neighbours_in_order() -> None:
    n = 8
    policy = PrefixAffinity(1.25)
    instances = tuple(p(i) for i in range(n))
    inflight = InFlight()
    candidates = cands(instances, inflight)
    # Every instance busy with 10 legs of 100 prompt tokens of other prefixes.
    for instance in instances:
        for _ in range(10):
            inflight.add(instance.http_address, 100)
    hot = RequestFeatures("m", 100, 200, keyed(100, HOT))
    order = [instances[position] for position in distinct(walk(instances, HOT))]
    seen = []
    for ticket in range(12):
        assert (
            policy.choose(candidates, hot, ticket)
            == instances[expected_choice(instances, inflight, hot, 1.25)]
        )
        choice = policy.choose(candidates, hot, ticket)
        inflight.add(choice.http_address, 100)
        seen.append(choice)
    # cap = 1.25 (8000 + 100 k + 100) / 8: the home takes 1,100 then 1,200 (1,300 > 1,296.9
    # at k = 2); then its ring successor, then the one after: never the whole fleet.
    assert seen[:3] == [order[0], order[0], order[1]]
    used = list(dict.fromkeys(seen))
    assert used == order[: len(used)]  # neighbours in ring order, none skipped
    assert 3 <= len(used) <= 4


def find_key(
    instances: tuple[Instance, ...], good: Callable[[list[int]], bool]
) -> tuple[int, list[int]]:
    """A key whose ring walk suits a test (searched: the ring is a hash)."""
    for key in keys(2000, seed=99):
        owners_ = walk(instances, key)
        if good(owners_):
            return key, owners_
    raise AssertionError("no key found")


def test_the_walk_visits_up_to_max_walk_points() -> None:
    assert MAX_WALK == 8
    n = 40
    instances = tuple(p(i) for i in range(n))

    def fits(walked: list[int]) -> bool:
        # The 8th point's owner is new, and not the lowest idle position.
        first = set(walked[:7])
        idle = [i for i in range(n) if i not in first]
        return walked[7] not in first and idle[0] != walked[7]

    key, walked = find_key(instances, fits)
    busy = set(walked[:7])
    inflight = InFlight()
    for position in busy:
        inflight.add(instances[position].http_address, 10_000)
    candidates = cands(instances, inflight)
    request = RequestFeatures("m", 100, 0, keyed(100, key))
    assert PrefixAffinity(1.25).choose(candidates, request, 0) == instances[walked[7]]


def test_after_max_walk_busy_points_the_prefix_spills_to_the_least_loaded() -> None:
    n = 40
    instances = tuple(p(i) for i in range(n))

    def fits(walked: list[int]) -> bool:
        # The 9th point's owner is new and would fit, but is not the least loaded.
        first = set(walked[:8])
        idle = [i for i in range(n) if i not in first]
        return walked[8] not in first and idle[0] != walked[8]

    key, walked = find_key(instances, fits)
    busy = set(walked[:8])
    inflight = InFlight()
    for position in busy:
        inflight.add(instances[position].http_address, 10_000)
    # One idle instance is less loaded than the other idle ones: it takes the spill.
    idle = [i for i in range(n) if i not in busy]
    for position in idle:
        inflight.add(instances[position].http_address, 50)
    least = idle[-1] if idle[-1] != walked[8] else idle[-2]
    inflight.remove(instances[least].http_address, 50)
    candidates = cands(instances, inflight)
    request = RequestFeatures("m", 100, 0, keyed(100, key))
    assert PrefixAffinity(1.25).choose(candidates, request, 0) == instances[least]
    # With the 9th point's owner the least loaded, the answer is the same instance by
    # either route: the walk stops at 8 points, it does not skip to the least loaded early.
    assert expected_choice(instances, inflight, request, 1.25) == least


def test_a_busy_homes_neighbour_holding_the_prefix_takes_it_before_one_that_does_not() -> None:
    # 4 instances, load factor 1.25, a 1,000-token prompt of a hot lead (windows 256, 512,
    # 1,000). Prefill work in flight: the home 2,500, its next two ring neighbours 1,000 each,
    # the last one idle. cap = max(1.25 x (4,500 + 1,000) / 4, 0 + 1,000) = 1,718.75.
    instances = tuple(p(i) for i in range(4))

    def reachable(walked: list[int]) -> bool:
        # The walk's first MAX_WALK points reach three distinct instances, not the fourth.
        return len(set(walked[:MAX_WALK])) == 3

    hot, walked = find_key(instances, reachable)
    home, first, second, idle = distinct(walked)
    request = RequestFeatures("m", 1000, 1100, chain(1000, hot))
    assert [w.tokens for w in request.prefix_windows] == [256, 512, 1000]
    policy = PrefixAffinity(1.25)

    def choose(holders: dict[int, int]) -> Instance:
        """holders: position -> the size of an earlier prompt of the lead sent there."""
        inflight = InFlight()
        for position, work in ((home, 2500), (first, 1000), (second, 1000)):
            inflight.add(instances[position].http_address, work)
        cache = PrefixCache()
        held: Held = {}
        for position, tokens in holders.items():
            cache.record(chain(tokens, hot), instances[position].http_address)
            hold(held, chain(tokens, hot), instances[position].http_address)
        choice = policy.choose(Candidates(instances, inflight, CAPACITY, cache), request, 0)
        assert instances.index(choice) == expected_choice(instances, inflight, request, 1.25, held)
        return choice

    # Nobody else holds it; the home holds all of it but 2,500 + 0 > cap: the idle one.
    assert choose({home: 1000}) == instances[idle]
    # The second neighbour was sent a 600-token prompt of the lead: it holds 512 tokens and
    # 1,000 + 1,000 - 512 = 1,488 <= cap. The first neighbour, as busy but not a holder
    # (1,000 + 1,000 = 2,000 > cap), is passed over.
    assert choose({home: 1000, second: 600}) == instances[second]
    # Holding only the first window (a 300-token prompt: 256 tokens) is not enough:
    # 1,000 + 1,000 - 256 = 1,744 > cap.
    assert choose({home: 1000, second: 300}) == instances[idle]
    # Both neighbours hold 512 tokens: the ring order decides.
    assert choose({first: 600, second: 600}) == instances[first]
    # Holding a different lead is no help (the keys differ from the first window on).
    other = PrefixCache()
    other.record(chain(600, hot ^ 1), instances[second].http_address)
    inflight = InFlight()
    for position, work in ((home, 2500), (first, 1000), (second, 1000)):
        inflight.add(instances[position].http_address, work)
    choice = policy.choose(Candidates(instances, inflight, CAPACITY, other), request, 0)
    assert choice == instances[idle]


def test_announced_load_does_not_move_a_prefix() -> None:
    policy = PrefixAffinity(1.0)
    instances = tuple(p(i) for i in range(4))
    key = req(987654321)
    home = policy.choose(cands(instances), key, 0)
    swamped = tuple(
        p(i, Load(running=100, waiting=100, kv_usage=1.0)) if inst == home else inst
        for i, inst in enumerate(instances)
    )
    assert policy.choose(cands(swamped), key, 0).http_address == home.http_address


def test_home_busy_with_the_proxys_own_prompts_is_passed_over() -> None:
    policy = PrefixAffinity(1.25)
    instances = tuple(p(i) for i in range(4))
    key = req(987654321)  # 100 prompt tokens
    home = policy.choose(cands(instances), key, 0)
    inflight = InFlight()
    inflight.add(home.http_address, 5000)
    candidates = cands(instances, inflight)
    choice = policy.choose(candidates, key, 0)
    assert choice != home
    assert instances.index(choice) == distinct(walk(instances, 987654321))[1]
    # Its legs ended: the key goes home again.
    inflight.remove(home.http_address, 5000)
    assert policy.choose(candidates, key, 0) == home


def test_no_prefix_goes_to_the_fewest_prompt_tokens_in_flight() -> None:
    policy = PrefixAffinity()
    # Announcements say the opposite of the prompt tokens in flight: they are ignored.
    instances = (p(1, Load(running=0)), p(2, Load(running=50)), p(3, Load(running=9)))
    inflight = InFlight()
    for _ in range(5):  # p1: the most requests, the fewest tokens
        inflight.add(instances[0].http_address, 10)
    inflight.add(instances[1].http_address, 100)
    inflight.add(instances[2].http_address, 80)
    candidates = cands(instances, inflight)
    assert policy.choose(candidates, NO_PREFIX, 0) == instances[0]
    inflight.add(instances[0].http_address, 60)  # p1: 110
    assert policy.choose(candidates, NO_PREFIX, 0) == instances[2]
    inflight.add(instances[2].http_address, 20)  # p3: 100, tied with p2
    assert policy.choose(candidates, NO_PREFIX, 0) == instances[1]


def test_single_candidate_always_wins() -> None:
    only = p(1, Load(running=1000))
    inflight = InFlight()
    inflight.add(only.http_address, 10**6)
    candidates = cands((only,), inflight)
    policy = PrefixAffinity(1.0)
    assert {policy.choose(candidates, req(k), 0) for k in keys(20)} == {only}
    assert policy.choose(candidates, NO_PREFIX, 0) == only


@pytest.mark.parametrize("seed", range(6))
def test_prefix_affinity_matches_the_design_over_random_histories(seed: int) -> None:
    # The policy with the planner's bookkeeping: each chosen prefill's work (the prompt less
    # what it probably holds) stays in flight, and it holds the prompt's windows from then on.
    rng = random.Random(seed)
    n = rng.randint(2, 12)
    load_factor = rng.choice((1.0, 1.1, 1.25, 2.0))
    policy = PrefixAffinity(load_factor)
    instances = tuple(
        p(i, rng.choice((None, Load(running=rng.randint(0, 30), kv_usage=rng.random()))))
        for i in range(n)
    )
    inflight = InFlight()
    cache = PrefixCache()
    candidates = Candidates(instances, inflight, CAPACITY, cache)
    held: Held = {}
    prefixes: list[int | None] = [None, 0, (1 << 64) - 1, *keys(5, seed=seed)]
    legs: list[tuple[Instance, int]] = []
    discounted = 0
    for ticket in range(400):
        if legs and rng.random() < 0.4:
            instance, work = legs.pop(rng.randrange(len(legs)))
            inflight.remove(instance.http_address, work)
        tokens = rng.choice((0, 1, 64, 300, 900, 6000))
        lead = rng.choice(prefixes)
        windows = () if lead is None else chain(tokens, lead, rng.choice((None, 256, 512)), ticket)
        request = RequestFeatures("m", tokens, tokens, windows)
        choice = policy.choose(candidates, request, ticket)
        expected = expected_choice(instances, inflight, request, load_factor, held)
        assert instances.index(choice) == expected
        cached = held_tokens(held, windows, choice.http_address)
        assert cache.cached_tokens(windows, choice.http_address) == cached
        discounted += cached > 0
        cache.record(windows, choice.http_address)
        hold(held, windows, choice.http_address)
        inflight.add(choice.http_address, tokens - cached)
        legs.append((choice, tokens - cached))
    assert discounted > 100  # the cache did take part


def test_rings_are_reused_for_the_same_membership_and_bounded() -> None:
    policy = PrefixAffinity()
    members = tuple(p(i) for i in range(5))
    # A load-only snapshot change: same addresses, new instances, new candidate sets.
    reloaded = tuple(p(i, Load(running=i)) for i in range(5))
    policy.choose(cands(members), req(1), 0)
    (ring,) = policy._rings.values()
    policy.choose(cands(reloaded), req(1), 0)
    assert list(policy._rings.values()) == [ring]
    assert next(iter(policy._rings.values())) is ring  # reused, not rebuilt
    for extra in range(_RINGS_KEPT + 6):
        policy.choose(cands((*members, p(10 + extra))), req(1), 0)
    assert len(policy._rings) == _RINGS_KEPT
    ks = keys(500)
    assert owners(policy, members, ks) == owners(PrefixAffinity(), members, ks)


def test_prefix_affinity_through_the_planner_keeps_conversations_home() -> None:
    prefills = tuple(p(i) for i in range(6))
    decodes = (d(1), d(2))
    snapshot = Snapshot(1, prefills, decodes)
    planner = Planner(make_policy("prefix_affinity"), make_policy("least_kv"))
    homes: dict[int, set[Instance]] = {}
    cuts: dict[int, set[int]] = {}  # per conversation: the window sizes its home was sent
    for turn in range(5):
        for key in keys(40):
            # A conversation's prompt grows by 300 tokens a turn; earlier turns are its lead.
            tokens = 300 * (turn + 1)
            windows = chain(tokens, key)
            result = planner.plan(snapshot, RequestFeatures("m", tokens, tokens + 100, windows))
            assert isinstance(result, Pair)
            homes.setdefault(key, set()).add(result.prefill)
            # Prefill work: the prompt less the longest window the home was sent before.
            sent = cuts.setdefault(key, set())
            cached = max((w.tokens for w in windows if w.tokens in sent), default=0)
            assert result.prefill_tokens == tokens - cached
            assert cached == (0, 256, 512, 512, 1024)[turn]
            sent.update(w.tokens for w in windows)
            # Each request finishes before the next: loads stay balanced.
            planner.release(result.prefill.http_address, result.prefill_tokens)
            planner.release(result.decode.http_address, result.decode_tokens)
    assert all(home == {home_of(prefills, key)} for key, home in homes.items())
    assert len({next(iter(home)) for home in homes.values()}) >= 4
    assert planner.inflight.total_requests() == 0


def test_prefix_affinity_through_the_planner_balances_prefill_work() -> None:
    # One hot system prompt (256 tokens) under 300-token prompts that differ after it, every
    # leg kept in flight. Work, not prompt tokens, is what is balanced now: a prefill that was
    # sent the system prompt before counts only the other 44 tokens of each prompt.
    prefills = tuple(p(i) for i in range(4))
    snapshot = Snapshot(1, prefills, (d(1),))
    planner = Planner(PrefixAffinity(1.25), LeastKv())
    held: Held = {}
    works: list[int] = []
    for ticket in range(200):
        request = RequestFeatures("m", 300, 400, chain(300, HOT, 256, ticket))
        before = prompt_loads(prefills, planner.inflight)
        expected = expected_choice(prefills, planner.inflight, request, 1.25, held)
        result = planner.plan(snapshot, request)
        assert isinstance(result, Pair)
        assert result.prefill == prefills[expected]
        address = result.prefill.http_address
        work = 300 - held_tokens(held, request.prefix_windows, address)
        assert result.prefill_tokens == work
        assert work == (44 if address in held.get(HOT, ()) else 300)
        hold(held, request.prefix_windows, address)
        works.append(work)
        after = prompt_loads(prefills, planner.inflight)
        assert after == [load + (work if i == expected else 0) for i, load in enumerate(before)]
        # Each leg is placed within max(1.25 x the mean, least + 300) as it was then. (The
        # final loads need no longer be within the final bound, as they were when work was the
        # whole prompt: the cap counts the whole prompt in the total, the leg adds only its
        # work. This history ends at [3116, 3116, 476, 3116], above 1.25 x the mean, 3070.)
        assert after[expected] <= max(1.25 * (sum(before) + 300) / 4, min(before) + 300)
    loads = prompt_loads(prefills, planner.inflight)
    assert sum(loads) == sum(works) < 200 * 300
    # The home pays the whole prompt once and 44 tokens for each one after; the prefix
    # spills to its ring neighbours (each paying the whole prompt once) only when the home
    # is full, and the home holds as much as any.
    assert works.count(300) == len(held[HOT]) >= 2
    assert loads[walk(prefills, HOT)[0]] == max(loads)
    assert max(loads) > min(loads) + 300


def test_prefix_affinity_depends_only_on_the_instance_set() -> None:
    # Replicas route alike: each builds its candidates from its own table, whose order follows
    # the order announcements arrived in, and places its own legs. With the same instances and
    # no legs, every order, every fresh policy and any ticket send a prefix to the same one.
    fleet = [p(n) for n in range(12)]
    expected = {}
    for key in keys(300):
        expected[key] = PrefixAffinity().choose(cands(tuple(fleet)), req(key), 0).http_address
    assert len(set(expected.values())) == 12  # the keys reach every instance
    rng = random.Random(3)
    for trial in range(5):
        order = fleet[:]
        rng.shuffle(order)
        policy = PrefixAffinity()  # another replica: its own ring cache
        for key, owner in expected.items():
            chosen = policy.choose(cands(tuple(order)), req(key), trial * 1000 + key % 97)
            assert chosen.http_address == owner


def test_a_replica_with_a_third_of_the_legs_bounds_like_one_proxy_with_all() -> None:
    # Three replicas share the traffic alike: each holds a third of every prefill's legs, and
    # every prefill announces all of them. One replica's choices, over every prefix and
    # prompt size, are the ones a single proxy holding every leg would make.
    rng = random.Random(23)
    n = 6
    legs = [(rng.randint(0, 4), rng.choice((30, 200, 1500))) for _ in range(n)]
    reported = tuple(p(i, Load(running=3 * count)) for i, (count, _) in enumerate(legs))
    unreported = tuple(p(i) for i in range(n))
    one_third, everything = InFlight(), InFlight()
    for instance, (count, tokens) in zip(reported, legs, strict=True):
        for _ in range(count):
            one_third.add(instance.http_address, tokens)
        for _ in range(3 * count):
            everything.add(instance.http_address, tokens)
    replica, alone = cands(reported, one_third), cands(unreported, everything)
    assert replica.board(LoadKind.PREFILL_WORK).scale == 3.0
    policy = PrefixAffinity()
    spilled = 0
    for key in keys(60, seed=3):
        for tokens in (1, 100, 700, 3000):
            request = RequestFeatures("m", tokens, tokens, keyed(tokens, key))
            choice = policy.choose(alone, request, 0)
            assert policy.choose(replica, request, 0).name == choice.name, (key, tokens)
            spilled += choice.name != home_of(unreported, key).name
    assert spilled > 20  # the bound is what decides, not only the ring


def test_each_planner_built_for_serving_starts_its_round_robin_at_its_own_ticket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Replicas that all started at ticket 0 would all send their first request to the first
    instance: each planner starts at a number drawn for it."""
    draws = iter(range(1000, 1100))
    monkeypatch.setattr(secrets, "randbits", lambda bits: next(draws))
    settings = Settings(prefill_policy="round_robin", decode_policy="round_robin")
    fleet = Snapshot(1, tuple(p(i) for i in range(10)), tuple(d(i) for i in range(10)))

    def first_prefill(planner: Planner) -> str:
        plan = planner.plan(fleet, NO_PREFIX)
        assert isinstance(plan, Pair)
        return plan.prefill.name

    firsts = [first_prefill(planner_from(settings)) for _ in range(3)]
    # Each planner draws two seeds, then its first ticket: 1002, 1005, 1008.
    expected = [
        first_prefill(Planner(RoundRobin(), RoundRobin(), first_ticket=ticket))
        for ticket in (1002, 1005, 1008)
    ]
    assert firsts == expected
    assert len(set(firsts)) == 3


def test_each_planner_built_for_serving_draws_its_own_power_of_two_sequence() -> None:
    """Replicas (and a replica's workers) build their planners alike: with one shared seed
    they would draw the same two candidates for the same ticket, at once."""
    settings = Settings(prefill_policy="power_of_two", decode_policy="power_of_two")
    candidates = cands(tuple(p(i) for i in range(10)))
    planners = [planner_from(settings) for _ in range(3)]
    sequences = {
        (
            tuple(planner.prefill_policy.choose(candidates, NO_PREFIX, t) for t in range(50)),
            tuple(planner.decode_policy.choose(candidates, NO_PREFIX, t) for t in range(50)),
        )
        for planner in planners
    }
    assert len(sequences) == 3
    prefill, decode = next(iter(sequences))
    assert prefill != decode
