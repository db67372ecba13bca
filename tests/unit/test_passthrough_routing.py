"""Pass-through, the pure parts: the per-path role setting, the path table, which paths are
pdproxy's own, and the planner's choice of one instance of a role."""

from __future__ import annotations

import argparse

import pytest

from pdproxy.base.roles import Role
from pdproxy.config import (
    ConfigError,
    Settings,
    add_settings_arguments,
    load_settings,
    passthrough_roles,
)
from pdproxy.pairing.planner import Planner
from pdproxy.pairing.policies.round_robin import RoundRobin
from pdproxy.proxy.front import COMPLETION_PATHS, COUNTED_PATHS
from pdproxy.proxy.passthrough import (
    PASSTHROUGH_PATHS,
    UNKNOWN_LABEL,
    is_own_path,
    route_table,
)
from tests.unit.test_planner import d, p, snap

# -- the setting ---------------------------------------------------------------------------------


def test_roles_parse_by_name_and_by_wire_letter() -> None:
    assert passthrough_roles(["/tokenize=prefill", "/x/y=D", " /score = P "]) == {
        "/tokenize": Role.PREFILL,
        "/x/y": Role.DECODE,
        "/score": Role.PREFILL,
    }


def test_a_later_item_for_a_path_wins() -> None:
    assert passthrough_roles(["/tokenize=prefill", "/tokenize=decode"]) == {
        "/tokenize": Role.DECODE
    }


@pytest.mark.parametrize(
    ("item", "complaint"),
    [
        ("/tokenize", "is not PATH=ROLE"),
        ("tokenize=prefill", "is not PATH=ROLE"),
        ("=prefill", "is not PATH=ROLE"),
        ("/a b=prefill", "is not PATH=ROLE"),
        ("/tokenize=encoder", "the role is prefill or decode, not 'encoder'"),
        ("/tokenize=", "the role is prefill or decode"),
    ],
)
def test_bad_items_are_refused_with_the_item_named(item: str, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        passthrough_roles([item])
    with pytest.raises(ConfigError, match="passthrough_role"):
        load_settings(environ={"PDPROXY_PASSTHROUGH_ROLE": item})


def test_the_setting_comes_from_flags_env_and_commas() -> None:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    args = parser.parse_args(
        [
            "--passthrough-role",
            "/tokenize=prefill,/detokenize=prefill",
            "--passthrough-role",
            "/score=decode",
            "--passthrough-unknown-paths",
        ]
    )
    settings = load_settings(args, environ={})
    assert settings.passthrough_role == [
        "/tokenize=prefill",
        "/detokenize=prefill",
        "/score=decode",
    ]
    assert settings.passthrough_unknown_paths is True
    from_env = load_settings(environ={"PDPROXY_PASSTHROUGH_ROLE": "/a=P;/b=D"})
    assert passthrough_roles(from_env.passthrough_role) == {"/a": Role.PREFILL, "/b": Role.DECODE}
    assert Settings().passthrough_unknown_paths is False


# -- the path table ------------------------------------------------------------------------------


def test_every_known_path_goes_to_decode_unless_named() -> None:
    table = route_table(Settings(passthrough_role=["/tokenize=prefill", "/not/known=prefill"]))
    assert set(table) == set(PASSTHROUGH_PATHS)  # naming an unknown path adds no label
    assert table["/tokenize"] is Role.PREFILL
    assert {role for path, role in table.items() if path != "/tokenize"} == {Role.DECODE}


def test_the_table_holds_vllms_endpoints_and_none_of_pdproxys() -> None:
    expected = {"/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score", "/rerank"}
    expected |= {"/v1/rerank", "/v2/rerank", "/tokenize", "/detokenize", "/version"}
    expected |= {"/v1/chat/completions/render", "/v1/completions/derender"}
    assert expected <= set(PASSTHROUGH_PATHS)
    assert len(set(PASSTHROUGH_PATHS)) == len(PASSTHROUGH_PATHS)
    assert not set(PASSTHROUGH_PATHS) & (set(COMPLETION_PATHS) | COUNTED_PATHS)
    assert UNKNOWN_LABEL not in PASSTHROUGH_PATHS
    assert not any(is_own_path(path) for path in PASSTHROUGH_PATHS)


@pytest.mark.parametrize(
    "path",
    [
        *COUNTED_PATHS,
        "/v1/instances/10.0.0.1:8000",
        "/v1/instances/x/drain",
        "/v1/instancesx",
        "/v1/admin/x",
    ],
)
def test_pdproxys_own_paths_are_never_passed_through(path: str) -> None:
    # The front door skips the client key check for admin paths: passed through, they would
    # reach the instances without one.
    assert is_own_path(path)


@pytest.mark.parametrize("path", ["/v1/audio/transcriptions", "/v1/responses", "/", "/v1"])
def test_other_paths_are_not_pdproxys(path: str) -> None:
    assert not is_own_path(path)


# -- choosing one instance -----------------------------------------------------------------------


def planner() -> Planner:
    return Planner(RoundRobin(), RoundRobin(), spread_pairs=False)


def test_one_instance_of_the_role_serving_the_model_in_turn() -> None:
    fleet = snap((p(1, "m"), p(2, "other")), (d(1, "m"), d(2, "other"), d(3, "m")))
    plans = planner()
    chosen = [plans.plan_one(fleet, Role.DECODE, "m") for _ in range(4)]
    assert chosen == [d(1, "m"), d(3, "m"), d(1, "m"), d(3, "m")]
    assert plans.plan_one(fleet, Role.PREFILL, "other") == p(2, "other")
    assert plans.plan_one(fleet, Role.DECODE, "nobody's") is None
    # Counted in flight: each must be released, as a pair's legs are.
    assert plans.inflight.get(d(1, "m").http_address).requests == 2


def test_without_a_model_any_instance_of_the_role_serves() -> None:
    fleet = snap((), (d(1, "m"), d(2, "other")))
    plans = planner()
    assert {plans.plan_one(fleet, Role.DECODE, None) for _ in range(2)} == {
        d(1, "m"),
        d(2, "other"),
    }
    assert plans.plan_one(fleet, Role.PREFILL, None) is None  # no prefill at all


def test_a_decode_without_any_prefill_still_serves_alone() -> None:
    # Pairing would find nothing here; one instance alone needs no partner.
    assert planner().plan_one(snap((), (d(1, "m"),)), Role.DECODE, "m") == d(1, "m")


def test_excluded_and_busy_are_hard_avoided_is_soft() -> None:
    one, two = d(1, "m"), d(2, "m")
    fleet = snap((), (one, two))
    plans = planner()
    for _ in range(3):
        assert plans.plan_one(fleet, Role.DECODE, "m", excluded=frozenset({one.name})) == two
        assert plans.plan_one(fleet, Role.DECODE, "m", busy=frozenset({two.name})) == one
        assert plans.plan_one(fleet, Role.DECODE, "m", avoid=frozenset({one.name})) == two
    everything = frozenset({one.name, two.name})
    assert plans.plan_one(fleet, Role.DECODE, "m", excluded=everything) is None
    assert plans.plan_one(fleet, Role.DECODE, "m", busy=everything) is None
    # Every instance already failed this request: one of them is tried again.
    assert plans.plan_one(fleet, Role.DECODE, "m", avoid=everything) in (one, two)
