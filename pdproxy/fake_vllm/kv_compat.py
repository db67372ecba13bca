"""May a fake decode accept this prefill's KV? The fake's own rules, an independent test oracle.

Deliberately NOT pdproxy.pairing.geometry: the tests use the fake worker to catch bugs in
pdproxy's pairing, so the rules are written a second time here, short and literal, after vLLM:

- the connector kinds are equal;
- p2p_nccl: the whole geometry is equal (stock P2pNcclConnector supports only symmetric TP and
  refuses any tensor whose shape differs);
- nixl and pdproxy: layers, total KV heads, head_dim, KV dtype and MLA-ness are equal; one TP
  size divides the other; the decode block size is a multiple of the prefill's;
- nixl only (pdproxy's connector moves KV token by token, whatever the layouts): without MLA
  the layouts are equal, HND when the TP sizes differ, and a prefill TP larger than the
  decode's needs equal block sizes.
"""

from __future__ import annotations

from pdproxy.fake_vllm.config import Geometry

ALL_FIELDS = (
    "tp_size",
    "block_size",
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "kv_dtype",
    "is_mla",
    "kv_layout",
)
MODEL_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "kv_dtype", "is_mla")


def both(name: str, prefill: object, decode: object) -> str:
    return f"{name} prefill={prefill!r} decode={decode!r}"


def first_difference(names: tuple[str, ...], prefill: Geometry, decode: Geometry) -> str | None:
    for name in names:
        if getattr(prefill, name) != getattr(decode, name):
            return both(name, getattr(prefill, name), getattr(decode, name))
    return None


def incompatibility(
    prefill_connector: str, prefill: Geometry, decode_connector: str, decode: Geometry
) -> str | None:
    """None if the decode may accept the prefill's KV, else the broken rule with both values."""
    if prefill_connector != decode_connector:
        return both("connector", prefill_connector, decode_connector)
    if prefill_connector == "p2p_nccl":
        difference = first_difference(ALL_FIELDS, prefill, decode)
        if difference is not None:
            return f"{difference} (p2p_nccl needs identical geometry: only symmetric TP)"
        return None
    difference = first_difference(MODEL_FIELDS, prefill, decode)
    if difference is not None:
        return difference
    p_tp, d_tp = prefill.tp_size, decode.tp_size
    if p_tp % d_tp != 0 and d_tp % p_tp != 0:
        return f"{both('tp_size', p_tp, d_tp)} (neither divides the other)"
    if decode.block_size % prefill.block_size != 0:
        blocks = both("block_size", prefill.block_size, decode.block_size)
        return f"{blocks} (the decode's must be a multiple of the prefill's)"
    if prefill.is_mla or prefill_connector == "pdproxy":
        return None  # MLA: one latent head replicated on every rank, layouts do not apply
    if prefill.kv_layout != decode.kv_layout:
        return both("kv_layout", prefill.kv_layout, decode.kv_layout)
    if p_tp != d_tp and prefill.kv_layout != "HND":
        layouts = both("kv_layout", prefill.kv_layout, decode.kv_layout)
        return f"{layouts} (different TP sizes {p_tp} and {d_tp} need HND)"
    if p_tp > d_tp and prefill.block_size != decode.block_size:
        blocks = both("block_size", prefill.block_size, decode.block_size)
        return f"{blocks} (must be equal when prefill TP {p_tp} > decode TP {d_tp})"
    return None
