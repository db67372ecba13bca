"""Pick a (prefill, decode) pair for a request. Pure: a function of a registry snapshot, the
request's features, the proxy's own legs in flight and the per-role tickets; no I/O, no clock.

Instances are grouped into compatibility classes (model, connector, KV geometry): members of a
class are interchangeable for pairing, so geometry is checked once per pair of classes, the
work per snapshot is O(instances + classes^2), never O(prefills x decodes), and the work per
request is a dictionary lookup plus the policies' choice. Compatible pairs are filtered first;
only then do the policies choose.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from pdproxy.base.roles import Role
from pdproxy.ids import Address
from pdproxy.pairing.candidates import Candidates
from pdproxy.pairing.features import RequestFeatures
from pdproxy.pairing.geometry import (
    MAX_PORT,
    Incompatible,
    Verdict,
    plan_pair,
    side_of,
)
from pdproxy.pairing.inflight import InFlight
from pdproxy.pairing.policies.base import Policy
from pdproxy.pairing.policies.round_robin import RoundRobin
from pdproxy.pairing.prefix_cache import PrefixCache
from pdproxy.pairing.report import orphan_reason
from pdproxy.registry.messages import Connector, Geometry
from pdproxy.registry.table import Instance, Snapshot

# KV capacity of one decode instance, in tokens, when weighing tokens in flight against the
# announced kv_usage fraction (least_kv). Roughly an 8B model's cache on one 80 GB GPU.
DEFAULT_KV_CAPACITY_TOKENS = 262_144

# Connectors whose decode side computes a prompt itself when no KV is announced for it, so a
# short prompt may skip the prefill leg. Stock P2pNcclConnector consumers always wait for KV.
LOCAL_COMPUTE = frozenset(
    (Connector.NIXL, Connector.PDPROXY, Connector.MOONCAKE, Connector.NIXL_PUSH)
)

ClassKey = tuple[str | None, Connector | None, Geometry | None, bool]


class Unpaired(StrEnum):
    """Why no pair was found. Fixed set: it labels a metric."""

    NO_INSTANCE = "no_instance"
    NO_PREFILL = "no_prefill"
    NO_DECODE = "no_decode"
    INCOMPATIBLE = "incompatible"


@dataclass(slots=True, init=False, unsafe_hash=True)
class Pair:
    prefill: Instance
    decode: Instance
    prefill_tokens: int  # prefill work counted in flight until released
    decode_tokens: int

    # Why a hand-written __init__ (not frozen): docs/performance.md, "Dataclass constructors".
    def __init__(
        self, prefill: Instance, decode: Instance, prefill_tokens: int = 0, decode_tokens: int = 0
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.prefill_tokens = prefill_tokens
        self.decode_tokens = decode_tokens

    @property
    def connector(self) -> Connector | None:
        """The connector both instances announced; None if either did not say (then the pair
        is treated as stock P2pNcclConnector: no kv_transfer_params are sent)."""
        prefill = self.prefill.connector
        return prefill if prefill == self.decode.connector else None


@dataclass(frozen=True, slots=True)
class Direct:
    """No prefill leg: the decode instance computes the (short) prompt itself."""

    decode: Instance
    decode_tokens: int = 0


@dataclass(frozen=True, slots=True)
class NoPair:
    kind: Unpaired
    reason: str


def class_key(instance: Instance) -> ClassKey:
    """Instances with equal keys are interchangeable for pairing."""
    geometry = instance.geometry
    tp = None if geometry is None else geometry.tp_size
    # A prefill's KV ports run from its zmq port to port + tp - 1: past 65535 it cannot serve.
    ports_fit = tp is None or instance.zmq_address.port + tp - 1 <= MAX_PORT
    return (instance.model, instance.connector, geometry, ports_fit)


def group(instances: Iterable[Instance]) -> dict[ClassKey, tuple[Instance, ...]]:
    groups: dict[ClassKey, list[Instance]] = {}
    for instance in instances:
        groups.setdefault(class_key(instance), []).append(instance)
    return {key: tuple(members) for key, members in groups.items()}


@dataclass(frozen=True, slots=True)
class FleetView:
    """Everything that can serve one model: prefills with at least one compatible decode."""

    prefills: Candidates | None
    decodes_by_class: dict[ClassKey, Candidates]
    direct: Candidates | None  # decodes that may compute a prompt themselves
    unpaired: Unpaired | None  # why nothing can serve the model (prefills is None)
    orphans: tuple[str, ...] = ()  # for INCOMPATIBLE: why each prefill class pairs with none

    def decodes_for(self, prefill: Instance) -> Candidates:
        return self.decodes_by_class[class_key(prefill)]

    def no_pair(self, model: str) -> NoPair:
        """Why nothing can serve `model` (views are shared by names nobody announced, so the
        name is an argument, never remembered)."""
        kind = self.unpaired or Unpaired.INCOMPATIBLE
        if kind is Unpaired.NO_INSTANCE:
            return NoPair(kind, f"no prefill and no decode instance serves model {model!r}")
        if kind is Unpaired.NO_PREFILL:
            return NoPair(kind, f"no prefill instance serves model {model!r}")
        if kind is Unpaired.NO_DECODE:
            return NoPair(kind, f"no decode instance serves model {model!r}")
        return NoPair(
            kind,
            f"no decode instance is compatible with a prefill instance for model {model!r}: "
            + "; ".join(self.orphans),
        )


class FleetIndex:
    """Compatible pairs of one snapshot, memoised per model (bounded by announced models)."""

    def __init__(
        self,
        snapshot: Snapshot,
        inflight: InFlight,
        *,
        allow_unknown_geometry: bool = False,
        kv_capacity_tokens: int = DEFAULT_KV_CAPACITY_TOKENS,
        prefix_cache: PrefixCache | None = None,
        live: bool = True,
    ) -> None:
        self.snapshot = snapshot
        self._live = live
        self.allow_unknown_geometry = allow_unknown_geometry
        self._inflight = inflight
        self._prefix_cache = prefix_cache
        self._kv_capacity_tokens = kv_capacity_tokens
        self.prefill_classes = group(snapshot.prefills)
        self.decode_classes = group(snapshot.decodes)
        self._models = {
            key[0] for key in (*self.prefill_classes, *self.decode_classes) if key[0] is not None
        }
        self._verdicts: dict[tuple[ClassKey, ClassKey], Verdict] = {}
        self._views: dict[str | None, FleetView] = {}
        self._members: dict[tuple[Role, str | None, bool], Candidates | None] = {}

    def verdict(self, p_key: ClassKey, d_key: ClassKey) -> Verdict:
        verdict = self._verdicts.get((p_key, d_key))
        if verdict is None:
            verdict = plan_pair(
                side_of(self.prefill_classes[p_key][0]),
                side_of(self.decode_classes[d_key][0]),
                allow_unknown_geometry=self.allow_unknown_geometry,
            )
            self._verdicts[(p_key, d_key)] = verdict
        return verdict

    def view(self, model: str) -> FleetView:
        # A model nobody announced can only be served by model-less instances: one memo entry
        # covers every such name, so arbitrary client model names cannot grow the memo.
        memo_key = model if model in self._models else None
        view = self._views.get(memo_key)
        if view is None:
            view = self._build(model)
            self._views[memo_key] = view
        return view

    def members(self, role: Role, model: str | None) -> Candidates | None:
        """The instances of `role` that serve `model` (any model: None), paired or not: what
        a request that needs one instance alone (a passed-through path) chooses from."""
        # Memoised like views: every unannounced model name shares one entry.
        announced = model is None or model in self._models
        key = (role, model if announced else None, announced)
        if key in self._members:
            return self._members[key]
        classes = self.prefill_classes if role is Role.PREFILL else self.decode_classes
        found = tuple(
            i
            for members in classes.values()
            if model is None or members[0].serves(model)
            for i in members
        )
        chosen = self.candidates(found) if found else None
        self._members[key] = chosen
        return chosen

    def candidates(self, instances: tuple[Instance, ...]) -> Candidates:
        return Candidates(
            instances,
            self._inflight,
            self._kv_capacity_tokens,
            self._prefix_cache,
            live=self._live,
        )

    def _build(self, model: str) -> FleetView:
        p_keys = [k for k, m in self.prefill_classes.items() if m[0].serves(model)]
        d_keys = [k for k, m in self.decode_classes.items() if m[0].serves(model)]
        direct_members = tuple(
            i for k in d_keys if k[1] in LOCAL_COMPUTE for i in self.decode_classes[k]
        )
        direct = self.candidates(direct_members) if direct_members else None
        prefills: list[Instance] = []
        decodes_by_class: dict[ClassKey, Candidates] = {}
        shared: dict[tuple[ClassKey, ...], Candidates] = {}
        for p_key in p_keys:
            matched = []
            for d_key in d_keys:
                if not isinstance(self.verdict(p_key, d_key), Incompatible):
                    matched.append(d_key)
            if not matched:
                continue
            prefills.extend(self.prefill_classes[p_key])
            # Prefill classes with the same compatible decodes share one candidate set, so
            # its load boards see all the traffic those decodes get.
            signature = tuple(matched)
            if signature not in shared:
                members = tuple(i for d_key in matched for i in self.decode_classes[d_key])
                shared[signature] = self.candidates(members)
            decodes_by_class[p_key] = shared[signature]
        if prefills:
            return FleetView(self.candidates(tuple(prefills)), decodes_by_class, direct, None)
        unpaired = self._unpaired(p_keys, d_keys)
        orphans: tuple[str, ...] = ()
        if unpaired is Unpaired.INCOMPATIBLE:
            orphans = tuple(self.orphan(p_key, d_keys) for p_key in p_keys)
        return FleetView(None, {}, direct, unpaired, orphans)

    def _unpaired(self, p_keys: list[ClassKey], d_keys: list[ClassKey]) -> Unpaired:
        if not p_keys and not d_keys:
            return Unpaired.NO_INSTANCE
        if not p_keys:
            return Unpaired.NO_PREFILL
        if not d_keys:
            return Unpaired.NO_DECODE
        return Unpaired.INCOMPATIBLE

    def orphan(self, p_key: ClassKey, d_keys: Sequence[ClassKey]) -> str:
        """Why the prefills of class `p_key` pair with none of the decode classes `d_keys`."""
        rejections = []
        for d_key in d_keys:
            verdict = self.verdict(p_key, d_key)
            if isinstance(verdict, Incompatible):
                rejections.append((self.decode_classes[d_key][0], verdict))
        return orphan_reason(self.prefill_classes[p_key], rejections)

    def orphans(self) -> list[str]:
        """Every prefill class that pairs with no decode class at all, whatever the model."""
        d_keys = list(self.decode_classes)
        if not d_keys:
            return []
        return [
            self.orphan(p_key, d_keys)
            for p_key in self.prefill_classes
            if all(isinstance(self.verdict(p_key, d_key), Incompatible) for d_key in d_keys)
        ]

    def has_pair(self) -> bool:
        return any(
            not isinstance(self.verdict(p_key, d_key), Incompatible)
            for p_key in self.prefill_classes
            for d_key in self.decode_classes
        )


class Planner:
    """Holds the per-role tickets, the legs in flight and the index of the latest snapshot.
    Deterministic.

    Both tickets advance once per plan, so two round-robin cursors over fleets whose sizes
    share a factor would move in lockstep: with 2 P and 2 D only (P0, D0) and (P1, D1) would
    ever carry KV. With `spread_pairs`, the decode ticket slips one place every lcm(P, D)
    plans; over P x D plans every (P, D) pair is then used exactly once, and every instance
    still gets its even share.

    Every `plan` (and `plan_direct`) counts its legs in flight: the caller must `release`
    each chosen instance exactly once, when its leg ends.

    Three ways to keep instances out of a plan, by name: `excluded` (ejected or drained) is
    hard and changes rarely, so the index of the snapshot without them is kept; `busy`
    (instances at their in-flight cap, a set that changes with every leg near the cap) is hard
    too but per request: a one-off index leaves them out, and the routing index stays; `avoid`
    (what already failed this request) is soft: a one-off index is built without them, and if
    nothing is left the plan falls back to them, since retrying a failed instance beats
    failing the request. One-off indexes read the scores once and leave no listener behind.
    """

    def __init__(
        self,
        prefill_policy: Policy,
        decode_policy: Policy,
        *,
        spread_pairs: bool | None = None,
        allow_unknown_geometry: bool = False,
        kv_capacity_tokens: int = DEFAULT_KV_CAPACITY_TOKENS,
        instance_cap: int = 0,
        first_ticket: int = 0,
    ) -> None:
        if kv_capacity_tokens < 1:
            raise ValueError("kv_capacity_tokens must be at least 1")
        if instance_cap < 0:
            raise ValueError("instance_cap must not be negative")
        if first_ticket < 0:
            raise ValueError("first_ticket must not be negative")
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.inflight = InFlight()
        self.prefix_cache = PrefixCache()
        # Only two round-robin cursors can fall into lockstep: spread them unless told.
        both_round_robin = isinstance(prefill_policy, RoundRobin) and isinstance(
            decode_policy, RoundRobin
        )
        self._spread_pairs = both_round_robin if spread_pairs is None else spread_pairs
        self._allow_unknown_geometry = allow_unknown_geometry
        self._kv_capacity_tokens = kv_capacity_tokens
        self._instance_cap = instance_cap
        # Instances holding `instance_cap` legs: they take no more until one ends. Replaced,
        # never changed in place; read it, do not set it (an attribute, not a property: it is
        # read three times per request).
        self.full: frozenset[str] = frozenset()
        self._prefill_ticket = first_ticket
        self._decode_ticket = first_ticket
        self._index: FleetIndex | None = None
        self._index_source: tuple[Snapshot, frozenset[str]] | None = None

    def index(self, snapshot: Snapshot, excluded: frozenset[str] = frozenset()) -> FleetIndex:
        source = self._index_source
        if (
            self._index is None
            or source is None
            or source[0] is not snapshot
            or (source[1] != excluded)
        ):
            # The old index's score boards go with it: only the new ones follow the legs.
            self.inflight.clear_listeners()
            self.inflight.keep_reports(
                i.http_address for i in (*snapshot.prefills, *snapshot.decodes)
            )
            self._index = self._build_index(without(snapshot, excluded), live=True)
            self._index_source = (snapshot, excluded)
        return self._index

    def survey(self, snapshot: Snapshot, excluded: frozenset[str] = frozenset()) -> FleetIndex:
        """An index for looking, not routing (readiness, listings): the routing index and
        its score boards are left alone."""
        return self._build_index(without(snapshot, excluded), live=False)

    def _build_index(self, snapshot: Snapshot, *, live: bool) -> FleetIndex:
        return FleetIndex(
            snapshot,
            self.inflight,
            allow_unknown_geometry=self._allow_unknown_geometry,
            kv_capacity_tokens=self._kv_capacity_tokens,
            prefix_cache=self.prefix_cache,
            live=live,
        )

    def _view(
        self,
        snapshot: Snapshot,
        model: str,
        excluded: frozenset[str],
        avoid: frozenset[str],
        busy: frozenset[str],
    ) -> FleetView:
        view = self.index(snapshot, excluded).view(model)
        if busy:
            view = self._one_off(snapshot, excluded | busy, model)
            if view.prefills is None:
                return view  # busy instances are never a fallback: the caller waits
        if not avoid:
            return view
        narrowed = self._one_off(snapshot, excluded | busy | avoid, model)
        return view if narrowed.prefills is None else narrowed

    def _one_off(self, snapshot: Snapshot, left_out: frozenset[str], model: str) -> FleetView:
        return self._build_index(without(snapshot, left_out), live=False).view(model)

    def plan(
        self,
        snapshot: Snapshot,
        request: RequestFeatures,
        *,
        excluded: frozenset[str] = frozenset(),
        avoid: frozenset[str] = frozenset(),
        busy: frozenset[str] = frozenset(),
    ) -> Pair | NoPair:
        view = self._view(snapshot, request.model, excluded, avoid, busy)
        if view.prefills is None:
            return view.no_pair(request.model)
        prefill = self.prefill_policy.choose(view.prefills, request, self._prefill_ticket)
        self._prefill_ticket += 1
        decodes = view.decodes_for(prefill)
        ticket = self._decode_ticket
        if self._spread_pairs:
            ticket += ticket // math.lcm(len(view.prefills), len(decodes))
        decode = self.decode_policy.choose(decodes, request, ticket)
        self._decode_ticket += 1
        # Prefill work: the part of the prompt the instance probably does not hold already;
        # at least one token, which vLLM computes even for a fully cached prompt.
        windows, address = request.prefix_windows, prefill.http_address
        work = max(1, request.prompt_tokens - self.prefix_cache.cached_tokens(windows, address))
        self.prefix_cache.record(windows, address)
        self._add(address, work)
        self._add(decode.http_address, request.decode_tokens)
        return Pair(prefill, decode, work, request.decode_tokens)

    def plan_direct(
        self,
        snapshot: Snapshot,
        request: RequestFeatures,
        *,
        excluded: frozenset[str] = frozenset(),
        avoid: frozenset[str] = frozenset(),
        busy: frozenset[str] = frozenset(),
    ) -> Direct | None:
        """A decode instance able to compute the prompt itself, or None."""
        direct = self._view(snapshot, request.model, excluded, avoid, busy).direct
        if direct is None:
            return None
        decode = self.decode_policy.choose(direct, request, self._decode_ticket)
        self._decode_ticket += 1
        self._add(decode.http_address, request.decode_tokens)
        return Direct(decode, request.decode_tokens)

    def plan_one(
        self,
        snapshot: Snapshot,
        role: Role,
        model: str | None,
        *,
        excluded: frozenset[str] = frozenset(),
        avoid: frozenset[str] = frozenset(),
        busy: frozenset[str] = frozenset(),
    ) -> Instance | None:
        """One instance of `role` for `model` (any model: None), chosen by that role's policy
        and counted in flight; None when none is left once `excluded` and `busy` are. `avoid`
        is soft, as for `plan`."""
        candidates = self.index(snapshot, excluded).members(role, model)
        if busy and candidates is not None:
            candidates = self._one_off_members(snapshot, excluded | busy, role, model)
        if candidates is None:
            return None
        if avoid:
            narrowed = self._one_off_members(snapshot, excluded | busy | avoid, role, model)
            candidates = candidates if narrowed is None else narrowed
        features = RequestFeatures(model or "")
        if role is Role.PREFILL:
            chosen = self.prefill_policy.choose(candidates, features, self._prefill_ticket)
            self._prefill_ticket += 1
        else:
            chosen = self.decode_policy.choose(candidates, features, self._decode_ticket)
            self._decode_ticket += 1
        self._add(chosen.http_address, 0)
        return chosen

    def _one_off_members(
        self, snapshot: Snapshot, left_out: frozenset[str], role: Role, model: str | None
    ) -> Candidates | None:
        return self._build_index(without(snapshot, left_out), live=False).members(role, model)

    def release(self, address: Address, tokens: int) -> None:
        busy = self.inflight.remove(address, tokens)
        if self.full and busy.requests < self._instance_cap:
            name = str(address)
            if name in self.full:
                self.full = self.full - {name}

    def _add(self, address: Address, tokens: int) -> None:
        busy = self.inflight.add(address, tokens)
        cap = self._instance_cap
        if cap and busy.requests >= cap:
            self.full = self.full | {str(address)}


def without(snapshot: Snapshot, excluded: frozenset[str]) -> Snapshot:
    """The snapshot minus the named instances (the same object when none is named)."""
    if not excluded:
        return snapshot
    return Snapshot(
        snapshot.version,
        tuple(i for i in snapshot.prefills if i.name not in excluded),
        tuple(i for i in snapshot.decodes if i.name not in excluded),
    )


def round_robin_planner() -> Planner:
    """The reference pairing: round robin per role, spread over every (P, D) pair."""
    return Planner(RoundRobin(), RoundRobin())


@dataclass(frozen=True, slots=True)
class Readiness:
    ready: bool
    reason: str
    orphans: tuple[str, ...] = ()  # prefill classes that pair with no decode


def readiness(index: FleetIndex) -> Readiness:
    """Ready when at least one prefill has a compatible decode, for some model; the orphans
    (prefills no decode can take KV from) are named either way."""
    snapshot = index.snapshot
    if not snapshot.prefills:
        return Readiness(False, "no prefill instance is registered")
    if not snapshot.decodes:
        return Readiness(False, "no decode instance is registered")
    orphans = tuple(index.orphans())
    if index.has_pair():
        return Readiness(True, "ok", orphans)
    return Readiness(False, "no prefill has a compatible decode: " + "; ".join(orphans), orphans)
