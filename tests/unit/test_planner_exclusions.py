"""Keeping instances out of a plan: hard exclusions (ejected, drained, full), soft avoidance
(failed earlier in the same request), and the per-instance in-flight cap."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.pairing.planner import NoPair, Pair, Planner, Unpaired, without
from pdproxy.pairing.policies.least_loaded import LeastLoaded
from pdproxy.pairing.policies.round_robin import RoundRobin
from pdproxy.registry.table import Instance
from tests.unit.test_planner import d, p, rq, snap

SNAPSHOT = snap((p(1), p(2), p(3)), (d(1), d(2)))


def names(*instances: Instance) -> frozenset[str]:
    return frozenset(i.name for i in instances)


def chosen(result: Pair | NoPair) -> tuple[str, str]:
    assert isinstance(result, Pair), result
    return result.prefill.name, result.decode.name


def test_excluded_instances_are_never_chosen() -> None:
    planner = Planner(RoundRobin(), RoundRobin())
    excluded = names(p(2), d(1))
    for _ in range(20):
        prefill, decode = chosen(planner.plan(SNAPSHOT, rq("m"), excluded=excluded))
        assert prefill != p(2).name and decode == d(2).name
        planner.release(p(1).http_address if prefill == p(1).name else p(3).http_address, 0)
        planner.release(d(2).http_address, 0)


def test_excluding_every_prefill_is_no_pair() -> None:
    planner = Planner(RoundRobin(), RoundRobin())
    result = planner.plan(SNAPSHOT, rq("m"), excluded=names(p(1), p(2), p(3)))
    assert isinstance(result, NoPair) and result.kind is Unpaired.NO_PREFILL


def test_the_routing_index_is_kept_while_exclusions_stay_the_same() -> None:
    planner = Planner(RoundRobin(), RoundRobin())
    excluded = names(p(2))
    first = planner.index(SNAPSHOT, excluded)
    assert planner.index(SNAPSHOT, frozenset(excluded)) is first
    assert planner.index(SNAPSHOT) is not first


def test_avoided_instances_are_passed_over_when_others_remain() -> None:
    planner = Planner(LeastLoaded(), LeastLoaded())
    for _ in range(10):
        prefill, decode = chosen(planner.plan(SNAPSHOT, rq("m"), avoid=names(p(1), d(1))))
        assert prefill != p(1).name and decode == d(2).name


def test_avoidance_falls_back_rather_than_failing() -> None:
    planner = Planner(RoundRobin(), RoundRobin())
    single = snap((p(1),), (d(1),))
    assert chosen(planner.plan(single, rq("m"), avoid=names(p(1), d(1)))) == (p(1).name, d(1).name)


def test_avoidance_leaves_no_listener_behind() -> None:
    planner = Planner(LeastLoaded(), LeastLoaded())
    planner.plan(SNAPSHOT, rq("m"))
    listeners = planner.inflight.listener_count()
    for _ in range(50):
        planner.plan(SNAPSHOT, rq("m"), avoid=names(p(1)))
    assert planner.inflight.listener_count() == listeners


def test_an_instance_at_its_cap_is_full_until_a_leg_ends() -> None:
    planner = Planner(RoundRobin(), RoundRobin(), instance_cap=2)
    one = snap((p(1),), (d(1), d(2)))
    planner.plan(one, rq("m"))
    assert planner.full == frozenset()
    planner.plan(one, rq("m"))
    assert planner.full == names(p(1))
    planner.release(p(1).http_address, 1)
    assert planner.full == frozenset()


def test_no_cap_means_never_full() -> None:
    planner = Planner(RoundRobin(), RoundRobin())
    for _ in range(100):
        planner.plan(SNAPSHOT, rq("m"))
    assert planner.full == frozenset()


def test_without_is_identity_when_nothing_is_named() -> None:
    assert without(SNAPSHOT, frozenset()) is SNAPSHOT
    narrowed = without(SNAPSHOT, names(p(3), d(2)))
    assert narrowed.prefills == (p(1), p(2)) and narrowed.decodes == (d(1),)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(
    st.lists(st.tuples(st.booleans(), st.integers(0, 4)), min_size=1, max_size=80),
    st.integers(1, 3),
)
def test_the_cap_is_never_exceeded(steps: list[tuple[bool, int]], cap: int) -> None:
    """Planning only among instances not full keeps every instance at or below its cap."""
    planner = Planner(LeastLoaded(), LeastLoaded(), instance_cap=cap)
    held: list[Pair] = []
    for plan, pick in steps:
        if plan:
            result = planner.plan(SNAPSHOT, rq("m"), busy=planner.full)
            if isinstance(result, Pair):
                held.append(result)
        elif held:
            pair = held.pop(pick % len(held))
            planner.release(pair.prefill.http_address, pair.prefill_tokens)
            planner.release(pair.decode.http_address, pair.decode_tokens)
        for instance in (*SNAPSHOT.prefills, *SNAPSHOT.decodes):
            busy = planner.inflight.get(instance.http_address).requests
            assert busy <= cap
            assert (instance.name in planner.full) == (busy >= cap)


def test_busy_instances_are_never_a_fallback_and_the_routing_index_stays() -> None:
    planner = Planner(LeastLoaded(), LeastLoaded())
    index = planner.index(SNAPSHOT)
    busy = names(p(1), p(2), p(3))
    result = planner.plan(SNAPSHOT, rq("m"), busy=busy, avoid=names(d(1)))
    assert isinstance(result, NoPair)
    for _ in range(20):
        prefill, decode = chosen(planner.plan(SNAPSHOT, rq("m"), busy=names(p(1), d(2))))
        assert prefill != p(1).name and decode == d(1).name
    assert planner.index(SNAPSHOT) is index
