"""pdproxy.pairing.geometry: KV geometry compatibility, rank maps and KV bytes. Pure.

The oracles below restate vLLM's rules independently of the module: which decode rank reads
which prefill rank(s) (TpKVTopology.get_target_remote_ranks, compute_tp_mapping for MLA), which
heads a rank holds (QKVParallelLinear: shard rank = tp_rank // replicas), and which pairs the
NIXL handshake (_validate_remote_agent_handshake) or P2pNcclConnector would refuse.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.base.roles import Role
from pdproxy.ids import Address
from pdproxy.pairing.geometry import (
    Incompatible,
    KvGeometry,
    KvLayout,
    Mismatch,
    PairPlan,
    RankRead,
    Side,
    Unverified,
    Verdict,
    canonical_dtype,
    dtype_bytes,
    from_announced,
    plan_pair,
    side_of,
    tp_ratio,
)
from pdproxy.registry.messages import Connector, Geometry
from pdproxy.registry.table import Instance, Source

# Deterministic and load-tolerant: same examples every run, no deadline, no example database.
PROFILE = settings(derandomize=True, database=None, deadline=None)

PORT = 21001
HND, NHD = KvLayout.HND, KvLayout.NHD
TPS = (1, 2, 4, 8, 16)
HEADS = (1, 2, 8, 32)
BLOCKS = (16, 32, 64, 128)
HETEROGENEOUS = (Connector.NIXL, Connector.PDPROXY)


def geo(
    tp: int = 1,
    heads: int = 8,
    *,
    block: int = 16,
    layers: int = 32,
    dim: int = 128,
    dtype: str = "bfloat16",
    mla: bool = False,
    layout: KvLayout | None = HND,
) -> KvGeometry:
    return KvGeometry(tp, block, layers, heads, dim, dtype, mla, None if mla else layout)


def mla(tp: int = 1, *, block: int = 64, dtype: str = "bfloat16") -> KvGeometry:
    # DeepSeek-V3: 61 layers, one latent head of kv_lora_rank 512 + rope 64.
    return KvGeometry(tp, block, 61, 1, 576, dtype, is_mla=True)


def side(
    g: KvGeometry | None,
    connector: Connector | None = Connector.NIXL,
    model: str | None = "m",
    port: int = PORT,
) -> Side:
    return Side(model, connector, g, port)


def plan(p: KvGeometry, d: KvGeometry, connector: Connector | None = Connector.NIXL) -> Verdict:
    return plan_pair(side(p, connector), side(d, connector))


def ok(verdict: Verdict) -> PairPlan:
    assert isinstance(verdict, PairPlan), verdict
    return verdict


def refused(verdict: Verdict, kind: Mismatch) -> Incompatible:
    assert isinstance(verdict, Incompatible), verdict
    assert verdict.kind is kind, verdict
    assert verdict.detail and str(verdict) == verdict.detail
    return verdict


# ---------------------------------------------------------------------------------------------
# independent oracles


def held_heads(tp: int, heads: int, is_mla: bool, rank: int) -> list[int]:
    """Heads a rank holds: K/tp consecutive heads, or one head shared by tp/K neighbours."""
    if is_mla:
        return [0]
    if tp <= heads:
        return [rank * (heads // tp) + i for i in range(heads // tp)]
    replicas = tp // heads
    return [rank // replicas]


def vllm_sources(p_tp: int, d_tp: int, is_mla: bool, rank: int) -> list[int]:
    if is_mla:  # compute_tp_mapping: one replica
        return [rank * p_tp // d_tp]
    if d_tp >= p_tp:  # get_target_remote_ranks, tp_ratio > 0
        return [rank // (d_tp // p_tp)]
    n = p_tp // d_tp  # tp_ratio < 0
    return [rank * n + i for i in range(n)]


def expected_kind(connector: Connector, p: KvGeometry, d: KvGeometry) -> Mismatch | None:
    """The first rule a same-model, same-shape pair breaks, or None."""
    is_mla = p.is_mla
    if connector is Connector.P2P_NCCL:
        if p.tp_size != d.tp_size:
            return Mismatch.TP
        if p.block_size != d.block_size:
            return Mismatch.BLOCK_SIZE
        if not is_mla and p.kv_layout != d.kv_layout:
            return Mismatch.LAYOUT
        return None
    if connector is Connector.PDPROXY:
        if max(p.tp_size, d.tp_size) % min(p.tp_size, d.tp_size):
            return Mismatch.TP
        if d.block_size % p.block_size:
            return Mismatch.BLOCK_SIZE
        return None
    if connector is Connector.MOONCAKE:
        # vLLM's MooncakeConnector: one TP divides the other, equal block sizes, its own layout.
        if max(p.tp_size, d.tp_size) % min(p.tp_size, d.tp_size):
            return Mismatch.TP
        return Mismatch.BLOCK_SIZE if p.block_size != d.block_size else None
    # nixl and nixl_push (the same NIXL handshake and topology).
    if max(p.tp_size, d.tp_size) % min(p.tp_size, d.tp_size):
        return Mismatch.TP
    prefill_larger = p.tp_size > d.tp_size
    if prefill_larger and not is_mla and p.tp_size > p.num_kv_heads:
        return Mismatch.TP
    if d.block_size % p.block_size:
        return Mismatch.BLOCK_SIZE
    if prefill_larger and not is_mla and d.block_size != p.block_size:
        return Mismatch.BLOCK_SIZE
    if is_mla:
        return None
    if p.kv_layout != d.kv_layout:
        return Mismatch.LAYOUT
    splits_heads = p.tp_size != d.tp_size and p.tp_size <= p.num_kv_heads
    if splits_heads and p.kv_layout is not HND:
        return Mismatch.LAYOUT
    return None


def read_bytes(g: KvGeometry, read: RankRead) -> int:
    size = dtype_bytes(g.kv_dtype)
    assert size is not None
    return (1 if g.is_mla else 2) * g.num_layers * len(read.heads) * g.head_dim * size


def check_plan(result: PairPlan, p: KvGeometry, d: KvGeometry, port: int = PORT) -> None:
    """Every invariant a plan must satisfy, checked against the oracles."""
    assert result.prefill == p and result.decode == d
    if d.tp_size >= p.tp_size:
        assert result.tp_ratio == d.tp_size // p.tp_size
    else:
        assert result.tp_ratio == -(p.tp_size // d.tp_size)
    assert result.block_size_ratio * p.block_size == d.block_size
    assert len(result.reads) == d.tp_size

    readers: dict[tuple[int, int], set[int]] = {}  # (prefill rank, head) -> decode ranks
    for rank, reads in enumerate(result.reads):
        # vLLM's sources, each replica of the same heads read once (from the first holder).
        sources: dict[tuple[int, ...], int] = {}
        for source in vllm_sources(p.tp_size, d.tp_size, p.is_mla, rank):
            held = tuple(held_heads(p.tp_size, p.num_kv_heads, p.is_mla, source))
            sources.setdefault(held, source)
        assert [r.prefill_rank for r in reads] == list(sources.values())
        got: list[int] = []
        for read in reads:
            assert read.port == port + read.prefill_rank
            assert len(read.heads) > 0
            # Only heads the prefill rank really holds.
            assert set(read.heads) <= set(
                held_heads(p.tp_size, p.num_kv_heads, p.is_mla, read.prefill_rank)
            )
            got.extend(read.heads)
            for head in read.heads:
                readers.setdefault((read.prefill_rank, head), set()).add(rank)
        # Each decode rank gets all of its heads, each once, in order.
        assert got == held_heads(d.tp_size, d.num_kv_heads, d.is_mla, rank)

    if not p.replicated:
        # Disjoint prefill shares: each prefill head is read by exactly the decode ranks that
        # hold it.
        for q in range(p.tp_size):
            for head in held_heads(p.tp_size, p.num_kv_heads, False, q):
                needing = {
                    r
                    for r in range(d.tp_size)
                    if head in held_heads(d.tp_size, d.num_kv_heads, False, r)
                }
                assert readers.get((q, head), set()) == needing, (q, head)
    else:
        # Replicated prefill (MLA, or tp > heads): each head reaches exactly the decode ranks
        # needing it, from one replica each.
        for head in range(1 if p.is_mla else p.num_kv_heads):
            needing = {
                r
                for r in range(d.tp_size)
                if head in held_heads(d.tp_size, d.num_kv_heads, d.is_mla, r)
            }
            got_from = [ranks for (q, h), ranks in readers.items() if h == head]
            assert set[int]().union(*got_from) == needing
            assert sum(len(ranks) for ranks in got_from) == len(needing)

    # The bytes the reads carry are the bytes the plan announces.
    if result.bytes_per_token is not None:
        carried = sum(read_bytes(p, read) for reads in result.reads for read in reads)
        assert carried == result.bytes_per_token
        assert result.decode_bytes_per_token_per_rank is not None
        assert result.bytes_per_token == result.decode_bytes_per_token_per_rank * d.tp_size


# ---------------------------------------------------------------------------------------------
# exhaustive: every TP pair x heads (and MLA) x block sizes x layouts x connector

HEAD_CASES = [(h, False) for h in HEADS] + [(1, True)]
LAYOUT_CASES = [(HND, HND), (NHD, NHD), (NHD, HND), (HND, NHD)]


@pytest.mark.parametrize("connector", [Connector.NIXL, Connector.PDPROXY, Connector.P2P_NCCL])
@pytest.mark.parametrize(("heads", "is_mla"), HEAD_CASES)
@pytest.mark.parametrize(("p_tp", "d_tp"), list(itertools.product(TPS, TPS)))
def test_every_tp_pair_heads_block_and_layout(
    connector: Connector, heads: int, is_mla: bool, p_tp: int, d_tp: int
) -> None:
    dim = 576 if is_mla else 128
    layouts = [(None, None)] if is_mla else LAYOUT_CASES
    for p_block, d_block in itertools.product(BLOCKS, BLOCKS):
        for p_layout, d_layout in layouts:
            p = geo(p_tp, heads, block=p_block, dim=dim, mla=is_mla, layout=p_layout)
            d = geo(d_tp, heads, block=d_block, dim=dim, mla=is_mla, layout=d_layout)
            verdict = plan(p, d, connector)
            kind = expected_kind(connector, p, d)
            if kind is None:
                check_plan(ok(verdict), p, d)
            else:
                refused(verdict, kind)


def test_exhaustive_matrix_admits_what_vllm_admits() -> None:
    """Spot counts over the matrix, so a rule that silently admits or refuses all shows up."""
    admitted = {c: 0 for c in (Connector.NIXL, Connector.P2P_NCCL)}
    for connector in admitted:
        for (heads, is_mla), p_tp, d_tp, p_block, d_block in itertools.product(
            HEAD_CASES, TPS, TPS, BLOCKS, BLOCKS
        ):
            p = geo(p_tp, heads, block=p_block, dim=576 if is_mla else 128, mla=is_mla)
            d = geo(d_tp, heads, block=d_block, dim=576 if is_mla else 128, mla=is_mla)
            admitted[connector] += isinstance(plan(p, d, connector), PairPlan)
    # p2p_nccl: only the diagonal (5 TP sizes x 4 block sizes) for each of the 5 head cases.
    assert admitted[Connector.P2P_NCCL] == 5 * 5 * 4
    assert admitted[Connector.NIXL] > admitted[Connector.P2P_NCCL]


# ---------------------------------------------------------------------------------------------
# concrete rank maps


def reads_of(result: PairPlan) -> list[list[tuple[int, int, list[int]]]]:
    return [[(r.prefill_rank, r.port, list(r.heads)) for r in reads] for reads in result.reads]


def test_decode_tp_larger_reads_head_slices_of_one_prefill_rank() -> None:
    result = ok(plan(geo(2), geo(4)))  # Llama-3-8B: 8 kv heads
    assert result.tp_ratio == 2
    assert reads_of(result) == [
        [(0, 21001, [0, 1])],
        [(0, 21001, [2, 3])],
        [(1, 21002, [4, 5])],
        [(1, 21002, [6, 7])],
    ]


def test_prefill_tp_larger_reads_several_prefill_ranks() -> None:
    result = ok(plan(geo(4), geo(2)))
    assert result.tp_ratio == -2
    assert reads_of(result) == [
        [(0, 21001, [0, 1]), (1, 21002, [2, 3])],
        [(2, 21003, [4, 5]), (3, 21004, [6, 7])],
    ]


def test_decode_replicates_heads_past_tp_equal_heads() -> None:
    result = ok(plan(geo(4), geo(16)))  # 8 heads: decode ranks 2h and 2h+1 share head h
    assert result.tp_ratio == 4
    assert [reads[0].prefill_rank for reads in result.reads] == [r // 4 for r in range(16)]
    assert [list(reads[0].heads) for reads in result.reads] == [[r // 2] for r in range(16)]


def test_both_sides_replicated() -> None:
    result = ok(plan(geo(2, 1), geo(8, 1)))  # one kv head everywhere (MQA)
    assert reads_of(result) == [[(r // 4, 21001 + r // 4, [0])] for r in range(8)]


def test_mla_reads_one_replica_spread_over_prefill_ranks() -> None:
    result = ok(plan(mla(8), mla(2)))
    assert result.tp_ratio == -4
    assert reads_of(result) == [[(0, 21001, [0])], [(4, 21005, [0])]]
    result = ok(plan(mla(2), mla(8)))
    assert reads_of(result) == [[(r // 4, 21001 + r // 4, [0])] for r in range(8)]


def test_p2p_nccl_rank_reads_same_rank() -> None:
    result = ok(plan(geo(4), geo(4), Connector.P2P_NCCL))
    assert (result.tp_ratio, result.block_size_ratio) == (1, 1)
    assert reads_of(result) == [[(r, 21001 + r, [2 * r, 2 * r + 1])] for r in range(4)]


def test_ports_follow_the_prefill_zmq_port() -> None:
    result = ok(plan_pair(side(geo(4), port=30000), side(geo(2), port=40000)))
    assert [[r.port for r in reads] for reads in result.reads] == [[30000, 30001], [30002, 30003]]


def test_block_size_ratio() -> None:
    assert ok(plan(geo(2, block=16), geo(4, block=64))).block_size_ratio == 4
    assert ok(plan(mla(8, block=16), mla(2, block=64))).block_size_ratio == 4


# ---------------------------------------------------------------------------------------------
# operator-facing reasons


@pytest.mark.parametrize(
    ("p", "d", "connector", "kind", "detail"),
    [
        (geo(4), geo(2), Connector.P2P_NCCL, Mismatch.TP, "tp 4 vs tp 2 (p2p_nccl needs equal tp)"),
        (
            geo(2, block=32),
            geo(2, block=16),
            Connector.NIXL,
            Mismatch.BLOCK_SIZE,
            "decode block size 16 not a multiple of prefill's 32",
        ),
        (
            geo(2, block=16),
            geo(2, block=32),
            Connector.P2P_NCCL,
            Mismatch.BLOCK_SIZE,
            "block size 16 vs 32 (p2p_nccl needs equal block sizes)",
        ),
        (
            geo(4, 12),
            geo(6, 12),
            Connector.NIXL,
            Mismatch.TP,
            "tp 4 vs tp 6 (nixl needs one tp to divide the other)",
        ),
        (
            geo(4, 12),
            geo(6, 12),
            Connector.PDPROXY,
            Mismatch.TP,
            "tp 4 vs tp 6 (pdproxy's connector needs one tp to divide the other)",
        ),
        (
            geo(4, block=16),
            geo(2, block=32),
            Connector.NIXL,
            Mismatch.BLOCK_SIZE,
            "decode block size 32 must equal prefill's 16 when prefill tp 4 > decode tp 2 (nixl)",
        ),
        (
            geo(2, layout=NHD),
            geo(4, layout=NHD),
            Connector.NIXL,
            Mismatch.LAYOUT,
            "tp 2 vs tp 4 splits heads, which needs HND layout, not NHD (nixl)",
        ),
        (
            geo(2, layout=NHD),
            geo(2, layout=HND),
            Connector.NIXL,
            Mismatch.LAYOUT,
            "kv layout NHD vs HND (nixl needs the same)",
        ),
        (geo(1), geo(1, layers=40), Connector.NIXL, Mismatch.LAYERS, "layers 32 vs 40"),
        (geo(1), geo(1, 4), Connector.NIXL, Mismatch.HEADS, "kv heads 8 vs 4"),
        (geo(1), geo(1, dim=64), Connector.NIXL, Mismatch.HEADS, "head_dim 128 vs 64"),
        (
            geo(1, 1, dim=576),
            mla(1),
            Connector.NIXL,
            Mismatch.LAYERS,
            "layers 32 vs 61",
        ),
        (
            geo(1, 1, layers=61, dim=576),
            mla(1),
            Connector.NIXL,
            Mismatch.HEADS,
            "only the decode side uses MLA",
        ),
        (
            geo(1),
            geo(1, dtype="float16"),
            Connector.NIXL,
            Mismatch.DTYPE,
            "kv dtype bfloat16 vs float16",
        ),
        (
            geo(4, 6),
            geo(4, 8),
            Connector.NIXL,
            Mismatch.INVALID_GEOMETRY,
            "prefill: 6 kv heads do not split evenly over tp 4",
        ),
        (
            geo(4, 8),
            geo(12, 8),
            Connector.NIXL,
            Mismatch.INVALID_GEOMETRY,
            "decode: tp 12 is not a multiple of its 8 kv heads",
        ),
    ],
)
def test_reasons(
    p: KvGeometry, d: KvGeometry, connector: Connector, kind: Mismatch, detail: str
) -> None:
    assert refused(plan(p, d, connector), kind).detail == detail


def test_mixed_tp_equal_heads_with_replicated_prefill_needs_no_hnd() -> None:
    # Prefill tp 4 > 2 heads: each prefill rank holds one whole head, nothing is split.
    p, d = geo(4, 2, layout=NHD), geo(8, 2, layout=NHD)
    check_plan(ok(plan(p, d)), p, d)
    # With heads split, the same layout is refused.
    refused(plan(geo(2, 2, layout=NHD), geo(4, 2, layout=NHD)), Mismatch.LAYOUT)


def test_mla_allows_block_ratio_with_prefill_tp_larger() -> None:
    result = ok(plan(mla(8, block=16), mla(2, block=32)))
    assert (result.tp_ratio, result.block_size_ratio) == (-4, 2)


@pytest.mark.parametrize("connector", list(Connector))
def test_mla_ignores_announced_layouts(connector: Connector) -> None:
    # An MLA cache has no head axis: NHD and HND name the same bytes.
    p, d = replace(mla(2), kv_layout=NHD), replace(mla(2), kv_layout=HND)
    ok(plan(p, d, connector))


def test_mla_is_one_latent_whatever_heads_are_announced() -> None:
    # vLLM reports one KV head for MLA; a larger count must not multiply the latent.
    g = replace(mla(4), num_kv_heads=16)
    assert g.heads_per_rank == 1 and g.rank_heads(3) == range(1)
    assert g.bytes_per_token_per_rank == mla(4).bytes_per_token_per_rank


# ---------------------------------------------------------------------------------------------
# connector, model, unknown geometry


@pytest.mark.parametrize(("a", "b"), list(itertools.permutations(list(Connector), 2)))
def test_different_connectors_never_pair(a: Connector, b: Connector) -> None:
    verdict = plan_pair(side(geo(1), a), side(geo(1), b))
    assert refused(verdict, Mismatch.CONNECTOR).detail == f"connector {a.value} vs {b.value}"
    # Even with geometry unknown on both sides.
    refused(plan_pair(side(None, a), side(None, b)), Mismatch.CONNECTOR)


def test_unknown_connector_takes_the_known_ones_rules() -> None:
    assert ok(plan_pair(side(geo(2), None), side(geo(4), Connector.NIXL))).connector is (
        Connector.NIXL
    )
    assert ok(plan_pair(side(geo(2), Connector.NIXL), side(geo(4), None))).connector is (
        Connector.NIXL
    )
    # Neither known: the strictest rules (stock P2pNcclConnector's).
    refused(plan_pair(side(geo(2), None), side(geo(4), None)), Mismatch.TP)
    assert ok(plan_pair(side(geo(2), None), side(geo(2), None))).connector is None


@pytest.mark.parametrize(
    ("p_model", "d_model", "agrees"),
    [("a", "a", True), ("a", "b", False), (None, "a", True), ("a", None, True), (None, None, True)],
)
def test_models(p_model: str | None, d_model: str | None, agrees: bool) -> None:
    verdict = plan_pair(side(geo(1), model=p_model), side(geo(1), model=d_model))
    if agrees:
        ok(verdict)
    else:
        assert refused(verdict, Mismatch.MODEL).detail == "model 'a' vs 'b'"


def test_unknown_geometry_pairs_only_with_unknown() -> None:
    both = plan_pair(side(None), side(None))
    assert isinstance(both, Unverified) and both.detail == "geometry unknown on both sides"
    refused(plan_pair(side(None), side(geo(1))), Mismatch.UNKNOWN_GEOMETRY)
    verdict = refused(plan_pair(side(geo(1)), side(None)), Mismatch.UNKNOWN_GEOMETRY)
    assert verdict.detail.startswith("decode geometry unknown (v0)")


def test_allow_unknown_geometry() -> None:
    for p, d in ((None, geo(1)), (geo(1), None), (None, None)):
        assert isinstance(plan_pair(side(p), side(d), allow_unknown_geometry=True), Unverified)
    # It never overrides a connector or model mismatch, nor a known incompatibility.
    refused(
        plan_pair(
            side(None, Connector.NIXL),
            side(geo(1), Connector.P2P_NCCL),
            allow_unknown_geometry=True,
        ),
        Mismatch.CONNECTOR,
    )
    refused(
        plan_pair(side(None, model="a"), side(geo(1), model="b"), allow_unknown_geometry=True),
        Mismatch.MODEL,
    )
    refused(
        plan_pair(side(geo(2)), side(geo(4, 6)), allow_unknown_geometry=True),
        Mismatch.INVALID_GEOMETRY,
    )


def test_prefill_ports_must_fit() -> None:
    ok(plan_pair(side(geo(8), port=65528), side(geo(8))))  # ranks use 65528..65535
    verdict = refused(plan_pair(side(geo(8), port=65529), side(geo(8))), Mismatch.INVALID_GEOMETRY)
    assert verdict.detail == "prefill KV ports 65529..65536 (one per tp rank) pass 65535"
    with pytest.raises(ValueError):
        side(geo(1), port=0)
    with pytest.raises(ValueError):
        side(geo(1), port=65536)


# ---------------------------------------------------------------------------------------------
# dtypes


@pytest.mark.parametrize(
    ("name", "canonical", "size"),
    [
        ("float16", "float16", 2),
        ("half", "float16", 2),
        ("fp16", "float16", 2),
        ("bfloat16", "bfloat16", 2),
        ("bf16", "bfloat16", 2),
        ("BF16", "bfloat16", 2),
        ("torch.bfloat16", "bfloat16", 2),
        ("float32", "float32", 4),
        ("float", "float32", 4),
        ("fp32", "float32", 4),
        ("fp8", "fp8_e4m3", 1),
        ("fp8_e4m3", "fp8_e4m3", 1),
        ("torch.float8_e4m3fn", "fp8_e4m3", 1),
        ("fp8_e5m2", "fp8_e5m2", 1),
        ("float8_e5m2", "fp8_e5m2", 1),
        ("auto", "auto", None),
        ("fp8_inc", "fp8_inc", None),
    ],
)
def test_dtype_aliases(name: str, canonical: str, size: int | None) -> None:
    assert canonical_dtype(name) == canonical
    assert dtype_bytes(name) == size


@pytest.mark.parametrize(
    ("a", "b", "pairs"),
    [
        ("half", "fp16", True),
        ("bf16", "bfloat16", True),
        ("fp8", "fp8_e4m3", True),
        ("fp8", "fp8_e5m2", False),
        ("fp8_e4m3", "fp8_e5m2", False),
        ("bf16", "fp16", False),
        ("float", "fp32", True),
        ("auto", "auto", True),
        ("auto", "bf16", False),
    ],
)
def test_dtype_pairing(a: str, b: str, pairs: bool) -> None:
    verdict = plan(geo(1, dtype=a), geo(1, dtype=b))
    if pairs:
        ok(verdict)
    else:
        refused(verdict, Mismatch.DTYPE)


def test_unknown_dtype_pairs_without_a_byte_count() -> None:
    result = ok(plan(geo(2, dtype="auto"), geo(4, dtype="auto")))
    assert result.prefill_bytes_per_token_per_rank is None
    assert result.bytes_per_token is None
    assert result.bytes_per_request(100) is None


# ---------------------------------------------------------------------------------------------
# bytes


def llama3_8b(tp: int, dtype: str = "bf16") -> KvGeometry:
    return geo(tp, 8, layers=32, dim=128, dtype=dtype)


def llama3_70b(tp: int) -> KvGeometry:
    return geo(tp, 8, layers=80, dim=128)


@pytest.mark.parametrize(
    ("g", "per_rank"),
    [
        # 2 (K and V) x 32 layers x 8 heads x 128 x 2 bytes
        (llama3_8b(1), 131_072),
        (llama3_8b(2), 65_536),
        (llama3_8b(8), 16_384),
        (llama3_8b(16), 16_384),  # heads replicate: still one head per rank
        (llama3_8b(1, "fp8"), 65_536),
        (llama3_8b(1, "float32"), 262_144),
        # 2 x 80 layers x 1 head x 128 x 2
        (llama3_70b(8), 40_960),
        # DeepSeek-V3 MLA: 61 layers x 576 x 2 bytes, no K/V factor, same on every rank
        (mla(1), 70_272),
        (mla(8), 70_272),
        (mla(8, dtype="fp8_e4m3"), 35_136),
    ],
)
def test_bytes_per_token_per_rank(g: KvGeometry, per_rank: int) -> None:
    assert g.bytes_per_token_per_rank == per_rank


def test_pair_bytes() -> None:
    result = ok(plan(llama3_8b(1), llama3_8b(2)))
    assert result.prefill_bytes_per_token_per_rank == 131_072
    assert result.decode_bytes_per_token_per_rank == 65_536
    assert result.bytes_per_token == 131_072  # the whole cache, once
    assert result.bytes_per_request(1000) == 131_072_000
    assert result.bytes_per_request(1000, whole_blocks=True) == 131_072 * 1008
    assert result.bytes_per_request(0, whole_blocks=True) == 0
    with pytest.raises(ValueError):
        result.bytes_per_request(-1)
    # Replicated decode heads cross once per decode rank holding them.
    assert ok(plan(llama3_8b(1), llama3_8b(16))).bytes_per_token == 16 * 16_384
    # MLA: every decode rank reads the whole latent.
    assert ok(plan(mla(8), mla(2))).bytes_per_token == 2 * 70_272


# ---------------------------------------------------------------------------------------------
# the model and its conversion


def test_geometry_validation() -> None:
    with pytest.raises(ValueError):
        geo(0)
    with pytest.raises(ValueError):
        geo(1, 0)
    with pytest.raises(ValueError):
        KvGeometry(1, 16, 32, 8, 128, "bf16", False, None)  # non-MLA needs a layout
    with pytest.raises(ValueError):
        KvGeometry(True, 16, 32, 8, 128, "bf16", False, HND)
    with pytest.raises(ValueError):
        geo(1, dtype="")
    with pytest.raises(ValueError):
        geo(2).rank_heads(2)
    assert mla(1).kv_layout is None
    assert geo(4, 6).problem() is not None and geo(8, 4).problem() is None
    assert geo(12, 8).problem() is not None and geo(16, 8).problem() is None
    assert mla(3).problem() is None


FULL = Geometry(
    tp_size=2,
    block_size=16,
    num_layers=32,
    num_kv_heads=8,
    head_dim=128,
    kv_dtype="bf16",
    is_mla=False,
    kv_layout="HND",
)


def test_from_announced() -> None:
    assert from_announced(FULL) == KvGeometry(2, 16, 32, 8, 128, "bf16", False, HND)
    assert from_announced(None) is None
    for name in (
        "tp_size",
        "block_size",
        "num_layers",
        "num_kv_heads",
        "head_dim",
        "kv_dtype",
        "is_mla",
        "kv_layout",
    ):
        assert from_announced(replace(FULL, **{name: None})) is None, name
    # MLA has no head axis: its layout is not needed.
    assert from_announced(replace(FULL, is_mla=True, kv_layout=None)) == KvGeometry(
        2, 16, 32, 8, 128, "bf16", True, None
    )


def test_side_of_instance() -> None:
    instance = Instance(
        Role.PREFILL,
        Address("10.0.0.1", 8100),
        Address("10.0.0.1", 21001),
        Source.V1,
        model="m",
        connector=Connector.NIXL,
        geometry=FULL,
    )
    assert side_of(instance) == Side("m", Connector.NIXL, from_announced(FULL), 21001, FULL.tp_size)
    v0 = Instance(Role.DECODE, Address("h", 8200), Address("h", 22001), Source.V0)
    assert side_of(v0) == Side(None, None, None, 22001)
    assert isinstance(plan_pair(side_of(v0), side_of(v0)), Unverified)


def test_tp_ratio() -> None:
    assert [tp_ratio(p, d) for p, d in ((1, 1), (2, 8), (8, 2), (3, 6), (6, 3))] == [
        1,
        4,
        -4,
        2,
        -2,
    ]
    with pytest.raises(ValueError):
        tp_ratio(4, 6)
    with pytest.raises(ValueError):
        tp_ratio(6, 4)


# ---------------------------------------------------------------------------------------------
# properties

SIZES = st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64])


@st.composite
def geometries(draw: st.DrawFn, heads: int, is_mla: bool, layers: int, dim: int) -> KvGeometry:
    # Only splits vLLM can run: heads divisible by tp, or tp a multiple of heads (MLA: any tp).
    tp = draw(SIZES.filter(lambda t: is_mla or heads % t == 0 or t % heads == 0))
    return KvGeometry(
        tp_size=tp,
        block_size=draw(st.sampled_from([1, 8, 16, 32, 48, 64, 128, 256])),
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=dim,
        kv_dtype=draw(st.sampled_from(["bf16", "bfloat16", "fp16", "fp8", "float32"])),
        is_mla=is_mla,
        kv_layout=None if is_mla else draw(st.sampled_from([HND, NHD])),
    )


@st.composite
def pairs(draw: st.DrawFn) -> tuple[KvGeometry, KvGeometry]:
    is_mla = draw(st.booleans())
    heads = 1 if is_mla else draw(SIZES)
    layers = draw(st.integers(1, 128))
    dim = draw(st.sampled_from([64, 80, 96, 128, 256, 576]))
    p = draw(geometries(heads, is_mla, layers, dim))
    d = draw(geometries(heads, is_mla, layers, dim))
    # Same model, same dtype, so only TP, block size and layout decide.
    return p, replace(d, kv_dtype=p.kv_dtype)


@PROFILE
@given(pairs(), st.sampled_from(list(Connector)), st.integers(1, 60000))
def test_property_verdict_and_plan(
    pair: tuple[KvGeometry, KvGeometry], connector: Connector, port: int
) -> None:
    p, d = pair
    verdict = plan_pair(side(p, connector, port=port), side(d, connector, port=port))
    kind = expected_kind(connector, p, d)
    if kind is None:
        check_plan(ok(verdict), p, d, port)
    else:
        refused(verdict, kind)


@PROFILE
@given(pairs())
def test_property_p2p_nccl_admits_only_identical_geometry(
    pair: tuple[KvGeometry, KvGeometry],
) -> None:
    p, d = pair
    admitted = isinstance(plan(p, d, Connector.P2P_NCCL), PairPlan)
    assert admitted == (p == d)
    if admitted:
        # Whatever p2p_nccl admits, nixl admits too.
        assert isinstance(plan(p, d, Connector.NIXL), PairPlan)


ANY_INT = st.integers(1, 100)


@st.composite
def any_geometry(draw: st.DrawFn) -> KvGeometry | None:
    if draw(st.booleans()):
        return None
    is_mla = draw(st.booleans())
    return KvGeometry(
        tp_size=draw(ANY_INT),
        block_size=draw(ANY_INT),
        num_layers=draw(st.integers(1, 3)),
        num_kv_heads=draw(ANY_INT),
        head_dim=draw(st.sampled_from([64, 128])),
        kv_dtype=draw(st.sampled_from(["bf16", "fp16", "fp8_e5m2", "weird"])),
        is_mla=is_mla,
        kv_layout=None if is_mla else draw(st.sampled_from([HND, NHD])),
    )


@PROFILE
@given(
    any_geometry(),
    any_geometry(),
    st.sampled_from([None, *Connector]),
    st.sampled_from([None, *Connector]),
    st.sampled_from([None, "a", "b"]),
    st.sampled_from([None, "a", "b"]),
    st.booleans(),
)
def test_property_total_and_deterministic(
    p: KvGeometry | None,
    d: KvGeometry | None,
    p_conn: Connector | None,
    d_conn: Connector | None,
    p_model: str | None,
    d_model: str | None,
    allow: bool,
) -> None:
    """Any input gets an answer, never an exception, and the same answer twice."""
    args = (Side(p_model, p_conn, p, PORT), Side(d_model, d_conn, d, PORT))
    verdict = plan_pair(*args, allow_unknown_geometry=allow)
    assert verdict == plan_pair(*args, allow_unknown_geometry=allow)
    if isinstance(verdict, Incompatible):
        assert verdict.kind in set(Mismatch) and verdict.detail
    elif isinstance(verdict, Unverified):
        assert p is None or d is None
    else:
        assert p is not None and d is not None
        assert len(verdict.reads) == d.tp_size


@PROFILE
@given(pairs(), st.integers(0, 10_000), st.integers(0, 10_000))
def test_property_bytes_per_request(pair: tuple[KvGeometry, KvGeometry], a: int, b: int) -> None:
    p, d = pair
    verdict = plan(p, d, Connector.NIXL)
    if not isinstance(verdict, PairPlan):
        return
    per_token = verdict.bytes_per_token
    assert per_token is not None
    assert verdict.bytes_per_request(a) == a * per_token
    assert verdict.bytes_per_request(a + b) == (a + b) * per_token
    padded = verdict.bytes_per_request(a, whole_blocks=True)
    assert padded is not None
    assert a * per_token <= padded < (a + p.block_size) * per_token
    assert padded % (p.block_size * per_token) == 0


def test_canonical_names_are_fixed_points() -> None:
    for name in ("float16", "bfloat16", "float32", "fp8_e4m3", "fp8_e5m2"):
        assert canonical_dtype(name) == name


@PROFILE
@given(st.text(max_size=20))
def test_property_any_dtype_name_is_answered(name: str) -> None:
    assert isinstance(canonical_dtype(name), str)
    assert dtype_bytes(name) in (None, 1, 2, 4)


@pytest.mark.parametrize("connector", [Connector.MOONCAKE, Connector.NIXL_PUSH])
def test_a_peer_naming_kind_never_pairs_with_a_side_that_did_not_announce_it(
    connector: Connector,
) -> None:
    g = KvGeometry(1, 16, 2, 2, 32, "float16", kv_layout=NHD)
    for prefill, decode in ((connector, None), (None, connector)):
        verdict = plan_pair(Side(None, prefill, g, PORT), Side(None, decode, g, PORT))
        refused(verdict, Mismatch.CONNECTOR)
    assert isinstance(
        plan_pair(Side(None, connector, g, PORT), Side(None, connector, g, PORT)), PairPlan
    )


def test_mooncake_needs_equal_block_sizes_and_ignores_layouts() -> None:
    p = KvGeometry(2, 16, 2, 6, 32, "float16", kv_layout=NHD)
    assert isinstance(plan(p, replace(p, kv_layout=HND, tp_size=6), Connector.MOONCAKE), PairPlan)
    refused(plan(p, replace(p, block_size=32), Connector.MOONCAKE), Mismatch.BLOCK_SIZE)
    refused(plan(p, replace(p, tp_size=3), Connector.MOONCAKE), Mismatch.TP)
    # nixl would take the larger decode block: mooncake maps block ids one to one.
    assert isinstance(plan(p, replace(p, block_size=32), Connector.NIXL), PairPlan)
