"""Which CacheFormat vLLM's CPU attention backend fills, by the ISA it picks for a layer.

The backend picks its kernels per (dtype, block size, head_dim, KV dtype) and each kernel lays
its pages out its own way (pdproxy.vllm_side.kv). Only layouts measured against the real kernel
are named here; on any other ISA the connector moves no KV rather than garbage.
"""

from __future__ import annotations

from typing import Any

from pdproxy.vllm_side.kv import CacheFormat

_MEASURED = {
    "vec": CacheFormat.BHNC_CPU,
    "vec16": CacheFormat.BHNC_CPU,
    "amx": CacheFormat.BHNC_CPU_AMX,
}


def format_for_isa(isa: str) -> CacheFormat | None:
    return _MEASURED.get(isa)


def cpu_isa(vllm_config: Any, head_dim: int) -> str:
    """The ISA vLLM's CPU backend uses for this model's attention layers."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(
        _get_attn_isa(
            vllm_config.model_config.dtype,
            int(vllm_config.cache_config.block_size),
            head_dim,
            vllm_config.cache_config.cache_dtype,
        )
    )
