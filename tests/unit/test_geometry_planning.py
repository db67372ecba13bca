"""pdproxy.pairing.planner with KV geometry and connectors: only compatible pairs are ever
planned, orphans are explained, direct (prefill-less) plans only go to decodes that can compute
a prompt themselves. Pure.

The compatibility oracle is `geometry.plan_pair` on the two instances (tested on its own in
test_geometry.py) plus `Instance.serves`: the planner must agree with it for every pair.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.base.roles import Role
from pdproxy.ids import Address
from pdproxy.pairing.candidates import Candidates
from pdproxy.pairing.features import PrefixWindow, RequestFeatures
from pdproxy.pairing.geometry import (
    Incompatible,
    PairPlan,
    Unverified,
    Verdict,
    from_announced,
    plan_pair,
    side_of,
)
from pdproxy.pairing.inflight import InFlight
from pdproxy.pairing.listing import pairs_report
from pdproxy.pairing.planner import (
    LOCAL_COMPUTE,
    Direct,
    FleetIndex,
    NoPair,
    Pair,
    Planner,
    Readiness,
    Unpaired,
    class_key,
    readiness,
)
from pdproxy.pairing.policies import make_policy
from pdproxy.pairing.policies.round_robin import RoundRobin
from pdproxy.pairing.scoreboard import LoadKind
from pdproxy.registry.messages import Connector, Geometry
from pdproxy.registry.table import Instance, Snapshot
from tests.pairing_builders import NIXL, P2P, PDPROXY, dec, geo, pre

# Deterministic and load-tolerant: same examples every run, no deadline, no example database.
PROFILE = settings(derandomize=True, database=None, deadline=None)

PREFILL_POLICIES = ("round_robin", "least_loaded", "power_of_two", "prefix_affinity")
DECODE_POLICIES = ("round_robin", "least_loaded", "power_of_two", "least_kv")


def v0_pre(n: int) -> Instance:
    return pre(n, None, None, None)


def v0_dec(n: int) -> Instance:
    return dec(n, None, None, None)


def keyed(tokens: int, key: int | None) -> tuple[PrefixWindow, ...]:
    """A prompt of `tokens` tokens whose one prefix window hashes to `key` (None: no prefix)."""
    return () if key is None else (PrefixWindow(min(256, tokens), key),)


def rq(key: int | None = None, model: str = "m") -> RequestFeatures:
    return RequestFeatures(model, 100, 300, keyed(100, key))


def rr() -> Planner:
    return Planner(RoundRobin(), RoundRobin())


def plan_of(pair: Pair, *, allow: bool = False) -> Verdict:
    """The geometry verdict of the pair the planner chose (pairs carry no plan themselves)."""
    return plan_pair(side_of(pair.prefill), side_of(pair.decode), allow_unknown_geometry=allow)


def plan_many(planner: Planner, snapshot: Snapshot, n: int, model: str = "m") -> list[Pair]:
    out = []
    for _ in range(n):
        result = planner.plan(snapshot, rq(model=model))
        assert isinstance(result, Pair), result
        out.append(result)
    return out


def no_pair(result: Pair | NoPair) -> NoPair:
    assert isinstance(result, NoPair), result
    return result


def compatible(p: Instance, d: Instance, model: str, allow: bool = False) -> bool:
    verdict = plan_pair(side_of(p), side_of(d), allow_unknown_geometry=allow)
    return p.serves(model) and d.serves(model) and not isinstance(verdict, Incompatible)


# ---------------------------------------------------------------------------------------------
# The mixed fleet: P tp 2 and tp 4, D tp 2, all p2p_nccl


P_TP2_A = pre(4, geo(2))
P_TP4 = pre(5, geo(4))
P_TP2_B = pre(6, geo(2))
D_TP2_A = dec(1, geo(2))
D_TP2_B = dec(2, geo(2))
MIXED = Snapshot(1, (P_TP2_A, P_TP4, P_TP2_B), (D_TP2_A, D_TP2_B))
TP4_ORPHAN = (
    "prefill 10.0.0.5:8100 (p2p_nccl, tp 4, block 16, model m) has no compatible decode: "
    "decodes have tp 2"
)


@pytest.mark.parametrize("decode_policy", DECODE_POLICIES)
@pytest.mark.parametrize("prefill_policy", PREFILL_POLICIES)
def test_mixed_fleet_never_reaches_an_incompatible_pair(
    prefill_policy: str, decode_policy: str
) -> None:
    planner = Planner(make_policy(prefill_policy), make_policy(decode_policy))
    rng = random.Random(f"{prefill_policy}/{decode_policy}")
    held: list[Pair] = []
    used: Counter[tuple[Instance, Instance]] = Counter()
    for _ in range(300):
        result = planner.plan(MIXED, rq(rng.getrandbits(64)))
        assert isinstance(result, Pair), result
        assert result.prefill != P_TP4
        plan = plan_of(result)
        assert isinstance(plan, PairPlan)
        assert plan.tp_ratio == 1
        assert plan.connector is P2P
        used[(result.prefill, result.decode)] += 1
        held.append(result)
        if rng.random() < 0.6:  # some legs end, some stay in flight
            done = held.pop(rng.randrange(len(held)))
            planner.release(done.prefill.http_address, done.prefill_tokens)
            planner.release(done.decode.http_address, done.decode_tokens)
    assert {prefill for prefill, _ in used} == {P_TP2_A, P_TP2_B}
    assert {decode for _, decode in used} == {D_TP2_A, D_TP2_B}
    assert planner.inflight.get(P_TP4.http_address).requests == 0


def test_mixed_fleet_is_ready_and_names_the_orphan() -> None:
    planner = Planner(make_policy("prefix_affinity"), make_policy("least_kv"))
    assert readiness(planner.index(MIXED)) == Readiness(True, "ok", (TP4_ORPHAN,))


def test_mixed_fleet_view_offers_only_the_compatible_prefills() -> None:
    view = FleetIndex(MIXED, InFlight()).view("m")
    assert view.prefills is not None
    assert view.prefills.instances == (P_TP2_A, P_TP2_B)
    assert view.decodes_for(P_TP2_A).instances == (D_TP2_A, D_TP2_B)
    assert class_key(P_TP4) not in view.decodes_by_class


def test_tp4_prefill_alone_is_not_ready_and_every_plan_says_why() -> None:
    snapshot = Snapshot(2, (P_TP4,), (D_TP2_A, D_TP2_B))
    planner = rr()
    result = no_pair(planner.plan(snapshot, rq()))
    assert result.kind is Unpaired.INCOMPATIBLE
    assert result.reason == (
        "no decode instance is compatible with a prefill instance for model 'm': " + TP4_ORPHAN
    )
    assert readiness(planner.index(snapshot)) == Readiness(
        False, "no prefill has a compatible decode: " + TP4_ORPHAN, (TP4_ORPHAN,)
    )
    assert planner.inflight.total_requests() == 0


def test_the_same_fleet_under_nixl_pairs_every_prefill() -> None:
    prefills = (pre(4, geo(2), NIXL), pre(5, geo(4), NIXL), pre(6, geo(2), NIXL))
    decodes = (dec(1, geo(2), NIXL), dec(2, geo(2), NIXL))
    snapshot = Snapshot(1, prefills, decodes)
    planner = rr()
    result = plan_many(planner, snapshot, 12)
    assert {r.prefill for r in result} == set(prefills)
    plans = {r.prefill.name: plan_of(r) for r in result}
    ratios = {name: plan.tp_ratio for name, plan in plans.items() if isinstance(plan, PairPlan)}
    assert ratios == {"10.0.0.4:8100": 1, "10.0.0.5:8100": -2, "10.0.0.6:8100": 1}
    assert readiness(planner.index(snapshot)) == Readiness(True, "ok")


def test_each_prefill_class_gets_only_its_own_decodes() -> None:
    # Two islands in one fleet: p2p tp 2 and nixl tp 4 -> tp 2 (HND).
    p2p_p, nixl_p = pre(1, geo(2)), pre(2, geo(4), NIXL)
    p2p_d, nixl_d = dec(1, geo(2)), dec(2, geo(2), NIXL)
    snapshot = Snapshot(1, (p2p_p, nixl_p), (p2p_d, nixl_d))
    result = plan_many(Planner(make_policy("least_loaded"), make_policy("least_kv")), snapshot, 40)
    assert {(r.prefill, r.decode) for r in result} == {(p2p_p, p2p_d), (nixl_p, nixl_d)}
    assert {r.connector for r in result} == {P2P, NIXL}


def test_prefill_classes_with_the_same_decodes_share_one_candidate_set() -> None:
    a, b = pre(1, geo(2), NIXL), pre(2, geo(4), NIXL)  # two classes, same compatible decodes
    decodes = (dec(1, geo(2), NIXL), dec(2, geo(4), NIXL))
    view = FleetIndex(Snapshot(1, (a, b), decodes), InFlight()).view("m")
    assert class_key(a) != class_key(b)
    assert view.decodes_for(a) is view.decodes_for(b)
    assert view.decodes_for(a).instances == decodes


# ---------------------------------------------------------------------------------------------
# Random fleets

GEOMETRIES = (
    None,
    geo(1),
    geo(2),
    geo(4),
    geo(2, block=32),
    geo(2, layout="NHD"),
    geo(2, layers=40),
    geo(16),  # heads replicated over ranks
    Geometry(tp_size=2),  # partial: as unknown as v0
)
instance_specs = st.tuples(
    st.sampled_from([None, "a", "b"]),
    st.sampled_from([None, P2P, NIXL, PDPROXY]),
    st.sampled_from(GEOMETRIES),
)


def build(
    specs: list[tuple[str | None, Connector | None, Geometry | None]], role: Role
) -> tuple[Instance, ...]:
    make = pre if role is Role.PREFILL else dec
    return tuple(make(i, g, c, m) for i, (m, c, g) in enumerate(specs))


@settings(PROFILE, max_examples=300)
@given(
    p_specs=st.lists(instance_specs, max_size=5),
    d_specs=st.lists(instance_specs, max_size=5),
    model=st.sampled_from(["a", "b", "zzz"]),
    allow=st.booleans(),
)
def test_random_fleets_plan_only_compatible_pairs_and_reach_every_pairable_prefill(
    p_specs: list[tuple[str | None, Connector | None, Geometry | None]],
    d_specs: list[tuple[str | None, Connector | None, Geometry | None]],
    model: str,
    allow: bool,
) -> None:
    prefills, decodes = build(p_specs, Role.PREFILL), build(d_specs, Role.DECODE)
    snapshot = Snapshot(1, prefills, decodes)
    possible = {(x, y) for x in prefills for y in decodes if compatible(x, y, model, allow)}
    planner = Planner(RoundRobin(), RoundRobin(), allow_unknown_geometry=allow)
    if not possible:
        refusal = no_pair(planner.plan(snapshot, rq(model=model)))
        serving_p = [x for x in prefills if x.serves(model)]
        serving_d = [y for y in decodes if y.serves(model)]
        if not serving_p and not serving_d:
            assert refusal.kind is Unpaired.NO_INSTANCE
        elif not serving_p:
            assert refusal.kind is Unpaired.NO_PREFILL
        elif not serving_d:
            assert refusal.kind is Unpaired.NO_DECODE
        else:
            assert refusal.kind is Unpaired.INCOMPATIBLE
            assert all(x.name in refusal.reason for x in serving_p[:3])
        assert repr(model) in refusal.reason
        assert planner.inflight.total_requests() == 0
        return
    seen: set[Instance] = set()
    for _ in range(2 * len(prefills) * len(decodes)):
        result = planner.plan(snapshot, rq(model=model))
        assert isinstance(result, Pair), result
        assert (result.prefill, result.decode) in possible
        assert not isinstance(plan_of(result, allow=allow), Incompatible)
        known = result.prefill.geometry, result.decode.geometry
        full = all(from_announced(g) is not None for g in known)
        assert isinstance(plan_of(result, allow=allow), PairPlan if full else Unverified)
        seen.add(result.prefill)
    assert seen == {x for x, _ in possible}


@settings(PROFILE, max_examples=200)
@given(
    p_specs=st.lists(instance_specs, max_size=4),
    d_specs=st.lists(instance_specs, max_size=4),
    allow=st.booleans(),
)
def test_random_fleets_readiness_and_orphans(
    p_specs: list[tuple[str | None, Connector | None, Geometry | None]],
    d_specs: list[tuple[str | None, Connector | None, Geometry | None]],
    allow: bool,
) -> None:
    prefills, decodes = build(p_specs, Role.PREFILL), build(d_specs, Role.DECODE)
    index = FleetIndex(Snapshot(1, prefills, decodes), InFlight(), allow_unknown_geometry=allow)

    def verdict(x: Instance, y: Instance) -> object:
        return plan_pair(side_of(x), side_of(y), allow_unknown_geometry=allow)

    pairable = any(not isinstance(verdict(x, y), Incompatible) for x in prefills for y in decodes)
    state = readiness(index)
    assert state.ready is (bool(prefills) and bool(decodes) and pairable)
    if not decodes:
        return
    orphans = [x for x in prefills if all(isinstance(verdict(x, y), Incompatible) for y in decodes)]
    # One sentence per orphan class, each naming its prefills (three, then "and N more").
    classes: dict[object, list[Instance]] = {}
    for x in orphans:
        classes.setdefault(class_key(x), []).append(x)
    assert len(state.orphans) == len(classes)
    for members in classes.values():
        names = ", ".join(x.name for x in members[:3])
        if len(members) > 3:
            names += f" and {len(members) - 3} more"
        assert sum(f" {names} (" in sentence for sentence in state.orphans) == 1
    for sentence in state.orphans:
        assert " has no compatible decode: decodes " in sentence
    if not state.ready and prefills:
        assert state.reason == "no prefill has a compatible decode: " + "; ".join(state.orphans)


@settings(PROFILE, max_examples=200)
@given(
    d_specs=st.lists(instance_specs, max_size=6),
    model=st.sampled_from(["a", "b", "zzz"]),
    with_prefill=st.booleans(),
)
def test_random_fleets_direct_plans_only_local_compute_decodes(
    d_specs: list[tuple[str | None, Connector | None, Geometry | None]],
    model: str,
    with_prefill: bool,
) -> None:
    decodes = build(d_specs, Role.DECODE)
    prefills = (pre(1, geo(2), NIXL, None),) if with_prefill else ()
    snapshot = Snapshot(1, prefills, decodes)
    able = {y for y in decodes if y.serves(model) and y.connector in (NIXL, PDPROXY)}
    planner = rr()
    chosen = set()
    for _ in range(2 * len(decodes) + 1):
        result = planner.plan_direct(snapshot, RequestFeatures(model, 5, 50))
        if not able:
            assert result is None
            continue
        assert isinstance(result, Direct)
        assert result.decode in able
        assert result.decode_tokens == 50
        chosen.add(result.decode)
    assert chosen == able
    assert planner.inflight.total_requests() == (2 * len(decodes) + 1 if able else 0)


# ---------------------------------------------------------------------------------------------
# NoPair kinds


@pytest.mark.parametrize(
    ("prefills", "decodes", "kind"),
    [
        ((), (), Unpaired.NO_INSTANCE),
        ((pre(1, geo(2), model="x"),), (dec(1, geo(2), model="y"),), Unpaired.NO_INSTANCE),
        ((), (dec(1, geo(2)),), Unpaired.NO_PREFILL),
        ((pre(1, geo(2), model="x"),), (dec(1, geo(2)),), Unpaired.NO_PREFILL),
        ((pre(1, geo(2)),), (), Unpaired.NO_DECODE),
        ((pre(1, geo(2)),), (dec(1, geo(2), model="x"),), Unpaired.NO_DECODE),
        ((pre(1, geo(4)),), (dec(1, geo(2)),), Unpaired.INCOMPATIBLE),
        ((pre(1, geo(2), NIXL),), (dec(1, geo(2)),), Unpaired.INCOMPATIBLE),
        ((pre(1, geo(2)),), (v0_dec(1),), Unpaired.INCOMPATIBLE),
    ],
    ids=[
        "empty",
        "other models",
        "only D",
        "P of another model",
        "only P",
        "D of another model",
        "tp",
        "connector",
        "unknown geometry",
    ],
)
def test_no_pair_kinds(
    prefills: tuple[Instance, ...], decodes: tuple[Instance, ...], kind: Unpaired
) -> None:
    planner = rr()
    result = no_pair(planner.plan(Snapshot(1, prefills, decodes), rq()))
    assert result.kind is kind
    assert "'m'" in result.reason
    assert planner.inflight.total_requests() == 0


def test_incompatible_reason_names_every_orphan_class() -> None:
    prefills = (
        pre(1, geo(4)),
        pre(2, geo(4)),
        pre(3, geo(2), NIXL),
        pre(4, geo(2, block=32)),
    )
    decodes = (dec(1, geo(2)), dec(2, geo(2)), dec(3, geo(2), model="other"))
    result = no_pair(rr().plan(Snapshot(1, prefills, decodes), rq()))
    assert result.kind is Unpaired.INCOMPATIBLE
    assert result.reason == (
        "no decode instance is compatible with a prefill instance for model 'm': "
        "prefills 10.0.0.1:8100, 10.0.0.2:8100 (p2p_nccl, tp 4, block 16, model m) has no "
        "compatible decode: decodes have tp 2; "
        "prefill 10.0.0.3:8100 (nixl, tp 2, block 16, model m) has no compatible decode: "
        "decodes have connector p2p_nccl; "
        "prefill 10.0.0.4:8100 (p2p_nccl, tp 2, block 32, model m) has no compatible decode: "
        "decodes have block size 16"
    )


def test_incompatible_reason_is_only_about_decodes_of_the_model() -> None:
    # The decode of another model would fit by geometry, but it does not serve 'm'; and it is
    # not cited as a decode the prefill was compared with.
    prefills = (pre(1, geo(4)),)
    decodes = (dec(1, geo(2)), dec(2, geo(4), model="other"))
    result = no_pair(rr().plan(Snapshot(1, prefills, decodes), rq()))
    assert result.reason.endswith("decodes have tp 2")
    assert "other" not in result.reason


# ---------------------------------------------------------------------------------------------
# Conditional disaggregation: plan_direct


def test_direct_only_picks_decodes_that_compute_locally() -> None:
    # A request without kv_transfer_params (or an untagged id) is computed by NIXL, Mooncake
    # and pdproxy decodes; a stock P2pNccl consumer would wait for KV that never comes.
    decodes = (
        dec(1, geo(2), NIXL),
        dec(2, geo(2), P2P),
        dec(3, geo(2), PDPROXY),
        dec(4, geo(2), None),
        v0_dec(5),
        dec(6, geo(2), Connector.MOONCAKE),
        dec(7, geo(2), Connector.NIXL_PUSH),
    )
    snapshot = Snapshot(1, (pre(1, geo(2), None),), decodes)
    planner = rr()
    chosen = []
    for _ in range(20):
        result = planner.plan_direct(snapshot, rq())
        assert isinstance(result, Direct)
        chosen.append(result.decode)
    assert Counter(chosen) == {decodes[i]: 5 for i in (0, 2, 5, 6)}
    assert {NIXL, PDPROXY, Connector.MOONCAKE, Connector.NIXL_PUSH} == LOCAL_COMPUTE


@pytest.mark.parametrize(
    "decodes",
    [
        (dec(1, geo(2), P2P), dec(2, geo(4), P2P)),
        (dec(1, geo(2), None),),
        (v0_dec(1),),
        (dec(1, geo(2), NIXL, model="other"),),
        (),
    ],
    ids=["p2p_nccl", "unknown connector", "v0", "nixl of another model", "no decode"],
)
def test_no_direct_plan_without_a_local_compute_decode(decodes: tuple[Instance, ...]) -> None:
    snapshot = Snapshot(1, (pre(1, geo(2), None),), decodes)
    decode_policy = _Recording()
    planner = Planner(RoundRobin(), decode_policy)
    assert planner.plan_direct(snapshot, rq()) is None
    assert planner.inflight.total_requests() == 0
    assert decode_policy.tickets == []  # no decision, no ticket


def test_direct_plans_need_no_prefill_nor_known_geometry() -> None:
    decodes = (dec(1, None, NIXL), dec(2, Geometry(tp_size=8), PDPROXY, model=None))
    snapshot = Snapshot(1, (), decodes)
    planner = rr()
    assert no_pair(planner.plan(snapshot, rq())).kind is Unpaired.NO_PREFILL
    chosen = set()
    for _ in range(4):
        result = planner.plan_direct(snapshot, rq())
        assert result is not None
        chosen.add(result.decode)
    assert chosen == set(decodes)


class _Recording:
    name = "recording"

    def __init__(self) -> None:
        self.tickets: list[int] = []

    def choose(self, candidates: Candidates, request: RequestFeatures, ticket: int) -> Instance:
        self.tickets.append(ticket)
        return candidates.instances[0]


def test_direct_and_paired_plans_share_the_decode_ticket() -> None:
    decode_policy = _Recording()
    nixl = (dec(1, geo(2), NIXL), dec(2, geo(2), NIXL))
    snapshot = Snapshot(1, (pre(1, geo(2), NIXL),), nixl)
    planner = Planner(RoundRobin(), decode_policy)
    planner.plan(snapshot, rq())
    planner.plan_direct(snapshot, rq())
    planner.plan(snapshot, rq())
    planner.plan_direct(snapshot, rq())
    assert decode_policy.tickets == [0, 1, 2, 3]


def test_direct_plan_counts_the_decode_leg_until_released() -> None:
    decode = dec(1, geo(2), NIXL)
    planner = Planner(RoundRobin(), make_policy("least_kv"), kv_capacity_tokens=1000)
    snapshot = Snapshot(1, (), (decode,))
    result = planner.plan_direct(snapshot, RequestFeatures("m", 10, 250))
    assert result == Direct(decode, 250)
    assert planner.inflight.get(decode.http_address).tokens == 250
    planner.release(decode.http_address, result.decode_tokens)
    assert planner.inflight._busy == {}
    with pytest.raises(ValueError):
        planner.release(decode.http_address, 250)


# ---------------------------------------------------------------------------------------------
# Release bookkeeping


@pytest.mark.parametrize("decode_policy", DECODE_POLICIES)
@pytest.mark.parametrize("prefill_policy", PREFILL_POLICIES)
def test_plan_then_release_returns_inflight_to_empty(
    prefill_policy: str, decode_policy: str
) -> None:
    planner = Planner(make_policy(prefill_policy), make_policy(decode_policy))
    rng = random.Random(1)
    leads = [rng.getrandbits(64) for _ in range(4)]
    sent: set[tuple[int, Address]] = set()  # (lead, prefill) pairs planned so far
    held = []
    for i in range(60):
        # 16 + i tokens, the first 16 one of a few shared leads: the prefill's work (what is
        # counted in flight, and released) is the prompt less the 16 if it was sent the lead.
        lead = rng.choice(leads)
        request = RequestFeatures("m", 16 + i, 10 * i + 5, (PrefixWindow(16, lead),))
        result = planner.plan(MIXED, request)
        assert isinstance(result, Pair)
        address = result.prefill.http_address
        work = 16 + i - (16 if (lead, address) in sent else 0)
        assert (result.prefill_tokens, result.decode_tokens) == (work, 10 * i + 5)
        sent.add((lead, address))
        held.append(result)
    assert sum(pair.prefill_tokens < 16 + i for i, pair in enumerate(held)) > 10
    by_address: Counter[Address] = Counter()
    tokens: Counter[Address] = Counter()
    for pair in held:
        by_address[pair.prefill.http_address] += 1
        by_address[pair.decode.http_address] += 1
        tokens[pair.prefill.http_address] += pair.prefill_tokens
        tokens[pair.decode.http_address] += pair.decode_tokens
    for address, count in by_address.items():
        busy = planner.inflight.get(address)
        assert (busy.requests, busy.tokens) == (count, tokens[address])
    assert planner.inflight.total_requests() == 120
    rng.shuffle(held)
    for pair in held:
        planner.release(pair.prefill.http_address, pair.prefill_tokens)
        planner.release(pair.decode.http_address, pair.decode_tokens)
    assert planner.inflight._busy == {}
    assert planner.inflight.total_requests() == 0
    view = planner.index(MIXED).view("m")
    assert view.prefills is not None
    for candidates in (view.prefills, view.decodes_for(P_TP2_A)):
        for kind in LoadKind:
            assert candidates.board(kind).values == [0.0] * len(candidates)


def test_kv_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="kv_capacity_tokens"):
        Planner(RoundRobin(), RoundRobin(), kv_capacity_tokens=0)


# ---------------------------------------------------------------------------------------------
# Unknown geometry (v0) and allow_unknown_geometry


def test_unknown_geometry_pairs_only_with_unknown_geometry() -> None:
    prefills = (v0_pre(1), pre(2, geo(2)))
    decodes = (v0_dec(1), dec(2, geo(2)))
    snapshot = Snapshot(1, prefills, decodes)
    result = plan_many(rr(), snapshot, 20)
    assert {(r.prefill, r.decode) for r in result} == {
        (prefills[0], decodes[0]),
        (prefills[1], decodes[1]),
    }
    for r in result:
        if r.prefill == prefills[0]:
            assert plan_of(r) == Unverified("geometry unknown on both sides")
        else:
            assert isinstance(plan_of(r), PairPlan)


def test_allow_unknown_geometry_pairs_across() -> None:
    prefills = (v0_pre(1), pre(2, geo(2)))
    decodes = (v0_dec(1), dec(2, geo(2)))
    snapshot = Snapshot(1, prefills, decodes)
    planner = Planner(RoundRobin(), RoundRobin(), spread_pairs=True, allow_unknown_geometry=True)
    result = plan_many(planner, snapshot, 16)
    assert {(r.prefill, r.decode) for r in result} == {(x, y) for x in prefills for y in decodes}
    across = [r for r in result if (r.prefill.geometry is None) != (r.decode.geometry is None)]
    assert across
    assert all(isinstance(plan_of(r, allow=True), Unverified) for r in across)
    assert {
        verdict.detail for r in across if isinstance(verdict := plan_of(r, allow=True), Unverified)
    } == {
        "prefill geometry unknown; allowed by allow_unknown_geometry",
        "decode geometry unknown; allowed by allow_unknown_geometry",
    }


def test_v1_prefill_with_only_v0_decodes() -> None:
    snapshot = Snapshot(1, (pre(1, geo(2)),), (v0_dec(1),))
    orphan = (
        "prefill 10.0.0.1:8100 (p2p_nccl, tp 2, block 16, model m) has no compatible decode: "
        "decodes refused: decode geometry unknown (v0), the other side's is known "
        "(set allow_unknown_geometry to pair them)"
    )
    assert readiness(FleetIndex(snapshot, InFlight())) == Readiness(
        False, "no prefill has a compatible decode: " + orphan, (orphan,)
    )
    assert no_pair(rr().plan(snapshot, rq())).reason.endswith(orphan)
    allowed = Planner(RoundRobin(), RoundRobin(), allow_unknown_geometry=True)
    assert isinstance(allowed.plan(snapshot, rq()), Pair)
    assert readiness(allowed.index(snapshot)) == Readiness(True, "ok")


def test_partial_geometry_counts_as_unknown() -> None:
    partial = pre(1, Geometry(tp_size=2, block_size=16), P2P)
    snapshot = Snapshot(1, (partial,), (v0_dec(1), dec(2, geo(2))))
    result = plan_many(rr(), snapshot, 4)
    assert {r.decode for r in result} == {v0_dec(1)}
    assert all(isinstance(plan_of(r), Unverified) for r in result)


# ---------------------------------------------------------------------------------------------
# KV ports


def test_prefill_whose_kv_ports_pass_65535_is_never_chosen() -> None:
    fits = pre(1, geo(2), zmq_port=21001)
    edge = pre(2, geo(2), zmq_port=65535)  # ranks 0 and 1: 65535, 65536
    last = pre(3, geo(2), zmq_port=65534)  # 65534, 65535: fits
    snapshot = Snapshot(1, (fits, edge, last), (dec(1, geo(2)),))
    assert class_key(fits) == class_key(last) != class_key(edge)
    planner = rr()
    result = plan_many(planner, snapshot, 12)
    assert {r.prefill for r in result} == {fits, last}
    orphan = (
        "prefill 10.0.0.2:8100 (p2p_nccl, tp 2, block 16, model m) has no compatible decode: "
        "decodes refused: prefill KV ports 65535..65536 (one per tp rank) pass 65535"
    )
    assert readiness(planner.index(snapshot)) == Readiness(True, "ok", (orphan,))


def test_prefills_with_different_kv_ports_share_a_class() -> None:
    a, b = pre(1, geo(2), zmq_port=21001), pre(2, geo(2), zmq_port=30001)
    snapshot = Snapshot(1, (a, b), (dec(1, geo(2)),))
    assert class_key(a) == class_key(b)
    result = plan_many(rr(), snapshot, 4)
    assert [r.prefill for r in result] == [a, b, a, b]


def test_the_listing_agrees_with_the_planner_on_partial_geometry_ports() -> None:
    # Only tp announced, KV ports 65534..65537: the planner and /v1/instances/pairs must both
    # refuse the pair (the port rule holds whatever else of the geometry is unknown).
    edge = pre(1, Geometry(tp_size=4), P2P, zmq_port=65534)
    snapshot = Snapshot(1, (edge,), (v0_dec(1),))
    planner = Planner(RoundRobin(), RoundRobin(), allow_unknown_geometry=True)
    assert isinstance(planner.plan(snapshot, rq()), NoPair)
    (entry,) = pairs_report(planner.index(snapshot))
    assert entry["compatible"] == []
    assert entry["incompatible"][0]["mismatch"] == "invalid_geometry"


@pytest.mark.parametrize(
    ("p_connector", "d_connector", "expected"),
    [(NIXL, NIXL, NIXL), (P2P, P2P, P2P), (None, NIXL, None), (NIXL, None, None)],
)
def test_a_pair_uses_a_connectors_flow_only_if_both_announced_it(
    p_connector: Connector | None, d_connector: Connector | None, expected: Connector | None
) -> None:
    # kv_transfer_params go only where both sides said nixl: a prefill that announced nothing
    # (stock vLLM's v0) would answer without them.
    pair = Pair(pre(1, None, p_connector), dec(1, None, d_connector))
    assert pair.connector is expected
