"""pdproxy.vllm_side.kv: a request's KV gathered on prefill ranks and scattered on decode ranks.

The oracle is deliberately slow and independent of kv.py: every cache format is written and
read one token at a time with plain indexing, following how vLLM itself reads that format
(flash_attn splits the last axis at head_dim; the CPU kernels' (block, head) page is K
transposed then V, checked against the kernel itself in the `vllm` test). A full-model "truth"
per layer, (kv, tokens, total heads, head_dim), is laid into each prefill rank's cache at random
block ids; after every read of the plan went gather -> bytes -> scatter, each decode rank's
cache must equal its state before with exactly its own heads of the truth written at its block
ids, and nothing else changed.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.pairing.geometry import KvGeometry, KvLayout, PairPlan, Side, plan_pair
from pdproxy.registry.messages import Connector
from pdproxy.vllm_side.cpu_format import format_for_isa
from pdproxy.vllm_side.kv import (
    CacheFormat,
    HeadRead,
    gather_kv,
    plan_reads,
    scatter_kv,
    wire_bytes,
    wire_from_bytes,
    wire_shape,
    wire_to_bytes,
)

PROFILE = settings(derandomize=True, database=None, deadline=None)

TPS = (1, 2, 4, 8)
TP_PAIRS = tuple((p, d) for p in TPS for d in TPS if p % d == 0 or d % p == 0)
HEADS = (8, 4, 2, 1)  # 8 >= every tp; the others replicate once tp passes them
MATRIX_HEADS = (8, 2, 1)  # 4 adds no case the others miss; the plan tests still cover it
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_RATIOS = (1, 2, 4)
HEAD_DIM = 4
PREFILL_BLOCK = 2
TOKENS = 11  # a partial last block on both sides for every block size used here


@dataclass(frozen=True)
class Fmt:
    """A cache format as the tests build it: kv.py's format plus the tensor's rank."""

    name: str
    cache_format: CacheFormat
    mla: bool = False


NHD = Fmt("NHD", CacheFormat.NHD)
HND = Fmt("HND", CacheFormat.HND)
BHNC = Fmt("BHNC", CacheFormat.BHNC)
BHNC_CPU = Fmt("BHNC_CPU", CacheFormat.BHNC_CPU)
MLA_3D = Fmt("MLA", CacheFormat.MLA, mla=True)
MLA_4D = Fmt("MLA_4D", CacheFormat.MLA, mla=True)  # vLLM 0.32: (blocks, 1, block_size, latent)
LEGACY_FORMATS = (NHD, HND)
ATTENTION_FORMATS = (*LEGACY_FORMATS, BHNC, BHNC_CPU)
MLA_FORMATS = (MLA_3D, MLA_4D)


# --- the slow, obvious oracle --------------------------------------------------------------------


def new_cache(
    fmt: Fmt, num_blocks: int, block_size: int, heads: int, dtype: torch.dtype, seed: int
) -> torch.Tensor:
    """A cache full of random values, so that any stray write shows."""
    b, n, h, d = num_blocks, block_size, heads, HEAD_DIM
    shape = {
        "NHD": (2, b, n, h, d),
        "HND": (2, b, h, n, d),
        "BHNC": (b, h, n, 2 * d),
        "BHNC_CPU": (b, h, n, 2 * d),
        "MLA": (b, n, d),
        "MLA_4D": (b, 1, n, d),
    }[fmt.name]
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype)


def cpu_page(cache: torch.Tensor, block: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM 0.32's CPU kernels' page: K as (head_dim, block_size), then V as (block_size,
    head_dim), as measured by calling its cache-write kernel (see the `vllm` test below)."""
    block_size = cache.shape[2]
    page = cache[block, head].view(-1)
    half = block_size * HEAD_DIM
    return page[:half].view(HEAD_DIM, block_size), page[half:].view(block_size, HEAD_DIM)


def write_token(
    cache: torch.Tensor, fmt: Fmt, block: int, offset: int, token: torch.Tensor
) -> None:
    """Store one token's (kv, heads, head_dim) at (block, offset)."""
    if fmt.name == "NHD":
        cache[:, block, offset] = token
    elif fmt.name == "HND":
        cache[:, block, :, offset] = token
    elif fmt.name == "BHNC":
        cache[block, :, offset, :HEAD_DIM] = token[0]
        cache[block, :, offset, HEAD_DIM:] = token[1]
    elif fmt.name == "BHNC_CPU":
        for head in range(cache.shape[1]):
            keys, values = cpu_page(cache, block, head)
            keys[:, offset] = token[0, head]
            values[offset] = token[1, head]
    elif fmt.name == "MLA":
        cache[block, offset] = token[0, 0]
    else:
        cache[block, 0, offset] = token[0, 0]


def read_token(cache: torch.Tensor, fmt: Fmt, block: int, offset: int) -> torch.Tensor:
    """One token's (kv, heads, head_dim) at (block, offset)."""
    if fmt.name == "NHD":
        return cache[:, block, offset]
    if fmt.name == "HND":
        return cache[:, block, :, offset]
    if fmt.name == "BHNC":
        return torch.stack([cache[block, :, offset, :HEAD_DIM], cache[block, :, offset, HEAD_DIM:]])
    if fmt.name == "BHNC_CPU":
        heads = []
        for head in range(cache.shape[1]):
            keys, values = cpu_page(cache, block, head)
            heads.append(torch.stack([keys[:, offset], values[offset]]))
        return torch.stack(heads, dim=1)
    if fmt.name == "MLA":
        return cache[block, offset][None, None]
    return cache[block, 0, offset][None, None]


def lay_out(
    cache: torch.Tensor, fmt: Fmt, block_ids: list[int], block_size: int, tokens: torch.Tensor
) -> None:
    """Write tokens (kv, tokens, heads, head_dim) token by token at block_ids."""
    for t in range(tokens.shape[1]):
        write_token(cache, fmt, block_ids[t // block_size], t % block_size, tokens[:, t])


# --- one transfer, end to end --------------------------------------------------------------------


@dataclass
class Fleet:
    """One side's ranks: a geometry, a format, each rank's cache and the request's block ids."""

    geometry: KvGeometry
    fmt: Fmt
    caches: list[torch.Tensor]
    block_ids: list[list[int]]

    @property
    def block_size(self) -> int:
        return self.geometry.block_size


def geometry(
    tp: int, heads: int, block: int, dtype: torch.dtype, *, mla: bool = False, layers: int = 1
) -> KvGeometry:
    return KvGeometry(
        tp_size=tp,
        block_size=block,
        num_layers=layers,
        num_kv_heads=1 if mla else heads,
        head_dim=HEAD_DIM,
        kv_dtype=str(dtype).removeprefix("torch."),
        is_mla=mla,
        kv_layout=None if mla else KvLayout.HND,
    )


def random_truth(g: KvGeometry, num_tokens: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    planes = 1 if g.is_mla else 2
    generator = torch.Generator().manual_seed(seed)
    shape = (planes, num_tokens, g.num_kv_heads, HEAD_DIM)
    return torch.randn(shape, generator=generator).to(dtype)


def make_fleet(g: KvGeometry, fmt: Fmt, num_tokens: int, dtype: torch.dtype, seed: int) -> Fleet:
    """Empty-of-the-request ranks: random contents, the request's blocks at random ids."""
    needed = -(-num_tokens // g.block_size)
    num_blocks = needed + 3  # spare blocks that must stay untouched
    generator = torch.Generator().manual_seed(seed)
    caches, block_ids = [], []
    for rank in range(g.tp_size):
        caches.append(
            new_cache(fmt, num_blocks, g.block_size, g.heads_per_rank, dtype, seed + rank + 1)
        )
        block_ids.append(torch.randperm(num_blocks, generator=generator)[:needed].tolist())
    return Fleet(g, fmt, caches, block_ids)


def prefill_fleet(
    g: KvGeometry, fmt: Fmt, truth: torch.Tensor, dtype: torch.dtype, seed: int
) -> Fleet:
    fleet = make_fleet(g, fmt, truth.shape[1], dtype, seed)
    for rank, cache in enumerate(fleet.caches):
        heads = g.rank_heads(rank)
        own = truth[:, :, heads.start : heads.stop]
        lay_out(cache, fmt, fleet.block_ids[rank], g.block_size, own)
    return fleet


def transfer(prefill: Fleet, decode: Fleet, num_tokens: int) -> None:
    """Every read of the plan: gather on the prefill rank, bytes, scatter on the decode rank."""
    for read in plan_reads(prefill.geometry, decode.geometry):
        wire = gather_kv(
            prefill.caches[read.prefill_rank],
            prefill.fmt.cache_format,
            prefill.block_ids[read.prefill_rank],
            num_tokens,
            read.prefill_heads,
        )
        shape = wire_shape(decode.geometry, read, num_tokens)
        assert tuple(wire.shape) == shape
        received = wire_from_bytes(wire_to_bytes(wire), shape, wire.dtype)
        scatter_kv(
            received,
            decode.caches[read.decode_rank],
            decode.fmt.cache_format,
            decode.block_ids[read.decode_rank],
            read.decode_heads,
        )


def check_decode(
    decode: Fleet, before: list[torch.Tensor], truth: torch.Tensor, label: str
) -> None:
    """Each decode rank reads back its heads of the truth, and nothing else changed."""
    g, bs = decode.geometry, decode.block_size
    for rank, cache in enumerate(decode.caches):
        heads = g.rank_heads(rank)
        own = truth[:, :, heads.start : heads.stop]
        ids = decode.block_ids[rank]
        for t in range(truth.shape[1]):
            got = read_token(cache, decode.fmt, ids[t // bs], t % bs)
            assert torch.equal(got, own[:, t]), f"{label}: decode rank {rank} token {t}"
        expected = before[rank].clone()
        lay_out(expected, decode.fmt, ids, bs, own)
        assert torch.equal(cache, expected), f"{label}: decode rank {rank}: other slots changed"


def round_trip(
    p: KvGeometry,
    d: KvGeometry,
    p_fmt: Fmt,
    d_fmt: Fmt,
    dtype: torch.dtype,
    num_tokens: int,
    seed: int,
) -> None:
    label = (
        f"{p_fmt.name} tp{p.tp_size} block {p.block_size} -> {d_fmt.name} tp{d.tp_size} "
        f"block {d.block_size}, {p.num_kv_heads} heads, {dtype}, {num_tokens} tokens"
    )
    truth = random_truth(p, num_tokens, dtype, seed)
    prefill = prefill_fleet(p, p_fmt, truth, dtype, seed + 100)
    decode = make_fleet(d, d_fmt, num_tokens, dtype, seed + 200)
    prefill_before = [cache.clone() for cache in prefill.caches]
    decode_before = [cache.clone() for cache in decode.caches]
    transfer(prefill, decode, num_tokens)
    check_decode(decode, decode_before, truth, label)
    for cache, original in zip(prefill.caches, prefill_before, strict=True):
        assert torch.equal(cache, original), f"{label}: gather wrote to the prefill cache"


# --- the matrix ----------------------------------------------------------------------------------
# One test per TP pair (and head count); the formats, block ratios and dtypes run inside it, each
# failure naming its case: thousands of tiny pytest items would cost more than the transfers.


def _format_cases() -> tuple[tuple[Fmt, Fmt, int, torch.dtype], ...]:
    """(prefill format, decode format, block ratio, dtype) for each TP pair and head count.

    NHD and HND, mixed or not, meet every block ratio; a pair involving a vLLM 0.32 format runs
    once, at a rotating ratio. The dtype rotates so each ratio and each format pair meets all.
    """
    legacy = [
        (p_fmt, d_fmt, ratio)
        for p_fmt, d_fmt in itertools.product(LEGACY_FORMATS, LEGACY_FORMATS)
        for ratio in BLOCK_RATIOS
    ]
    newer = [
        (p_fmt, d_fmt, BLOCK_RATIOS[i % len(BLOCK_RATIOS)])
        for i, (p_fmt, d_fmt) in enumerate(
            pair
            for pair in itertools.product(ATTENTION_FORMATS, ATTENTION_FORMATS)
            if not set(pair) <= set(LEGACY_FORMATS)
        )
    ]
    return tuple(
        (p_fmt, d_fmt, ratio, DTYPES[(k + k // len(DTYPES)) % len(DTYPES)])
        for k, (p_fmt, d_fmt, ratio) in enumerate(legacy + newer)
    )


FORMAT_CASES = _format_cases()


@pytest.mark.parametrize("heads", MATRIX_HEADS)
@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS)
def test_attention_kv_reaches_every_decode_rank(p_tp: int, d_tp: int, heads: int) -> None:
    for seed, (p_fmt, d_fmt, ratio, dtype) in enumerate(FORMAT_CASES):
        p = geometry(p_tp, heads, PREFILL_BLOCK, dtype)
        d = geometry(d_tp, heads, PREFILL_BLOCK * ratio, dtype)
        round_trip(p, d, p_fmt, d_fmt, dtype, TOKENS, seed)


def test_the_matrix_covers_every_format_pair_ratio_and_dtype() -> None:
    legacy = [case for case in FORMAT_CASES if {case[0], case[1]} <= set(LEGACY_FORMATS)]
    assert {(p, d, r) for p, d, r, _ in legacy} == set(
        itertools.product(LEGACY_FORMATS, LEGACY_FORMATS, BLOCK_RATIOS)
    )
    pairs = {(p, d) for p, d, _, _ in FORMAT_CASES}
    assert pairs == set(itertools.product(ATTENTION_FORMATS, ATTENTION_FORMATS))
    assert {(r, t) for _, _, r, t in FORMAT_CASES} == set(itertools.product(BLOCK_RATIOS, DTYPES))
    for p_fmt, d_fmt in itertools.product(LEGACY_FORMATS, LEGACY_FORMATS):
        dtypes = {t for p, d, _, t in FORMAT_CASES if (p, d) == (p_fmt, d_fmt)}
        assert dtypes == set(DTYPES)


@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS)
def test_mla_latent_reaches_every_decode_rank(p_tp: int, d_tp: int) -> None:
    # Every format pair at every block ratio; the dtype rotates so each pair meets all three.
    cases = itertools.product(MLA_FORMATS, MLA_FORMATS, BLOCK_RATIOS)
    for seed, (p_fmt, d_fmt, ratio) in enumerate(cases):
        dtype = DTYPES[(seed + seed // len(DTYPES)) % len(DTYPES)]
        p = geometry(p_tp, 1, PREFILL_BLOCK, dtype, mla=True)
        d = geometry(d_tp, 1, PREFILL_BLOCK * ratio, dtype, mla=True)
        round_trip(p, d, p_fmt, d_fmt, dtype, TOKENS, seed)


@PROFILE
@given(
    tps=st.sampled_from(TP_PAIRS),
    heads=st.sampled_from(HEADS),
    mla=st.booleans(),
    formats=st.tuples(st.sampled_from(ATTENTION_FORMATS), st.sampled_from(ATTENTION_FORMATS)),
    mla_formats=st.tuples(st.sampled_from(MLA_FORMATS), st.sampled_from(MLA_FORMATS)),
    prefill_block=st.integers(1, 4),
    ratio=st.integers(1, 4),
    num_tokens=st.integers(0, 30),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 1000),
)
def test_any_token_count_and_block_sizes(
    tps: tuple[int, int],
    heads: int,
    mla: bool,
    formats: tuple[Fmt, Fmt],
    mla_formats: tuple[Fmt, Fmt],
    prefill_block: int,
    ratio: int,
    num_tokens: int,
    dtype: torch.dtype,
    seed: int,
) -> None:
    """Token counts from 0 up, exact multiples of a block or not, odd block sizes and ratios."""
    p_fmt, d_fmt = mla_formats if mla else formats
    p = geometry(tps[0], heads, prefill_block, dtype, mla=mla)
    d = geometry(tps[1], heads, prefill_block * ratio, dtype, mla=mla)
    round_trip(p, d, p_fmt, d_fmt, dtype, num_tokens, seed)


def test_skipping_a_cached_prefix_of_whole_blocks() -> None:
    """Decode already holds its first block: both sides pass the block ids and tokens past it."""
    dtype = torch.float32
    p = geometry(2, 4, 2, dtype)
    d = geometry(1, 4, 4, dtype)
    truth = random_truth(p, TOKENS, dtype, seed=1)
    prefill = prefill_fleet(p, HND, truth, dtype, seed=2)
    decode = make_fleet(d, NHD, TOKENS, dtype, seed=3)
    before = [cache.clone() for cache in decode.caches]
    cached_tokens = d.block_size
    skip_prefill_blocks = cached_tokens // p.block_size
    for read in plan_reads(p, d):
        wire = gather_kv(
            prefill.caches[read.prefill_rank],
            CacheFormat.HND,
            prefill.block_ids[read.prefill_rank][skip_prefill_blocks:],
            TOKENS - cached_tokens,
            read.prefill_heads,
        )
        scatter_kv(
            wire, decode.caches[0], CacheFormat.NHD, decode.block_ids[0][1:], read.decode_heads
        )
    expected = before[0].clone()
    lay_out(expected, NHD, decode.block_ids[0][1:], d.block_size, truth[:, cached_tokens:])
    assert torch.equal(decode.caches[0], expected)


# --- the wire itself -----------------------------------------------------------------------------


def test_wire_depends_on_neither_block_size_nor_format() -> None:
    dtype = torch.bfloat16
    truth = random_truth(geometry(1, 4, 1, dtype), TOKENS, dtype, seed=5)
    wires = []
    for fmt, block in itertools.product(ATTENTION_FORMATS, (1, 2, 3, 8)):
        fleet = prefill_fleet(geometry(1, 4, block, dtype), fmt, truth, dtype, seed=block)
        wire = gather_kv(fleet.caches[0], fmt.cache_format, fleet.block_ids[0], TOKENS)
        assert wire.is_contiguous()
        wires.append(wire)
    assert torch.equal(wires[0], truth)
    assert all(torch.equal(wire, truth) for wire in wires)


def test_gather_takes_a_run_of_heads() -> None:
    dtype = torch.float16
    truth = random_truth(geometry(1, 8, 4, dtype), TOKENS, dtype, seed=6)
    fleet = prefill_fleet(geometry(1, 8, 4, dtype), HND, truth, dtype, seed=7)
    wire = gather_kv(fleet.caches[0], CacheFormat.HND, fleet.block_ids[0], TOKENS, range(2, 5))
    assert torch.equal(wire, truth[:, :, 2:5])


def test_token_major_view_over_head_major_memory_is_written_through() -> None:
    """Older vLLM GPU backends hand an NHD-shaped view of an HND allocation: writes must land."""
    dtype = torch.float32
    memory = new_cache(HND, 4, 4, 2, dtype, seed=8)
    view = memory.transpose(2, 3)  # (2, blocks, block_size, heads, head_dim), not contiguous
    assert not view.is_contiguous()
    before = memory.clone()
    wire = torch.randn(2, 6, 2, HEAD_DIM).to(dtype)
    scatter_kv(wire, view, CacheFormat.NHD, [3, 1])
    expected = before.clone()
    lay_out(expected, HND, [3, 1], 4, wire)
    assert torch.equal(memory, expected)


def test_empty_request_moves_nothing() -> None:
    dtype = torch.float32
    cache = new_cache(NHD, 3, 4, 2, dtype, seed=9)
    before = cache.clone()
    wire = gather_kv(cache, CacheFormat.NHD, [], 0)
    assert tuple(wire.shape) == (2, 0, 2, HEAD_DIM)
    scatter_kv(wire, cache, CacheFormat.NHD, [])
    assert torch.equal(cache, before)
    assert wire_to_bytes(wire) == bytearray()
    assert wire_from_bytes(b"", (2, 0, 2, HEAD_DIM), dtype).shape == (2, 0, 2, HEAD_DIM)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float8_e4m3fn, torch.uint8])
def test_wire_bytes_round_trip_exactly(dtype: torch.dtype) -> None:
    wire = torch.randn(2, 5, 3, HEAD_DIM).to(dtype)
    data = wire_to_bytes(wire)
    assert len(data) == wire.numel() * wire.element_size()
    for buffer in (data, bytes(data), memoryview(bytes(data))):
        back = wire_from_bytes(buffer, wire.shape, dtype)
        assert back.dtype == dtype
        assert torch.equal(back.view(torch.uint8), wire.view(torch.uint8))


def test_wire_from_bytes_refuses_a_wrong_length() -> None:
    with pytest.raises(ValueError, match="bytes for a wire"):
        wire_from_bytes(b"\x00" * 7, (2, 1, 1, 1), torch.float32)


# --- the plan ------------------------------------------------------------------------------------


def global_heads(g: KvGeometry, rank: int, local: range) -> range:
    start = g.rank_heads(rank).start
    return range(start + local.start, start + local.stop)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(p, d) for p in (*TPS, 16) for d in (*TPS, 16)])
def test_each_decode_head_is_read_once_from_a_prefill_rank_holding_it(p_tp: int, d_tp: int) -> None:
    for heads, mla in itertools.product(HEADS, (False, True)):
        p = geometry(p_tp, heads, 16, torch.bfloat16, mla=mla)
        d = geometry(d_tp, heads, 16, torch.bfloat16, mla=mla)
        reads = plan_reads(p, d)
        assert [r.decode_rank for r in reads] == sorted(r.decode_rank for r in reads)
        for rank in range(d_tp):
            own = [read for read in reads if read.decode_rank == rank]
            prefill_ranks = [read.prefill_rank for read in own]
            assert prefill_ranks == sorted(set(prefill_ranks)), (heads, mla, rank)
            landed = [i for read in own for i in read.decode_heads]
            assert landed == list(range(d.heads_per_rank)), (heads, mla, rank)  # in order, once
            for read in own:
                assert len(read.prefill_heads) == len(read.decode_heads) > 0
                assert read.prefill_heads.stop <= p.heads_per_rank
                wanted = global_heads(d, rank, read.decode_heads)
                assert global_heads(p, read.prefill_rank, read.prefill_heads) == wanted, read


@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS)
def test_reads_agree_with_the_pair_plan(p_tp: int, d_tp: int) -> None:
    """Where nixl-style pairing allows a pair (the rules kv.py implements for any TP ratio),
    kv.py reads what, and from whom, the pair plan says."""
    compared = 0
    for heads, mla in itertools.product(HEADS, (False, True)):
        p = geometry(p_tp, heads, 16, torch.bfloat16, mla=mla)
        d = geometry(d_tp, heads, 16, torch.bfloat16, mla=mla)
        verdict = plan_pair(
            Side("m", Connector.NIXL, p, 21001), Side("m", Connector.NIXL, d, 21001)
        )
        if not isinstance(verdict, PairPlan):
            continue  # pairing refuses it (replicated prefill heads over a smaller decode TP)
        compared += 1
        reads = plan_reads(p, d)
        for rank, planned in enumerate(verdict.reads):
            ours = [
                (read.prefill_rank, global_heads(p, read.prefill_rank, read.prefill_heads))
                for read in reads
                if read.decode_rank == rank
            ]
            assert ours == [(read.prefill_rank, read.heads) for read in planned], (heads, mla)
    assert compared >= len(HEADS)  # MLA pairs always pass, so the check never runs empty


def test_plan_refuses_what_cannot_exchange_kv() -> None:
    f32 = torch.float32
    with pytest.raises(ValueError, match="MLA"):
        plan_reads(geometry(1, 1, 16, f32, mla=True), geometry(1, 1, 16, f32))
    with pytest.raises(ValueError, match="kv heads"):
        plan_reads(geometry(1, 8, 16, f32), geometry(1, 4, 16, f32))
    with pytest.raises(ValueError, match="dtype"):
        plan_reads(geometry(1, 8, 16, f32), geometry(1, 8, 16, torch.bfloat16))
    with pytest.raises(ValueError, match="tp"):
        plan_reads(geometry(2, 6, 16, f32), geometry(3, 6, 16, f32))
    with pytest.raises(ValueError, match="split evenly"):
        plan_reads(geometry(4, 6, 16, f32), geometry(2, 6, 16, f32))


# --- bytes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS)
def test_a_decode_ranks_reads_carry_its_bytes_per_token(p_tp: int, d_tp: int) -> None:
    layers, tokens = 3, 37
    dtype_names = ("float32", "bfloat16", "float16", "fp8")
    for heads, mla, dtype_name in itertools.product(HEADS, (False, True), dtype_names):
        kv_heads = 1 if mla else heads
        p = KvGeometry(p_tp, 16, layers, kv_heads, 128, dtype_name, mla, KvLayout.HND)
        d = KvGeometry(d_tp, 32, layers, kv_heads, 128, dtype_name, mla, KvLayout.HND)
        per_token = d.bytes_per_token_per_rank
        assert per_token is not None
        reads = plan_reads(p, d)
        for rank in range(d_tp):
            per_layer = sum(wire_bytes(d, r, tokens) for r in reads if r.decode_rank == rank)
            assert per_layer * layers == tokens * per_token, (heads, mla, dtype_name, rank)


@pytest.mark.parametrize("fmt", [*ATTENTION_FORMATS, *MLA_FORMATS], ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", DTYPES)
def test_wire_bytes_are_the_gathered_tensors_bytes(fmt: Fmt, dtype: torch.dtype) -> None:
    g = geometry(2, 4, 4, dtype, mla=fmt.mla)
    truth = random_truth(g, TOKENS, dtype, seed=10)
    fleet = prefill_fleet(g, fmt, truth, dtype, seed=11)
    read = HeadRead(0, 0, range(g.heads_per_rank), range(g.heads_per_rank))
    wire = gather_kv(fleet.caches[0], fmt.cache_format, fleet.block_ids[0], TOKENS)
    assert tuple(wire.shape) == wire_shape(g, read, TOKENS)
    assert wire.numel() * wire.element_size() == wire_bytes(g, read, TOKENS)


def test_wire_bytes_needs_a_known_dtype() -> None:
    g = KvGeometry(1, 16, 1, 2, 8, "int4_mystery", kv_layout=KvLayout.HND)
    with pytest.raises(ValueError, match="dtype"):
        wire_bytes(g, HeadRead(0, 0, range(2), range(2)), 3)


# --- misuse --------------------------------------------------------------------------------------


def test_refuses_too_few_repeated_or_foreign_block_ids() -> None:
    cache = new_cache(NHD, 4, 4, 2, torch.float32, seed=12)
    before = cache.clone()
    wire = torch.zeros(2, 9, 2, HEAD_DIM)
    with pytest.raises(ValueError, match="need 3 blocks"):
        scatter_kv(wire, cache, CacheFormat.NHD, [0, 1])
    with pytest.raises(ValueError, match="repeat"):
        scatter_kv(wire, cache, CacheFormat.NHD, [0, 1, 0])
    for foreign in ([0, 1, 4], [0, -1, 2]):
        with pytest.raises(ValueError, match="outside"):
            scatter_kv(wire, cache, CacheFormat.NHD, foreign)
        with pytest.raises(ValueError, match="outside"):
            gather_kv(cache, CacheFormat.NHD, foreign, 9)
    with pytest.raises(ValueError, match="num_tokens"):
        gather_kv(cache, CacheFormat.NHD, [0], -1)
    assert torch.equal(cache, before)
    # Ids past the ones the tokens fill are ignored.
    scatter_kv(wire[:, :4], cache, CacheFormat.NHD, [2, 2, 2])


def test_refuses_a_wire_that_does_not_fit() -> None:
    cache = new_cache(HND, 4, 4, 2, torch.float32, seed=13)
    with pytest.raises(ValueError, match="does not fit"):
        scatter_kv(torch.zeros(2, 3, 3, HEAD_DIM), cache, CacheFormat.HND, [0])
    with pytest.raises(ValueError, match="does not fit"):
        scatter_kv(torch.zeros(2, 3, 1, HEAD_DIM), cache, CacheFormat.HND, [0])
    with pytest.raises(ValueError, match="does not fit"):
        scatter_kv(torch.zeros(1, 3, 2, HEAD_DIM), cache, CacheFormat.HND, [0])
    with pytest.raises(ValueError, match="dtype"):
        scatter_kv(torch.zeros(2, 3, 2, HEAD_DIM, dtype=torch.float16), cache, CacheFormat.HND, [0])
    scatter_kv(torch.zeros(2, 3, 1, HEAD_DIM), cache, CacheFormat.HND, [0], range(1, 2))


@pytest.mark.parametrize("heads", [range(0, 0), range(1, 3), range(-1, 1), range(0, 2, 2)])
def test_refuses_heads_outside_the_cache(heads: range) -> None:
    cache = new_cache(NHD, 2, 4, 2, torch.float32, seed=14)
    with pytest.raises(ValueError, match="heads"):
        gather_kv(cache, CacheFormat.NHD, [0], 1, heads)


@pytest.mark.parametrize(
    ("cache_format", "shape"),
    [
        (CacheFormat.NHD, (3, 2, 4, 2, 4)),
        (CacheFormat.HND, (2, 4, 2, 4)),
        (CacheFormat.MLA, (2, 2, 4, 4)),
        (CacheFormat.MLA, (2, 4)),
        (CacheFormat.BHNC, (2, 2, 4, 5)),
        (CacheFormat.BHNC_CPU, (2, 2, 4)),
    ],
)
def test_refuses_a_cache_of_the_wrong_shape(
    cache_format: CacheFormat, shape: tuple[int, ...]
) -> None:
    with pytest.raises(ValueError, match="cache must be"):
        gather_kv(torch.zeros(shape), cache_format, [0], 1)


def test_cpu_format_refuses_pages_it_would_have_to_copy() -> None:
    # Token-major memory seen head-major: a (block, head) page is not one run of memory.
    memory = torch.zeros(2, 4, 2, 2 * HEAD_DIM)
    with pytest.raises(ValueError, match="contiguous"):
        scatter_kv(
            torch.zeros(2, 1, 2, HEAD_DIM), memory.transpose(1, 2), CacheFormat.BHNC_CPU, [0]
        )
    gather_kv(memory.transpose(1, 2), CacheFormat.BHNC, [0], 1)  # the GPU reading needs no run


# --- against vLLM's own CPU kernel --------------------------------------------------------------

# Runs in the real vLLM venv: the backend's cache-write kernel fills a cache, kv.py must read
# back exactly the tokens it was given, and kv.py's own writes must equal the kernel's bytes.
CPU_KERNEL_CHECK = """
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
from pdproxy.vllm_side.cpu_format import format_for_isa
from pdproxy.vllm_side.kv import gather_kv, scatter_kv

checked = set()
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for head_dim, block_size in ((32, 32), (80, 32), (64, 64), (32, 128)):  # 80: vec16
        blocks, heads, tokens = 4, 2, block_size + 7
        isa = _get_attn_isa(dtype, block_size, head_dim)
        written = torch.zeros((blocks, heads, block_size, 2 * head_dim), dtype=dtype)
        key_cache, value_cache = written.view(
            blocks, heads, 2 * block_size, head_dim).chunk(2, dim=2)
        generator = torch.Generator().manual_seed(head_dim)
        key = torch.randn(tokens, heads, head_dim, generator=generator).to(dtype)
        value = torch.randn(tokens, heads, head_dim, generator=generator).to(dtype)
        block_ids = [3, 1]
        slots = torch.tensor(
            [block_ids[t // block_size] * block_size + t % block_size for t in range(tokens)])
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
        cache_format = format_for_isa(isa)
        assert cache_format is not None, isa
        wire = gather_kv(written, cache_format, block_ids, tokens)
        assert torch.equal(wire, torch.stack([key, value])), (dtype, head_dim, isa)
        ours = torch.zeros_like(written)
        scatter_kv(wire, ours, cache_format, block_ids)
        assert torch.equal(ours, written), (dtype, head_dim, isa)
        checked.add(isa)
print(" ".join(sorted(checked)))
"""


@pytest.mark.vllm
def test_cpu_format_matches_vllms_cpu_kernel() -> None:
    from tests.conftest import vllm_skipped
    from tests.harness.vllm_env import VllmEnv

    if vllm_skipped():
        pytest.skip("PDPROXY_SKIP_VLLM=1")
    env = VllmEnv.default()
    env.ensure()  # normally done by `make test` before pytest starts; a no-op then
    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [str(env.python), "-c", CPU_KERNEL_CHECK],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "PYTHONPATH": str(repo), "VLLM_NO_USAGE_STATS": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert result.stdout.split(), "no ISA was checked"


# --- packaging -----------------------------------------------------------------------------------


def test_importing_kv_pulls_in_no_proxy_code() -> None:
    code = (
        "import sys, pdproxy.vllm_side.kv\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('fastapi', 'uvicorn')"
        " or m == 'pdproxy.proxy' or m.startswith('pdproxy.proxy.'))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --- the CPU backend's AMX tiles -----------------------------------------------------------------

AMX_HEAD_DIM = 32


def amx_offset_of_key(offset: int, dim: int) -> int:
    """Where token `offset`'s K value `dim` sits in a page, spelled out: K tiles of 16 tokens,
    each holding pairs of head_dim values side by side."""
    tile, row = divmod(offset, 16)
    return tile * 16 * AMX_HEAD_DIM + (dim // 2) * 32 + row * 2 + dim % 2


def amx_offset_of_value(offset: int, dim: int, block_size: int) -> int:
    """V tiles of 16 head_dim values, each holding pairs of tokens side by side, after K."""
    tile, column = divmod(dim, 16)
    return (
        block_size * AMX_HEAD_DIM
        + tile * block_size * 16
        + (offset // 2) * 32
        + column * 2
        + offset % 2
    )


def amx_token(cache: torch.Tensor, block: int, offset: int) -> torch.Tensor:
    block_size, heads = cache.shape[2], cache.shape[1]
    out = torch.empty(2, heads, AMX_HEAD_DIM, dtype=cache.dtype)
    for head in range(heads):
        page = cache[block, head].reshape(-1)
        for dim in range(AMX_HEAD_DIM):
            out[0, head, dim] = page[amx_offset_of_key(offset, dim)]
            out[1, head, dim] = page[amx_offset_of_value(offset, dim, block_size)]
    return out


@pytest.mark.parametrize("block_size", [32, 64])
def test_amx_pages_read_and_write_where_the_tiles_are(block_size: int) -> None:
    heads, tokens, block_ids = 2, block_size + 5, [3, 0]
    generator = torch.Generator().manual_seed(block_size)
    shape = (4, heads, block_size, 2 * AMX_HEAD_DIM)
    cache = torch.randn(shape, generator=generator).to(torch.bfloat16)
    wire = gather_kv(cache, CacheFormat.BHNC_CPU_AMX, block_ids, tokens)
    for token in range(tokens):
        block, offset = block_ids[token // block_size], token % block_size
        assert torch.equal(wire[:, token], amx_token(cache, block, offset)), token

    target = torch.randn(shape, generator=generator).to(torch.bfloat16)
    before = target.clone()
    scatter_kv(wire[:, :, 1:], target, CacheFormat.BHNC_CPU_AMX, [1, 2], range(1, 2))
    for token in range(tokens):
        block, offset = [1, 2][token // block_size], token % block_size
        got = amx_token(target, block, offset)
        assert torch.equal(got[:, 1], wire[:, token, 1]), token
        assert torch.equal(got[:, 0], amx_token(before, block, offset)[:, 0]), token
    untouched = [0, 3]
    assert torch.equal(target[untouched], before[untouched])
    tail = [(2, offset) for offset in range(tokens - block_size, block_size)]
    assert all(torch.equal(amx_token(target, b, o), amx_token(before, b, o)) for b, o in tail)


def test_amx_and_vec_pages_exchange_kv() -> None:
    # A prefill on AMX hardware and a decode without it (or the other way round) agree token
    # for token: the wire is the same whatever the page layout.
    generator = torch.Generator().manual_seed(7)
    amx = torch.randn((3, 2, 32, 2 * AMX_HEAD_DIM), generator=generator).to(torch.bfloat16)
    vec = torch.zeros((5, 2, 16, 2 * AMX_HEAD_DIM), dtype=torch.bfloat16)
    wire = gather_kv(amx, CacheFormat.BHNC_CPU_AMX, [2, 1], 40)
    scatter_kv(wire, vec, CacheFormat.BHNC_CPU, [4, 0, 3])
    assert torch.equal(gather_kv(vec, CacheFormat.BHNC_CPU, [4, 0, 3], 40), wire)
    back = torch.zeros_like(amx)
    scatter_kv(
        gather_kv(vec, CacheFormat.BHNC_CPU, [4, 0, 3], 40), back, CacheFormat.BHNC_CPU_AMX, [0, 2]
    )
    assert torch.equal(gather_kv(back, CacheFormat.BHNC_CPU_AMX, [0, 2], 40), wire)


@pytest.mark.parametrize(("block_size", "head_dim"), [(8, 32), (32, 8), (24, 32)])
def test_amx_refuses_pages_it_cannot_tile(block_size: int, head_dim: int) -> None:
    cache = torch.zeros((2, 1, block_size, 2 * head_dim), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16"):
        gather_kv(cache, CacheFormat.BHNC_CPU_AMX, [0], 1)


@pytest.mark.parametrize(
    ("isa", "cache_format"),
    [
        ("vec", CacheFormat.BHNC_CPU),
        ("vec16", CacheFormat.BHNC_CPU),
        ("amx", CacheFormat.BHNC_CPU_AMX),
    ],
)
def test_formats_by_cpu_isa(isa: str, cache_format: CacheFormat) -> None:
    assert format_for_isa(isa) is cache_format


@pytest.mark.parametrize("isa", ["neon", "rvv", "vxe", "vsx", ""])
def test_unmeasured_cpu_isas_have_no_format(isa: str) -> None:
    assert format_for_isa(isa) is None
