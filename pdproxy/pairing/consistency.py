"""Does an instance's announced geometry contradict what its model's other instances say? Pure.

Layers, KV heads, head_dim and MLA belong to the model, not to the deployment (unlike TP, block
size, dtype or layout): two instances of one model disagreeing on them means one of them is
misconfigured or announces the wrong model name, and it will never pair.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdproxy.registry.table import Instance

MODEL_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "is_mla")


def contradiction(instance: Instance, others: Iterable[Instance]) -> str | None:
    """A sentence naming the first disagreeing instance and fields, or None."""
    mine = instance.geometry
    if instance.model is None or mine is None:
        return None
    for other in others:
        theirs = other.geometry
        same = other.http_address == instance.http_address
        if same or other.model != instance.model or theirs is None:
            continue
        differences = [
            f"{field} {getattr(mine, field)} vs {getattr(theirs, field)}"
            for field in MODEL_FIELDS
            if getattr(mine, field) is not None
            and getattr(theirs, field) is not None
            and getattr(mine, field) != getattr(theirs, field)
        ]
        if differences:
            return (
                f"{instance.name} announces model {instance.model!r} with a geometry that "
                f"contradicts {other.name}'s: {', '.join(differences)}"
            )
    return None
