"""Sentences and tables about pairing, for operators (/ready, /v1/instances/pairs, 503s). Pure."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdproxy.base.roles import Role
from pdproxy.pairing.geometry import Incompatible, Mismatch, PairPlan, Unverified, Verdict
from pdproxy.registry.table import Instance

_NAMED = 3  # instances named in a sentence before "and N more"


def role_word(role: Role, plural: bool = False) -> str:
    return role + "s" if plural else role


def describe(members: Sequence[Instance]) -> str:
    """'prefill 10.0.0.5:8100 (p2p_nccl, tp 4)' for a class of interchangeable instances."""
    first = members[0]
    names = ", ".join(m.name for m in members[:_NAMED])
    if len(members) > _NAMED:
        names += f" and {len(members) - _NAMED} more"
    return f"{role_word(first.role, len(members) > 1)} {names} ({traits(first)})"


def traits(instance: Instance) -> str:
    parts = [instance.connector.value if instance.connector else "connector unknown"]
    geometry = instance.geometry
    if geometry is None:
        parts.append("geometry unknown")
    else:
        if geometry.tp_size is not None:
            parts.append(f"tp {geometry.tp_size}")
        if geometry.block_size is not None:
            parts.append(f"block {geometry.block_size}")
    if instance.model:
        parts.append(f"model {instance.model}")
    return ", ".join(parts)


def _attribute(kind: Mismatch, other: Instance) -> str | None:
    """What the other side has, for a mismatch that one attribute explains."""
    geometry = other.geometry
    if kind is Mismatch.CONNECTOR:
        return f"connector {other.connector.value if other.connector else 'unknown'}"
    if kind is Mismatch.MODEL:
        return f"model {other.model}"
    if geometry is None:
        return None
    if kind is Mismatch.TP:
        return f"tp {geometry.tp_size}"
    if kind is Mismatch.BLOCK_SIZE:
        return f"block size {geometry.block_size}"
    if kind is Mismatch.LAYOUT:
        return f"layout {geometry.kv_layout}"
    if kind is Mismatch.DTYPE:
        return f"kv dtype {geometry.kv_dtype}"
    if kind is Mismatch.LAYERS:
        return f"{geometry.num_layers} layers"
    return None


def orphan_reason(
    members: Sequence[Instance], rejections: Sequence[tuple[Instance, Incompatible]]
) -> str:
    """'prefill X (p2p_nccl, tp 4) has no compatible decode: decodes have tp 2'."""
    role = members[0].role
    other = role.other
    head = f"{describe(members)} has no compatible {role_word(other)}"
    if not rejections:
        return f"{head}: no {role_word(other)} is registered"
    haves: dict[str, None] = {}  # ordered sets
    refusals: dict[str, None] = {}
    for instance, verdict in rejections:
        attribute = _attribute(verdict.kind, instance)
        # An attribute both sides share explains nothing (nixl refusing NHD on both sides when
        # the TP sizes differ): quote the verdict instead.
        if attribute is None or attribute == _attribute(verdict.kind, members[0]):
            refusals[verdict.detail] = None
        else:
            haves[attribute] = None
    others = role_word(other, True)
    details = []
    if haves:
        details.append(f"{others} have {', '.join(haves)}")
    if refusals:
        details.append(f"{others} refused: {'; '.join(refusals)}")
    return f"{head}: " + "; ".join(details)


def verdict_fields(verdict: Verdict) -> dict[str, Any]:
    """The derived numbers of a pair, as /v1/instances/pairs lists them."""
    if isinstance(verdict, Incompatible):
        return {"compatible": False, "mismatch": verdict.kind.value, "reason": verdict.detail}
    if isinstance(verdict, Unverified):
        return {"compatible": True, "verified": False, "reason": verdict.detail}
    return {"compatible": True, "verified": True, **plan_fields(verdict)}


def plan_fields(plan: PairPlan) -> dict[str, Any]:
    return {
        "connector": None if plan.connector is None else plan.connector.value,
        "tp_ratio": plan.tp_ratio,
        "block_size_ratio": plan.block_size_ratio,
        "kv_bytes_per_token": plan.bytes_per_token,
        "prefill_kv_bytes_per_token_per_rank": plan.prefill_bytes_per_token_per_rank,
        "decode_kv_bytes_per_token_per_rank": plan.decode_bytes_per_token_per_rank,
        "kv_bytes_per_prefill_block": plan.bytes_per_request(plan.prefill.block_size),
        "decode_rank_reads": [
            [
                {
                    "prefill_rank": read.prefill_rank,
                    "port": read.port,
                    "heads": [read.heads.start, read.heads.stop],
                }
                for read in reads
            ]
            for reads in plan.reads
        ],
    }
