"""Pick a (prefill, decode) pair for a request. Pure: a function of a registry snapshot, the
requested model and the per-role tickets; no I/O, no clock.

Instances are grouped into compatibility classes (today: the model they announced), so the work
per snapshot is O(instances + classes^2), never O(prefills x decodes), and the per-request work
is a dictionary lookup plus the policies' choice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdproxy.pairing.compatibility import compatible
from pdproxy.pairing.policies.base import Policy
from pdproxy.pairing.policies.round_robin import RoundRobin
from pdproxy.registry.table import Instance, Snapshot


@dataclass(frozen=True, slots=True)
class Pair:
    prefill: Instance
    decode: Instance


@dataclass(frozen=True, slots=True)
class NoPair:
    reason: str


@dataclass(frozen=True, slots=True)
class FleetView:
    """Everything that can serve one model: prefills with at least one compatible decode."""

    prefills: tuple[Instance, ...]
    decodes_by_class: dict[str | None, tuple[Instance, ...]]
    serving_prefill: bool
    serving_decode: bool

    def decodes_for(self, prefill: Instance) -> tuple[Instance, ...]:
        return self.decodes_by_class[class_key(prefill)]

    def reason(self, model: str) -> str:
        """Why nothing can serve `model` (views are shared by names nobody announced, so the
        name is an argument, never remembered)."""
        if not self.serving_prefill and not self.serving_decode:
            return f"no prefill and no decode instance serves model {model!r}"
        if not self.serving_prefill:
            return f"no prefill instance serves model {model!r}"
        if not self.serving_decode:
            return f"no decode instance serves model {model!r}"
        return f"no decode instance is compatible with a prefill instance for model {model!r}"


def class_key(instance: Instance) -> str | None:
    """Instances with equal keys are interchangeable for compatibility."""
    return instance.model


def _representative(members: Sequence[Instance]) -> Instance:
    return members[0]


def _group(instances: Sequence[Instance]) -> dict[str | None, tuple[Instance, ...]]:
    groups: dict[str | None, list[Instance]] = {}
    for instance in instances:
        groups.setdefault(class_key(instance), []).append(instance)
    return {key: tuple(members) for key, members in groups.items()}


class FleetIndex:
    """Compatible pairs of one snapshot, memoised per model (bounded by announced models)."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self._prefill_classes = _group(snapshot.prefills)
        self._decode_classes = _group(snapshot.decodes)
        self._models = {key for key in (*self._prefill_classes, *self._decode_classes) if key}
        self._views: dict[str | None, FleetView] = {}

    def view(self, model: str) -> FleetView:
        # A model nobody announced can only be served by model-less instances: one memo entry
        # covers every such name, so arbitrary client model names cannot grow the memo.
        memo_key = model if model in self._models else None
        view = self._views.get(memo_key)
        if view is None:
            view = self._build(model)
            self._views[memo_key] = view
        return view

    def _build(self, model: str) -> FleetView:
        prefills: list[Instance] = []
        decodes_by_class: dict[str | None, tuple[Instance, ...]] = {}
        serving_p = serving_d = False
        for p_key, p_members in self._prefill_classes.items():
            p_rep = _representative(p_members)
            if not p_rep.serves(model):
                continue
            serving_p = True
            matched: list[Instance] = []
            for d_members in self._decode_classes.values():
                d_rep = _representative(d_members)
                serving_d = serving_d or d_rep.serves(model)
                if compatible(p_rep, d_rep, model):
                    matched.extend(d_members)
            if matched:
                prefills.extend(p_members)
                decodes_by_class[p_key] = tuple(matched)
        if not serving_d:
            serving_d = any(_representative(m).serves(model) for m in self._decode_classes.values())
        return FleetView(tuple(prefills), decodes_by_class, serving_p, serving_d)


class Planner:
    """Holds the per-role tickets and the index of the latest snapshot. Deterministic.

    Both tickets advance once per plan, so two round-robin cursors over fleets whose sizes
    share a factor would move in lockstep: with 2 P and 2 D only (P0, D0) and (P1, D1) would
    ever carry KV. With `spread_pairs`, the decode ticket slips one place every lcm(P, D)
    plans; over P x D plans every (P, D) pair is then used exactly once, and every instance
    still gets its even share.
    """

    def __init__(
        self, prefill_policy: Policy, decode_policy: Policy, spread_pairs: bool = False
    ) -> None:
        self._prefill_policy = prefill_policy
        self._decode_policy = decode_policy
        self._spread_pairs = spread_pairs
        self._prefill_ticket = 0
        self._decode_ticket = 0
        self._index: FleetIndex | None = None

    def index(self, snapshot: Snapshot) -> FleetIndex:
        if self._index is None or self._index.snapshot is not snapshot:
            self._index = FleetIndex(snapshot)
        return self._index

    def plan(self, snapshot: Snapshot, model: str) -> Pair | NoPair:
        view = self.index(snapshot).view(model)
        if not view.prefills:
            return NoPair(view.reason(model))
        prefill = self._prefill_policy.choose(view.prefills, self._prefill_ticket)
        self._prefill_ticket += 1
        decodes = view.decodes_for(prefill)
        ticket = self._decode_ticket
        if self._spread_pairs:
            ticket += ticket // math.lcm(len(view.prefills), len(decodes))
        decode = self._decode_policy.choose(decodes, ticket)
        self._decode_ticket += 1
        return Pair(prefill, decode)


def round_robin_planner() -> Planner:
    """The reference pairing: round robin per role, spread over every (P, D) pair."""
    return Planner(RoundRobin(), RoundRobin(), spread_pairs=True)


@dataclass(frozen=True, slots=True)
class Readiness:
    ready: bool
    reason: str


def readiness(snapshot: Snapshot) -> Readiness:
    """Ready when at least one prefill has a compatible decode, for some model."""
    if not snapshot.prefills:
        return Readiness(False, "no prefill instance is registered")
    if not snapshot.decodes:
        return Readiness(False, "no decode instance is registered")
    prefill_classes = _group(snapshot.prefills)
    decode_classes = _group(snapshot.decodes)
    for p_members in prefill_classes.values():
        p_rep = _representative(p_members)
        for d_members in decode_classes.values():
            d_rep = _representative(d_members)
            model = p_rep.model or d_rep.model or ""
            if compatible(p_rep, d_rep, model):
                return Readiness(True, "ok")
    p_models = sorted({str(i.model) for i in snapshot.prefills})
    d_models = sorted({str(i.model) for i in snapshot.decodes})
    return Readiness(
        False,
        f"no prefill has a compatible decode: prefills serve {p_models}, decodes serve {d_models}",
    )
