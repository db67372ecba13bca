"""Read an instance's KV geometry from vLLM's own VllmConfig, inside the vLLM process.

Duck-typed on purpose: it touches only a handful of stable attributes, so importing it needs no
vLLM, and a vLLM that renamed one of them yields an unknown field instead of a crash.
"""

from __future__ import annotations

import logging
from typing import Any

from pdproxy.registry.messages import Geometry

log = logging.getLogger("pdproxy.vllm_side")

HEADS_AXIS, TOKENS_AXIS = 2, 3  # vLLM's logical KV layout is [L, B, H, N, C]
LEGACY_LAYOUT_NAMES = {"NHD": "NHD", "HND": "HND"}


def geometry_from_vllm_config(vllm_config: Any) -> Geometry:
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    return Geometry(
        tp_size=_attempt(lambda: int(parallel.tensor_parallel_size)),
        block_size=_attempt(lambda: int(cache.block_size)),
        num_layers=_attempt(lambda: int(model.get_num_layers(parallel))),
        num_kv_heads=_attempt(lambda: int(model.get_total_num_kv_heads())),
        head_dim=_attempt(lambda: int(model.get_head_size())),
        kv_dtype=_attempt(lambda: kv_dtype_name(cache.cache_dtype, model.dtype)),
        is_mla=_attempt(lambda: bool(model.use_mla)),
        kv_layout=_attempt(lambda: layout_name(getattr(cache, "kv_cache_layout", None))),
    )


def kv_dtype_name(cache_dtype: object, model_dtype: object) -> str:
    """The KV cache's element type: the model's dtype when the cache dtype is "auto"."""
    name = str(cache_dtype)
    if name == "auto":
        name = str(model_dtype)
    return name.removeprefix("torch.")


def layout_name(resolved: object) -> str | None:
    """vLLM >= 0.32 names layouts by stride order (LBNHC, LBHNC, ...); the registry speaks the
    legacy names: heads before tokens within a block is HND, tokens before heads NHD."""
    if resolved is None:
        return None
    name = str(getattr(resolved, "name", resolved))
    if name in LEGACY_LAYOUT_NAMES:
        return LEGACY_LAYOUT_NAMES[name]
    logical = "LBHNC"
    if sorted(name) != sorted(logical):
        return None
    order = [logical.index(axis) for axis in name]
    return "HND" if order.index(HEADS_AXIS) < order.index(TOKENS_AXIS) else "NHD"


def _attempt(read: Any) -> Any:
    try:
        return read()
    except Exception as exc:  # any vLLM version drift means "unknown", never a crash
        log.warning("pdproxy connector: could not read a geometry field: %r", exc)
        return None
