"""KV geometry from a Hugging Face config.json, for instances that cannot announce their own
(stock vLLM, through the `pdproxy announce` sidecar). Pure: a parsed map in, a geometry out.

What config.json cannot say (TP size, block size, layout) comes from the sidecar's flags.
"""

from __future__ import annotations

from typing import Any

from pdproxy.registry.messages import Geometry


class ModelConfigError(ValueError):
    pass


def geometry_from_model_config(
    config: dict[str, Any],
    tp_size: int | None = None,
    block_size: int | None = None,
    kv_dtype: str | None = None,
    kv_layout: str | None = None,
) -> Geometry:
    # Multimodal models nest the language model's config; its KV cache is the one that moves.
    text = config.get("text_config")
    if isinstance(text, dict):
        config = {**config, **text}
    layers = _size(config, "num_hidden_layers", "n_layer", "num_layers")
    dtype = kv_dtype or _str(config, "torch_dtype", "dtype")
    mla_rank = _int(config, "kv_lora_rank")  # 0 or absent: not MLA
    if mla_rank:
        # MLA caches one latent vector per token: the compressed KV plus the rope part.
        rope = _int(config, "qk_rope_head_dim") or 0
        return Geometry(
            tp_size=tp_size,
            block_size=block_size,
            num_layers=layers,
            num_kv_heads=1,
            head_dim=mla_rank + rope,
            kv_dtype=dtype,
            is_mla=True,
            kv_layout=kv_layout,
        )
    attention_heads = _size(config, "num_attention_heads", "n_head")
    kv_heads = _size(config, "num_key_value_heads", "num_kv_heads", "n_head_kv")
    if kv_heads is None and config.get("multi_query") is True:
        kv_heads = 1
    if kv_heads is None:
        kv_heads = attention_heads
    head_dim = _size(config, "head_dim")
    hidden = _size(config, "hidden_size", "n_embd")
    if head_dim is None and hidden and attention_heads:
        if hidden % attention_heads:
            raise ModelConfigError(f"hidden_size {hidden} is not a multiple of the head count")
        head_dim = hidden // attention_heads
    return Geometry(
        tp_size=tp_size,
        block_size=block_size,
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        kv_dtype=dtype,
        is_mla=False,
        kv_layout=kv_layout,
    )


def _int(config: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ModelConfigError(f"config.json: {key} must be a non-negative integer")
        return value
    return None


def _size(config: dict[str, Any], *keys: str) -> int | None:
    """A count that, when given, must be positive: the registry refuses zero-sized geometry."""
    value = _int(config, *keys)
    if value == 0:
        raise ModelConfigError(f"config.json: {'/'.join(keys)} must be positive")
    return value


def _str(config: dict[str, Any], *keys: str) -> str | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, str) and value:
            return value
    return None
