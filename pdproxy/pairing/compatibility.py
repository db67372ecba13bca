"""Which (prefill, decode) pairs may exchange KV. Pure.

Today: both must serve the requested model (an instance that announced no model, v0 or
static, serves any). Geometry rules (TP, block size, heads, dtype, layout) plug in here.
"""

from __future__ import annotations

from pdproxy.registry.table import Instance


def models_agree(prefill: Instance, decode: Instance) -> bool:
    return prefill.model is None or decode.model is None or prefill.model == decode.model


def compatible(prefill: Instance, decode: Instance, model: str) -> bool:
    return prefill.serves(model) and decode.serves(model) and models_agree(prefill, decode)
