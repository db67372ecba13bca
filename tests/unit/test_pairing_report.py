"""pdproxy.pairing.report, listing and consistency: the sentences and tables operators read
(/ready, 503 reasons, GET /v1/instances/pairs, registry warnings). Pure."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdproxy.base.roles import Role
from pdproxy.pairing.consistency import contradiction
from pdproxy.pairing.geometry import Incompatible, Mismatch, Unverified, plan_pair, side_of
from pdproxy.pairing.inflight import InFlight
from pdproxy.pairing.listing import pairs_report
from pdproxy.pairing.planner import FleetIndex
from pdproxy.pairing.report import (
    describe,
    orphan_reason,
    role_word,
    traits,
    verdict_fields,
)
from pdproxy.registry.messages import Geometry
from pdproxy.registry.table import Instance, Snapshot
from tests.pairing_builders import NIXL, P2P, PDPROXY, dec, geo, pre


def orphans(prefills: tuple[Instance, ...], decodes: tuple[Instance, ...]) -> list[str]:
    return FleetIndex(Snapshot(1, prefills, decodes), InFlight()).orphans()


# ---------------------------------------------------------------------------------------------
# Traits and descriptions


@pytest.mark.parametrize(
    ("instance", "expected"),
    [
        (pre(1, geo(4)), "p2p_nccl, tp 4, block 16, model m"),
        (pre(1, geo(2, block=32), NIXL, None), "nixl, tp 2, block 32"),
        (pre(1, None, None, None), "connector unknown, geometry unknown"),
        (dec(1, None, PDPROXY, "llama"), "pdproxy, geometry unknown, model llama"),
        (pre(1, Geometry(tp_size=8)), "p2p_nccl, tp 8, model m"),  # partial geometry
        (pre(1, Geometry(block_size=64)), "p2p_nccl, block 64, model m"),
        (pre(1, Geometry()), "p2p_nccl, model m"),
    ],
)
def test_traits(instance: Instance, expected: str) -> None:
    assert traits(instance) == expected


def test_role_words() -> None:
    assert role_word(Role.PREFILL) == "prefill"
    assert role_word(Role.DECODE, plural=True) == "decodes"


def test_describe_names_up_to_three_members() -> None:
    members = tuple(pre(i, geo(4)) for i in range(1, 6))
    assert describe(members[:1]) == "prefill 10.0.0.1:8100 (p2p_nccl, tp 4, block 16, model m)"
    assert describe(members[:3]) == (
        "prefills 10.0.0.1:8100, 10.0.0.2:8100, 10.0.0.3:8100 (p2p_nccl, tp 4, block 16, model m)"
    )
    assert describe(members) == (
        "prefills 10.0.0.1:8100, 10.0.0.2:8100, 10.0.0.3:8100 and 2 more "
        "(p2p_nccl, tp 4, block 16, model m)"
    )
    assert describe((dec(7, geo(2)),)) == "decode 10.0.1.7:8200 (p2p_nccl, tp 2, block 16, model m)"


# ---------------------------------------------------------------------------------------------
# Orphan sentences


def head(prefill: Instance) -> str:
    return f"prefill {prefill.name} ({traits(prefill)}) has no compatible decode: "


@pytest.mark.parametrize(
    ("prefill", "decodes", "tail"),
    [
        (pre(1, geo(4)), (dec(1, geo(2)),), "decodes have tp 2"),
        (pre(1, geo(2)), (dec(1, geo(2, block=32)),), "decodes have block size 32"),
        (pre(1, geo(2)), (dec(1, geo(2), NIXL),), "decodes have connector nixl"),
        (pre(1, geo(2), NIXL), (dec(1, geo(2), P2P),), "decodes have connector p2p_nccl"),
        (pre(1, geo(2)), (dec(1, geo(2), model="B"),), "decodes have model B"),
        (pre(1, geo(2)), (dec(1, geo(2, layout="NHD")),), "decodes have layout NHD"),
        (pre(1, geo(2)), (dec(1, geo(2, dtype="fp8")),), "decodes have kv dtype fp8"),
        (pre(1, geo(2)), (dec(1, geo(2, layers=40)),), "decodes have 40 layers"),
        (
            pre(1, geo(2)),
            (dec(1, None),),
            "decodes refused: decode geometry unknown (v0), the other side's is known "
            "(set allow_unknown_geometry to pair them)",
        ),
        (
            pre(1, None),
            (dec(1, geo(2)),),
            "decodes refused: prefill geometry unknown (v0), the other side's is known "
            "(set allow_unknown_geometry to pair them)",
        ),
        (pre(1, geo(2)), (dec(1, geo(2, heads=4)),), "decodes refused: kv heads 8 vs 4"),
        (pre(1, geo(2)), (dec(1, geo(2, dim=64)),), "decodes refused: head_dim 128 vs 64"),
        (
            pre(1, geo(2)),
            (dec(1, geo(2, heads=6)),),  # 6 heads over tp 2 is fine; 8 vs 6 heads is not
            "decodes refused: kv heads 8 vs 6",
        ),
        (
            pre(1, geo(2, heads=6, dim=64)),
            (dec(1, geo(4, heads=6, dim=64), NIXL),),
            "decodes have connector nixl",
        ),
    ],
    ids=[
        "tp",
        "block size",
        "connector nixl",
        "connector p2p",
        "model",
        "layout",
        "dtype",
        "layers",
        "decode geometry unknown",
        "prefill geometry unknown",
        "heads",
        "head_dim",
        "heads 6",
        "connector before geometry",
    ],
)
def test_orphan_sentence(prefill: Instance, decodes: tuple[Instance, ...], tail: str) -> None:
    assert orphans((prefill,), decodes) == [head(prefill) + tail]


def test_orphan_sentence_quotes_the_verdict_when_both_sides_share_the_attribute() -> None:
    # Both NHD: "decodes have layout NHD" would blame the decodes for the prefill's own layout.
    prefill = pre(1, geo(2, layout="NHD"), NIXL)
    decodes = (dec(1, geo(4, layout="NHD"), NIXL), dec(2, geo(2, layout="HND"), NIXL))
    assert orphans((prefill,), decodes) == [
        head(prefill) + "decodes have layout HND; decodes refused: tp 2 vs tp 4 splits heads, "
        "which needs HND layout, not NHD (nixl)"
    ]


def test_orphan_sentence_lists_each_attribute_once_in_order() -> None:
    prefill = pre(1, geo(4))
    decodes = (
        dec(1, geo(2)),
        dec(2, geo(8)),
        dec(3, geo(2, block=32)),  # tp 2 again: p2p compares tp first
        dec(4, geo(4, block=32)),
    )
    assert orphans((prefill,), decodes) == [
        head(prefill) + "decodes have tp 2, tp 8, block size 32"
    ]


def test_orphan_sentence_mixes_attributes_and_refusals() -> None:
    prefill = pre(1, geo(4))
    decodes = (dec(1, geo(2)), dec(2, None), dec(3, geo(4, heads=4)))
    assert orphans((prefill,), decodes) == [
        head(prefill) + "decodes have tp 2; decodes refused: decode geometry unknown (v0), the "
        "other side's is known (set allow_unknown_geometry to pair them); kv heads 8 vs 4"
    ]


def test_orphans_are_only_prefills_no_decode_takes() -> None:
    tp2, tp4, nixl = pre(1, geo(2)), pre(2, geo(4)), pre(3, geo(2), NIXL)
    decodes = (dec(1, geo(2)), dec(2, geo(2)))
    assert orphans((tp2, tp4, nixl), decodes) == [
        head(tp4) + "decodes have tp 2",
        head(nixl) + "decodes have connector p2p_nccl",
    ]
    assert orphans((tp2,), decodes) == []
    assert orphans((tp4,), ()) == []  # no decode at all: readiness says so on its own


def test_orphan_reason_without_rejections_and_for_decodes() -> None:
    prefill = pre(1, geo(2))
    assert orphan_reason((prefill,), []) == head(prefill) + "no decode is registered"
    decode = dec(1, geo(2))
    verdict = Incompatible(Mismatch.TP, "tp 4 vs tp 2 (p2p_nccl needs equal tp)")
    assert orphan_reason((decode,), [(pre(2, geo(4)), verdict)]) == (
        f"decode {decode.name} ({traits(decode)}) has no compatible prefill: prefills have tp 4"
    )


# ---------------------------------------------------------------------------------------------
# verdict_fields


def test_fields_of_an_incompatible_pair() -> None:
    verdict = plan_pair(side_of(pre(1, geo(4))), side_of(dec(1, geo(2))))
    assert verdict_fields(verdict) == {
        "compatible": False,
        "mismatch": "tp",
        "reason": "tp 4 vs tp 2 (p2p_nccl needs equal tp)",
    }


def test_fields_of_an_unverified_pair() -> None:
    verdict = plan_pair(side_of(pre(1, None, None)), side_of(dec(1, None, None)))
    assert isinstance(verdict, Unverified)
    assert verdict_fields(verdict) == {
        "compatible": True,
        "verified": False,
        "reason": "geometry unknown on both sides",
    }


def test_fields_of_a_nixl_pair_with_larger_decode_tp() -> None:
    # 8 kv heads, prefill tp 2 (4 heads a rank), decode tp 4 (2 heads a rank).
    verdict = plan_pair(side_of(pre(1, geo(2), NIXL)), side_of(dec(1, geo(4), NIXL)))
    fields = verdict_fields(verdict)
    per_decode_rank = 2 * 32 * 2 * 128 * 2  # K and V, layers, heads, head_dim, bf16 bytes
    assert fields == {
        "compatible": True,
        "verified": True,
        "connector": "nixl",
        "tp_ratio": 2,
        "block_size_ratio": 1,
        "kv_bytes_per_token": per_decode_rank * 4,
        "prefill_kv_bytes_per_token_per_rank": per_decode_rank * 2,
        "decode_kv_bytes_per_token_per_rank": per_decode_rank,
        "kv_bytes_per_prefill_block": per_decode_rank * 4 * 16,
        "decode_rank_reads": [
            [{"prefill_rank": 0, "port": 21001, "heads": [0, 2]}],
            [{"prefill_rank": 0, "port": 21001, "heads": [2, 4]}],
            [{"prefill_rank": 1, "port": 21002, "heads": [4, 6]}],
            [{"prefill_rank": 1, "port": 21002, "heads": [6, 8]}],
        ],
    }
    json.dumps(fields)  # the route serialises it as is


def test_fields_of_a_nixl_pair_with_larger_prefill_tp() -> None:
    verdict = plan_pair(
        side_of(pre(1, geo(4), NIXL, zmq_port=30000)), side_of(dec(1, geo(2), NIXL))
    )
    fields = verdict_fields(verdict)
    assert fields["tp_ratio"] == -2
    assert fields["decode_rank_reads"] == [
        [
            {"prefill_rank": 0, "port": 30000, "heads": [0, 2]},
            {"prefill_rank": 1, "port": 30001, "heads": [2, 4]},
        ],
        [
            {"prefill_rank": 2, "port": 30002, "heads": [4, 6]},
            {"prefill_rank": 3, "port": 30003, "heads": [6, 8]},
        ],
    ]


def test_fields_of_an_mla_pair_and_an_unknown_dtype() -> None:
    mla = Geometry(2, 64, 61, 1, 576, "bfloat16", True, None)
    fields = verdict_fields(
        plan_pair(
            side_of(pre(1, mla, NIXL)),
            side_of(dec(1, Geometry(4, 64, 61, 1, 576, "bfloat16", True), NIXL)),
        )
    )
    assert fields["tp_ratio"] == 2
    assert fields["kv_bytes_per_token"] == 61 * 576 * 2 * 4  # one latent, per decode rank
    assert [[r["prefill_rank"] for r in reads] for reads in fields["decode_rank_reads"]] == [
        [0],
        [0],
        [1],
        [1],
    ]
    odd = verdict_fields(
        plan_pair(side_of(pre(1, geo(2, dtype="weird"))), side_of(dec(1, geo(2, dtype="weird"))))
    )
    assert odd["compatible"] is True
    assert odd["kv_bytes_per_token"] is None
    assert odd["kv_bytes_per_prefill_block"] is None


# ---------------------------------------------------------------------------------------------
# pairs_report


def test_pairs_report_lists_compatible_and_incompatible_decodes() -> None:
    p_a = pre(1, geo(2), zmq_port=21001)
    p_b = pre(2, geo(2), zmq_port=23001)  # same class as p_a, its own KV ports
    p_4 = pre(3, geo(4), zmq_port=25001)
    d_2 = (dec(1, geo(2)), dec(2, geo(2)))
    d_4 = (dec(3, geo(4)),)
    index = FleetIndex(Snapshot(1, (p_4, p_b, p_a), (*d_2, *d_4)), InFlight())
    report = pairs_report(index)
    json.dumps(report)
    assert [entry["prefill"] for entry in report] == [
        "10.0.0.1:8100",
        "10.0.0.2:8100",
        "10.0.0.3:8100",
    ]
    by_name = {entry["prefill"]: entry for entry in report}

    first = by_name["10.0.0.1:8100"]
    assert first["zmq_address"] == "10.0.0.1:21001"
    assert first["model"] == "m"
    assert first["traits"] == "p2p_nccl, tp 2, block 16, model m"
    assert [c["decodes"] for c in first["compatible"]] == [["10.0.1.1:8200", "10.0.1.2:8200"]]
    compatible = first["compatible"][0]
    assert compatible["verified"] is True
    assert compatible["tp_ratio"] == 1
    assert compatible["decode_rank_reads"] == [
        [{"prefill_rank": 0, "port": 21001, "heads": [0, 4]}],
        [{"prefill_rank": 1, "port": 21002, "heads": [4, 8]}],
    ]
    assert first["incompatible"] == [
        {
            "decodes": ["10.0.1.3:8200"],
            "compatible": False,
            "mismatch": "tp",
            "reason": "tp 2 vs tp 4 (p2p_nccl needs equal tp)",
        }
    ]

    second = by_name["10.0.0.2:8100"]  # each prefill's own port, not its class's first
    assert [
        [read["port"] for read in reads] for reads in second["compatible"][0]["decode_rank_reads"]
    ] == [[23001], [23002]]

    third = by_name["10.0.0.3:8100"]
    assert [c["decodes"] for c in third["compatible"]] == [["10.0.1.3:8200"]]
    assert [
        [read["port"] for read in reads] for reads in third["compatible"][0]["decode_rank_reads"]
    ] == [[25001], [25002], [25003], [25004]]
    assert [(i["decodes"], i["mismatch"]) for i in third["incompatible"]] == [
        (["10.0.1.1:8200", "10.0.1.2:8200"], "tp")
    ]


@pytest.mark.parametrize("allow", [False, True])
def test_pairs_report_follows_allow_unknown_geometry(allow: bool) -> None:
    index = FleetIndex(
        Snapshot(1, (pre(1, geo(2)),), (dec(1, None),)),
        InFlight(),
        allow_unknown_geometry=allow,
    )
    (entry,) = pairs_report(index)
    if allow:
        assert entry["incompatible"] == []
        assert entry["compatible"] == [
            {
                "decodes": ["10.0.1.1:8200"],
                "compatible": True,
                "verified": False,
                "reason": "decode geometry unknown; allowed by allow_unknown_geometry",
            }
        ]
    else:
        assert entry["compatible"] == []
        assert [i["mismatch"] for i in entry["incompatible"]] == ["unknown_geometry"]


def test_pairs_report_of_edge_fleets() -> None:
    assert pairs_report(FleetIndex(Snapshot(1, (), ()), InFlight())) == []
    assert pairs_report(FleetIndex(Snapshot(1, (), (dec(1, geo(2)),)), InFlight())) == []
    (alone,) = pairs_report(FleetIndex(Snapshot(1, (pre(1, None, None, None),), ()), InFlight()))
    assert alone == {
        "prefill": "10.0.0.1:8100",
        "zmq_address": "10.0.0.1:21001",
        "model": None,
        "traits": "connector unknown, geometry unknown",
        "compatible": [],
        "incompatible": [],
    }


def test_pairs_report_agrees_with_plan_pair_for_every_prefill() -> None:
    prefills = (
        pre(1, geo(2)),
        pre(2, geo(4), NIXL),
        pre(3, None, None, None),
        pre(4, geo(2, layout="NHD"), NIXL, model="other"),
    )
    decodes = (
        dec(1, geo(2)),
        dec(2, geo(2), NIXL),
        dec(3, geo(8), NIXL),
        dec(4, None, None, None),
        dec(5, geo(2, layout="NHD"), NIXL, model="other"),
    )
    report = pairs_report(FleetIndex(Snapshot(1, prefills, decodes), InFlight()))
    for entry, prefill in zip(report, prefills, strict=True):
        assert entry["prefill"] == prefill.name
        listed: dict[str, Any] = {}
        for group in ("compatible", "incompatible"):
            for item in entry[group]:
                for name in item["decodes"]:
                    listed[name] = (group, item)
        assert set(listed) == {d.name for d in decodes}  # every decode, exactly once
        for decode in decodes:
            group, item = listed[decode.name]
            verdict = plan_pair(side_of(prefill), side_of(decode))
            assert (group == "compatible") is not isinstance(verdict, Incompatible)
            assert {k: v for k, v in item.items() if k != "decodes"} == verdict_fields(verdict)


# ---------------------------------------------------------------------------------------------
# contradiction


def with_geometry(instance: Instance, geometry: Geometry | None) -> Instance:
    return Instance(
        instance.role,
        instance.http_address,
        instance.zmq_address,
        instance.source,
        model=instance.model,
        connector=instance.connector,
        geometry=geometry,
    )


@pytest.mark.parametrize(
    ("theirs", "difference"),
    [
        (geo(2, layers=40), "num_layers 32 vs 40"),
        (geo(2, heads=4), "num_kv_heads 8 vs 4"),
        (geo(2, dim=64), "head_dim 128 vs 64"),
        (geo(2, mla=True, layout=None), "is_mla False vs True"),
        (geo(2, layers=40, heads=4), "num_layers 32 vs 40, num_kv_heads 8 vs 4"),
    ],
)
def test_contradiction_names_model_fields(theirs: Geometry, difference: str) -> None:
    mine = pre(1, geo(2))
    other = dec(1, theirs)
    assert contradiction(mine, [other]) == (
        "10.0.0.1:8100 announces model 'm' with a geometry that contradicts "
        f"10.0.1.1:8200's: {difference}"
    )


@pytest.mark.parametrize(
    "theirs",
    [
        geo(4),
        geo(2, block=64),
        geo(2, dtype="fp8"),
        geo(2, layout="NHD"),
        geo(8, block=32, dtype="float16", layout="NHD"),
        Geometry(num_layers=32),  # partial and agreeing
        Geometry(tp_size=4),  # partial, nothing of the model's
    ],
)
def test_contradiction_ignores_deployment_fields(theirs: Geometry) -> None:
    assert contradiction(pre(1, geo(2)), [dec(1, theirs), pre(2, theirs)]) is None


def test_contradiction_ignores_other_models_and_unknowns() -> None:
    mine = pre(1, geo(2))
    assert contradiction(mine, [dec(1, geo(2, layers=40), model="other")]) is None
    assert contradiction(mine, [dec(1, geo(2, layers=40), model=None)]) is None
    assert contradiction(mine, [dec(1, None)]) is None
    assert (
        contradiction(pre(1, geo(2), model=None), [dec(1, geo(2, layers=40), model=None)]) is None
    )
    assert contradiction(pre(1, None), [dec(1, geo(2, layers=40))]) is None
    # Fields either side left out cannot disagree.
    assert (
        contradiction(pre(1, Geometry(num_layers=32)), [dec(1, Geometry(num_kv_heads=4))]) is None
    )


def test_contradiction_skips_the_instance_itself_and_its_older_self() -> None:
    mine = pre(1, geo(2))
    older = with_geometry(mine, geo(2, layers=40))  # the same address, re-announcing
    assert contradiction(mine, [mine, older]) is None
    assert contradiction(mine, [older, dec(1, geo(2, layers=40))]) == (
        "10.0.0.1:8100 announces model 'm' with a geometry that contradicts 10.0.1.1:8200's: "
        "num_layers 32 vs 40"
    )


def test_contradiction_names_the_first_disagreeing_instance() -> None:
    mine = pre(1, geo(2))
    others = [pre(2, geo(4)), dec(1, geo(2, dim=64)), dec(2, geo(2, layers=40))]
    found = contradiction(mine, iter(others))  # any iterable
    assert found is not None
    assert "10.0.1.1:8200's: head_dim 128 vs 64" in found
    assert "10.0.1.2:8200" not in found
