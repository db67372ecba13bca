"""GET /v1/instances/pairs: each prefill with the decodes it may hand KV to, and how. Pure."""

from __future__ import annotations

from typing import Any

from pdproxy.pairing.geometry import Incompatible, plan_pair, side_of
from pdproxy.pairing.planner import FleetIndex
from pdproxy.pairing.report import traits, verdict_fields


def pairs_report(index: FleetIndex) -> list[dict[str, Any]]:
    """One entry per routable prefill; decodes grouped by compatibility class. The numbers are
    computed with each prefill's own KV port, so the rank reads show the real ports."""
    out: list[dict[str, Any]] = []
    decode_classes = list(index.decode_classes.values())
    for members in index.prefill_classes.values():
        for prefill in members:
            compatible: list[dict[str, Any]] = []
            incompatible: list[dict[str, Any]] = []
            for decodes in decode_classes:
                verdict = plan_pair(
                    side_of(prefill),
                    side_of(decodes[0]),
                    allow_unknown_geometry=index.allow_unknown_geometry,
                )
                entry = {"decodes": [d.name for d in decodes], **verdict_fields(verdict)}
                (incompatible if isinstance(verdict, Incompatible) else compatible).append(entry)
            out.append(
                {
                    "prefill": prefill.name,
                    "zmq_address": str(prefill.zmq_address),
                    "model": prefill.model,
                    "traits": traits(prefill),
                    "compatible": compatible,
                    "incompatible": incompatible,
                }
            )
    out.sort(key=lambda entry: str(entry["prefill"]))
    return out
