"""pdproxy.pairing: compatibility, the round-robin policy, the planner and readiness. Pure."""

from __future__ import annotations

import random
import string
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.base.roles import Role
from pdproxy.ids import Address
from pdproxy.pairing.candidates import Candidates
from pdproxy.pairing.features import RequestFeatures
from pdproxy.pairing.inflight import InFlight
from pdproxy.pairing.planner import (
    FleetIndex,
    NoPair,
    Pair,
    Planner,
    Readiness,
    readiness,
    round_robin_planner,
)
from pdproxy.pairing.policies.base import Policy
from pdproxy.pairing.policies.round_robin import RoundRobin
from pdproxy.proxy.prompt import request_features
from pdproxy.registry.table import Instance, Snapshot, Source

# Deterministic and load-tolerant: same examples every run, no deadline, no example database.
PROFILE = settings(derandomize=True, database=None, deadline=None)


def p(n: int, model: str | None = "m", source: Source | None = None) -> Instance:
    src = source if source is not None else (Source.V0 if model is None else Source.V1)
    return Instance(
        Role.PREFILL, Address(f"10.0.0.{n}", 8100), Address(f"10.0.0.{n}", 21001), src, model=model
    )


def d(n: int, model: str | None = "m", source: Source | None = None) -> Instance:
    src = source if source is not None else (Source.V0 if model is None else Source.V1)
    return Instance(
        Role.DECODE, Address(f"10.0.1.{n}", 8200), Address(f"10.0.1.{n}", 22001), src, model=model
    )


def snap(
    prefills: tuple[Instance, ...], decodes: tuple[Instance, ...], version: int = 1
) -> Snapshot:
    return Snapshot(version, prefills, decodes)


def planner() -> Planner:
    """Two plain round-robin cursors (the planner would spread them by default)."""
    return Planner(RoundRobin(), RoundRobin(), spread_pairs=False)


def rq(model: str) -> RequestFeatures:
    return RequestFeatures(model)


def pair_of(result: Pair | NoPair) -> tuple[Instance, Instance]:
    assert isinstance(result, Pair), result
    return result.prefill, result.decode


def reason_of(result: Pair | NoPair) -> str:
    assert isinstance(result, NoPair), result
    return result.reason


def index_of(snapshot: Snapshot) -> FleetIndex:
    return FleetIndex(snapshot, InFlight())


def compatible(prefill: Instance, decode: Instance, model: str) -> bool:
    """The oracle for instances without geometry: both serve the model, and agree on it."""
    agree = prefill.model is None or decode.model is None or prefill.model == decode.model
    return prefill.serves(model) and decode.serves(model) and agree


def pairs(pl: Planner, snapshot: Snapshot, model: str, n: int) -> list[Pair]:
    out: list[Pair] = []
    for _ in range(n):
        result = pl.plan(snapshot, rq(model))
        assert isinstance(result, Pair), result
        out.append(result)
    return out


# ---------------------------------------------------------------------------------------------
# compatibility


@pytest.mark.parametrize(
    ("p_model", "d_model", "model", "expected"),
    [
        ("a", "a", "a", True),
        ("a", "a", "b", False),
        ("a", "b", "a", False),
        ("a", "b", "b", False),
        (None, "a", "a", True),
        ("a", None, "a", True),
        (None, None, "anything", True),
        (None, "a", "b", False),
        ("a", None, "b", False),
    ],
)
def test_model_compatibility(
    p_model: str | None, d_model: str | None, model: str, expected: bool
) -> None:
    result = planner().plan(snap((p(1, p_model),), (d(1, d_model),)), rq(model))
    assert isinstance(result, Pair) is expected


# ---------------------------------------------------------------------------------------------
# round robin


def test_round_robin_policy() -> None:
    policy: Policy = RoundRobin()
    candidates = Candidates((p(1), p(2), p(3)), InFlight(), 1000)
    assert policy.name == "round_robin"
    assert [policy.choose(candidates, rq("m"), t) for t in range(7)] == [
        p(1),
        p(2),
        p(3),
        p(1),
        p(2),
        p(3),
        p(1),
    ]


def test_round_robin_2p_2d_splits_100_plans_evenly() -> None:
    prefills, decodes = (p(1), p(2)), (d(1), d(2))
    result = pairs(planner(), snap(prefills, decodes), "m", 100)
    assert Counter(r.prefill for r in result) == {p(1): 50, p(2): 50}
    assert Counter(r.decode for r in result) == {d(1): 50, d(2): 50}
    assert [(r.prefill, r.decode) for r in result[:4]] == [
        (p(1), d(1)),
        (p(2), d(2)),
        (p(1), d(1)),
        (p(2), d(2)),
    ]


def test_spread_round_robin_walks_every_pair_evenly() -> None:
    prefills, decodes = (p(1), p(2)), (d(1), d(2))
    result = pairs(round_robin_planner(), snap(prefills, decodes), "m", 100)
    assert Counter(r.prefill for r in result) == {p(1): 50, p(2): 50}
    assert Counter(r.decode for r in result) == {d(1): 50, d(2): 50}
    assert Counter((r.prefill, r.decode) for r in result) == {
        (p(1), d(1)): 25,
        (p(1), d(2)): 25,
        (p(2), d(1)): 25,
        (p(2), d(2)): 25,
    }


@pytest.mark.parametrize("n_prefill", [1, 2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("n_decode", [1, 2, 3, 4, 6])
def test_spread_round_robin_is_even_per_role_and_per_pair(n_prefill: int, n_decode: int) -> None:
    prefills = tuple(p(i) for i in range(n_prefill))
    decodes = tuple(d(i) for i in range(n_decode))
    plans = n_prefill * n_decode * n_decode * 2
    result = pairs(round_robin_planner(), snap(prefills, decodes), "m", plans)
    assert set(Counter(r.prefill for r in result).values()) == {plans // n_prefill}
    assert set(Counter(r.decode for r in result).values()) == {plans // n_decode}
    by_pair = Counter((r.prefill, r.decode) for r in result)
    assert len(by_pair) == n_prefill * n_decode
    assert set(by_pair.values()) == {plans // (n_prefill * n_decode)}


@pytest.mark.parametrize("spread", [False, True])
def test_a_first_ticket_starts_both_rotations_that_far_in(spread: bool) -> None:
    fleet = snap((p(1), p(2), p(3)), (d(1), d(2)))
    from_zero = pairs(Planner(RoundRobin(), RoundRobin(), spread_pairs=spread), fleet, "m", 40)
    later = Planner(RoundRobin(), RoundRobin(), spread_pairs=spread, first_ticket=7)
    assert pairs(later, fleet, "m", 33) == from_zero[7:]


def test_a_negative_first_ticket_is_refused() -> None:
    with pytest.raises(ValueError, match="first_ticket"):
        Planner(RoundRobin(), RoundRobin(), first_ticket=-1)


def test_prefill_and_decode_tickets_are_independent() -> None:
    # 2 prefills and 3 decodes: the two cursors turn at their own pace, so six plans visit all
    # six combinations and every plan after that repeats them.
    result = pairs(planner(), snap((p(1), p(2)), (d(1), d(2), d(3))), "m", 12)
    combos = [(r.prefill.name, r.decode.name) for r in result]
    assert len(set(combos[:6])) == 6
    assert combos[6:] == combos[:6]
    assert [r.prefill for r in result[:3]] == [p(1), p(2), p(1)]
    assert [r.decode for r in result[:4]] == [d(1), d(2), d(3), d(1)]


def test_tickets_are_per_role_not_per_model() -> None:
    snapshot = snap((p(1, "a"), p(2, None)), (d(1, "a"), d(2, None)))
    pl = planner()
    first = pl.plan(snapshot, rq("a"))
    second = pl.plan(snapshot, rq("zzz"))  # only the model-less pair serves it
    third = pl.plan(snapshot, rq("a"))
    assert isinstance(first, Pair) and isinstance(second, Pair) and isinstance(third, Pair)
    assert (first.prefill, first.decode) == (p(1, "a"), d(1, "a"))
    assert (second.prefill, second.decode) == (p(2, None), d(2, None))
    assert (third.prefill, third.decode) == (p(1, "a"), d(1, "a"))  # tickets 2 % 2 == 0


def test_no_pair_does_not_advance_tickets() -> None:
    snapshot = snap((p(1), p(2)), (d(1), d(2)))
    pl = planner()
    assert isinstance(pl.plan(snapshot, rq("unknown")), NoPair)
    result = pairs(pl, snapshot, "m", 2)
    assert [(r.prefill, r.decode) for r in result] == [(p(1), d(1)), (p(2), d(2))]


class _Recording:
    name = "recording"

    def __init__(self) -> None:
        self.tickets: list[int] = []

    def choose(self, candidates: Candidates, request: RequestFeatures, ticket: int) -> Instance:
        self.tickets.append(ticket)
        return candidates.instances[0]


def test_policies_receive_consecutive_tickets_per_role() -> None:
    prefill_policy, decode_policy = _Recording(), _Recording()
    pl = Planner(prefill_policy, decode_policy)
    snapshot = snap((p(1),), (d(1),))
    for _ in range(5):
        pl.plan(snapshot, rq("m"))
    assert prefill_policy.tickets == [0, 1, 2, 3, 4]
    assert decode_policy.tickets == [0, 1, 2, 3, 4]


# ---------------------------------------------------------------------------------------------
# model filtering


def test_model_filtering() -> None:
    snapshot = snap((p(1, "a"), p(2, "b"), p(3, "a")), (d(1, "b"), d(2, "a"), d(3, "a")))
    pl = planner()
    for model, prefills, decodes in (
        ("a", {p(1, "a"), p(3, "a")}, {d(2, "a"), d(3, "a")}),
        ("b", {p(2, "b")}, {d(1, "b")}),
    ):
        result = pairs(pl, snapshot, model, 40)
        assert {r.prefill for r in result} == prefills
        assert {r.decode for r in result} == decodes
        assert all(r.prefill.model == r.decode.model == model for r in result)


def test_model_less_instances_serve_any_model_and_pair_with_anything() -> None:
    snapshot = snap((p(1, None), p(2, "a")), (d(1, None), d(2, "a")))
    pl = planner()
    result = pairs(pl, snapshot, "a", 40)
    assert {r.prefill for r in result} == set(snapshot.prefills)
    assert {r.decode for r in result} == set(snapshot.decodes)
    view = pl.index(snapshot).view("a")
    assert view.prefills is not None
    assert set(view.prefills) == set(snapshot.prefills)
    for prefill in snapshot.prefills:  # every prefill may pair with every decode
        assert set(view.decodes_for(prefill)) == set(snapshot.decodes)
    other = pairs(pl, snapshot, "other", 10)
    assert {(r.prefill, r.decode) for r in other} == {(p(1, None), d(1, None))}


def test_v0_prefill_pairs_with_v1_decode() -> None:
    snapshot = snap((p(1, None),), (d(1, "a"),))
    result = planner().plan(snapshot, rq("a"))
    assert pair_of(result) == (p(1, None), d(1, "a"))
    assert reason_of(planner().plan(snapshot, rq("b"))) == ("no decode instance serves model 'b'")


def test_v1_prefill_pairs_with_v0_decode() -> None:
    snapshot = snap((p(1, "a"),), (d(1, None),))
    assert pair_of(planner().plan(snapshot, rq("a"))) == (p(1, "a"), d(1, None))
    assert reason_of(planner().plan(snapshot, rq("b"))) == ("no prefill instance serves model 'b'")


def test_static_model_less_instance_serves_any_model() -> None:
    snapshot = snap((p(1, None, Source.STATIC),), (d(1, None, Source.STATIC),))
    result = planner().plan(snapshot, rq("whatever"))
    assert pair_of(result) == (p(1, None, Source.STATIC), d(1, None, Source.STATIC))


@settings(PROFILE, max_examples=200)
@given(
    p_models=st.lists(st.sampled_from([None, "a", "b", "c"]), min_size=0, max_size=5),
    d_models=st.lists(st.sampled_from([None, "a", "b", "c"]), min_size=0, max_size=5),
    model=st.sampled_from(["a", "b", "c", "zzz"]),
)
def test_plans_are_always_compatible_and_complete(
    p_models: list[str | None], d_models: list[str | None], model: str
) -> None:
    prefills = tuple(p(i, m) for i, m in enumerate(p_models))
    decodes = tuple(d(i, m) for i, m in enumerate(d_models))
    snapshot = snap(prefills, decodes)
    possible = {(x, y) for x in prefills for y in decodes if compatible(x, y, model)}
    pl = planner()
    seen = set()
    for _ in range(max(1, 2 * len(prefills) * len(decodes))):
        result = pl.plan(snapshot, rq(model))
        if not possible:
            assert isinstance(result, NoPair)
            assert repr(model) in result.reason
            return
        assert isinstance(result, Pair)
        assert (result.prefill, result.decode) in possible
        seen.add(result.prefill)
    assert seen == {x for x, _ in possible}


# ---------------------------------------------------------------------------------------------
# NoPair reasons


@pytest.mark.parametrize(
    ("prefills", "decodes", "reason"),
    [
        ((), (), "no prefill and no decode instance serves model 'm'"),
        ((p(1),), (), "no decode instance serves model 'm'"),
        ((), (d(1),), "no prefill instance serves model 'm'"),
        ((p(1, "other"),), (d(1),), "no prefill instance serves model 'm'"),
        ((p(1),), (d(1, "other"),), "no decode instance serves model 'm'"),
        ((p(1, "x"),), (d(1, "y"),), "no prefill and no decode instance serves model 'm'"),
    ],
)
def test_no_pair_reasons(
    prefills: tuple[Instance, ...], decodes: tuple[Instance, ...], reason: str
) -> None:
    assert reason_of(planner().plan(snap(prefills, decodes), rq("m"))) == (reason)


def test_no_pair_reason_names_the_requested_model_every_time() -> None:
    # The memo shares one view between all unannounced model names; the reason must still name
    # the model this request asked for (and never another client's model name).
    snapshot = snap((p(1, "a"),), (d(1, "a"),))
    pl = planner()
    assert reason_of(pl.plan(snapshot, rq("x"))) == (
        "no prefill and no decode instance serves model 'x'"
    )
    assert reason_of(pl.plan(snapshot, rq("y"))) == (
        "no prefill and no decode instance serves model 'y'"
    )


def test_no_pair_reason_names_the_requested_model_missing_decode() -> None:
    snapshot = snap((p(1, None),), (d(1, "a"),))
    pl = planner()
    assert reason_of(pl.plan(snapshot, rq("x"))) == ("no decode instance serves model 'x'")
    assert reason_of(pl.plan(snapshot, rq("secret-model"))) == (
        "no decode instance serves model 'secret-model'"
    )


# ---------------------------------------------------------------------------------------------
# FleetIndex memo and invalidation


def test_index_memo_is_bounded_by_announced_models() -> None:
    snapshot = snap((p(1, "a"), p(2, None)), (d(1, "a"), d(2, None)))
    index = index_of(snapshot)
    rng = random.Random(1234)
    for _ in range(10_000):
        name = "".join(rng.choices(string.ascii_letters + string.digits + "/-_.", k=12))
        index.view("u-" + name)
    assert len(index._views) <= 2
    index.view("a")
    assert len(index._views) == 2


def test_index_views_for_unknown_models_serve_model_less_instances() -> None:
    snapshot = snap((p(1, "a"), p(2, None)), (d(1, "a"), d(2, None)))
    index = index_of(snapshot)
    view = index.view("unknown")
    assert view.prefills is not None
    assert view.prefills.instances == (p(2, None),)
    assert view.decodes_for(p(2, None)).instances == (d(2, None),)
    view_a = index.view("a")
    assert view_a.prefills is not None
    assert set(view_a.prefills) == {p(1, "a"), p(2, None)}
    assert set(view_a.decodes_for(p(1, "a"))) == {d(1, "a"), d(2, None)}
    assert index.view("a") is view_a


def test_planner_reuses_the_index_for_the_same_snapshot() -> None:
    snapshot = snap((p(1),), (d(1),))
    pl = planner()
    index = pl.index(snapshot)
    assert pl.index(snapshot) is index
    assert index.snapshot is snapshot


def test_a_new_snapshot_object_invalidates_the_index() -> None:
    pl = planner()
    old = snap((p(1),), (d(1),), version=1)
    old_index = pl.index(old)
    assert pair_of(pl.plan(old, rq("m"))) == (p(1), d(1))
    new = snap((p(2),), (d(2),), version=2)
    assert pair_of(pl.plan(new, rq("m"))) == (p(2), d(2))
    assert pl.index(new) is not old_index
    assert pl.index(new).snapshot is new
    # Identity, not equality: an equal but distinct snapshot also gets a fresh index.
    twin = snap((p(2),), (d(2),), version=2)
    assert pl.index(twin) is not pl.index(new)


def test_emptied_fleet_yields_no_pair() -> None:
    pl = planner()
    assert isinstance(pl.plan(snap((p(1),), (d(1),)), rq("m")), Pair)
    assert reason_of(pl.plan(snap((), ()), rq("m"))) == (
        "no prefill and no decode instance serves model 'm'"
    )


# ---------------------------------------------------------------------------------------------
# readiness


ORPHAN_A_B = (
    "prefill 10.0.0.1:8100 (connector unknown, geometry unknown, model A) has no compatible "
    "decode: decodes have model B"
)
ORPHAN_C_B = (
    "prefill 10.0.0.2:8100 (connector unknown, geometry unknown, model C) has no compatible "
    "decode: decodes have model B"
)
ORPHAN_A_CB = (
    "prefill 10.0.0.1:8100 (connector unknown, geometry unknown, model A) has no compatible "
    "decode: decodes have model C, model B"
)


@pytest.mark.parametrize(
    ("prefills", "decodes", "expected"),
    [
        ((), (), Readiness(False, "no prefill instance is registered")),
        ((p(1),), (), Readiness(False, "no decode instance is registered")),
        ((), (d(1),), Readiness(False, "no prefill instance is registered")),
        (
            (p(1, "A"),),
            (d(1, "B"),),
            Readiness(
                False,
                "no prefill has a compatible decode: " + ORPHAN_A_B,
                (ORPHAN_A_B,),
            ),
        ),
        (
            (p(1, "A"), p(2, "C")),
            (d(1, "B"), d(2, "B")),
            Readiness(
                False,
                "no prefill has a compatible decode: " + ORPHAN_A_B + "; " + ORPHAN_C_B,
                (ORPHAN_A_B, ORPHAN_C_B),
            ),
        ),
        ((p(1, None),), (d(1, "A"),), Readiness(True, "ok")),
        ((p(1, "A"),), (d(1, None),), Readiness(True, "ok")),
        ((p(1, None),), (d(1, None),), Readiness(True, "ok")),
        ((p(1, "A"),), (d(1, "A"),), Readiness(True, "ok")),
        (
            (p(1, "A"), p(2, "B")),
            (d(1, "C"), d(2, "B")),
            Readiness(True, "ok", (ORPHAN_A_CB,)),
        ),
    ],
    ids=[
        "empty",
        "only P",
        "only D",
        "P model A + D model B",
        "several models, none shared",
        "v0 P + v1 D",
        "v1 P + v0 D",
        "v0 P + v0 D",
        "same model",
        "one shared model",
    ],
)
def test_readiness(
    prefills: tuple[Instance, ...], decodes: tuple[Instance, ...], expected: Readiness
) -> None:
    assert readiness(index_of(snap(prefills, decodes))) == expected


@settings(PROFILE, max_examples=200)
@given(
    p_models=st.lists(st.sampled_from([None, "a", "b"]), max_size=4),
    d_models=st.lists(st.sampled_from([None, "a", "b"]), max_size=4),
)
def test_ready_iff_some_model_can_be_planned(
    p_models: list[str | None], d_models: list[str | None]
) -> None:
    snapshot = snap(
        tuple(p(i, m) for i, m in enumerate(p_models)),
        tuple(d(i, m) for i, m in enumerate(d_models)),
    )
    plannable = any(isinstance(planner().plan(snapshot, rq(m)), Pair) for m in ("a", "b", "zzz"))
    assert readiness(index_of(snapshot)).ready is plannable


# ---------------------------------------------------------------------------------------------
# prefill work: the prompt less what the prefill probably holds


SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 80}  # 2,320 chars


def turn(question: str) -> RequestFeatures:
    """A chat request under SYSTEM, its features as the proxy computes them (windows of 256,
    512 ... tokens)."""
    payload = {"messages": [SYSTEM, {"role": "user", "content": question}], "max_tokens": 50}
    return request_features(payload, "m", True, 256)


def test_a_prefill_sent_the_system_prompt_before_counts_only_the_rest() -> None:
    first, second, third = turn("What is the weather?"), turn("Tell me a joke."), turn("Why?")
    # The system prompt (with its framing, about 583 tokens) fills the 256 and 512 windows.
    assert [w.tokens for w in first.prefix_windows] == [256, 512, first.prompt_tokens]
    assert first.prefix_windows[:2] == second.prefix_windows[:2] == third.prefix_windows[:2]
    assert first.prefix_windows[2] != second.prefix_windows[2]

    pl = planner()  # round robin: p1, p2, p1
    prefills = (p(1), p(2))
    snapshot = snap(prefills, (d(1),))
    a, b, c = (pl.plan(snapshot, request) for request in (first, second, third))
    assert isinstance(a, Pair) and isinstance(b, Pair) and isinstance(c, Pair)
    assert (a.prefill, b.prefill, c.prefill) == (prefills[0], prefills[1], prefills[0])
    # p1 and p2 had never been sent the system prompt: the whole prompt is work.
    assert a.prefill_tokens == first.prompt_tokens
    assert b.prefill_tokens == second.prompt_tokens
    # p1 was: the third request's work is its tokens past the 512 it holds.
    assert c.prefill_tokens == third.prompt_tokens - 512 < 100
    assert (c.decode_tokens, a.decode_tokens) == (third.decode_tokens, first.decode_tokens)
    # In flight: the work, not the prompt tokens.
    busy = pl.inflight.get(prefills[0].http_address)
    assert (busy.requests, busy.tokens) == (2, a.prefill_tokens + c.prefill_tokens)
    assert pl.inflight.get(prefills[1].http_address).tokens == second.prompt_tokens
    for pair in (c, a, b):
        pl.release(pair.prefill.http_address, pair.prefill_tokens)
        pl.release(pair.decode.http_address, pair.decode_tokens)
    assert pl.inflight._busy == {}
    assert pl.inflight.total_requests() == 0
    # The cache outlives the legs. The same prompt again, to the prefill it was sent to, is
    # held whole by this model: its longest window is the whole prompt, so the work is the one
    # token vLLM computes even for a fully cached prompt (never 0: the load bound must see it).
    again = pl.plan(snapshot, second)  # ticket 3: p2
    assert isinstance(again, Pair)
    assert again.prefill == prefills[1]
    assert again.prefill_tokens == 1


def test_work_is_computed_before_the_request_is_recorded() -> None:
    # The first request of a prefix counts all of it, though it is then recorded as held.
    pl = Planner(_Recording(), _Recording())
    snapshot = snap((p(1),), (d(1),))
    request = turn("Hello")
    result = pl.plan(snapshot, request)
    assert isinstance(result, Pair)
    assert result.prefill_tokens == request.prompt_tokens
    address = p(1).http_address
    assert pl.prefix_cache.cached_tokens(request.prefix_windows, address) == request.prompt_tokens
    assert pl.inflight.get(address).tokens == request.prompt_tokens


def test_requests_without_windows_are_all_work() -> None:
    pl = Planner(_Recording(), _Recording())
    snapshot = snap((p(1),), (d(1),))
    request = RequestFeatures("m", 700, 800)
    for k in range(1, 4):
        result = pl.plan(snapshot, request)
        assert isinstance(result, Pair)
        assert result.prefill_tokens == 700
        assert pl.inflight.get(p(1).http_address).tokens == 700 * k
    assert len(pl.prefix_cache) == 0


def test_candidates_read_the_planners_prefix_cache() -> None:
    pl = planner()
    snapshot = snap((p(1), p(2)), (d(1),))
    view = pl.index(snapshot).view("m")
    assert view.prefills is not None
    assert view.prefills.prefix_cache is pl.prefix_cache
    assert view.decodes_for(p(1)).prefix_cache is pl.prefix_cache
    # A new snapshot's index shares the same cache: what was sent stays known.
    newer = snap((p(1), p(2)), (d(1),), version=2)
    view = pl.index(newer).view("m")
    assert view.prefills is not None
    assert view.prefills.prefix_cache is pl.prefix_cache
    # Two planners do not share one.
    assert planner().prefix_cache is not pl.prefix_cache
    # Built on its own, a candidate set has an empty cache of its own.
    alone = Candidates((p(1),), InFlight(), 1000)
    assert len(alone.prefix_cache) == 0
    assert alone.prefix_cache is not Candidates((p(1),), InFlight(), 1000).prefix_cache
    # So has a FleetIndex built without one.
    standalone = index_of(snapshot).view("m").prefills
    assert standalone is not None
    assert standalone.prefix_cache is not pl.prefix_cache
    assert len(standalone.prefix_cache) == 0
