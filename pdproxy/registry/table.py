"""The registry table: who is registered, since when, until when. Pure; the caller passes `now`.

An instance is keyed by its HTTP address (as vLLM's example proxy does). Heartbeats that change
nothing only move `last_seen`, so the immutable Snapshot the planner reads is rebuilt only when
membership or announced content changes.

With a registry secret, the caller says which announcements were signed. An instance a signed
message registered is then the signer's: an unsigned message may neither change it nor remove
it (SIGNED_INSTANCE), nor keep it alive; an unsigned v0 ping that agrees with it (stock vLLM
pinging beside its signing sidecar) is accepted and changes nothing. Instances registered
unsigned have a cap of their own (`max_unsigned`, UNSIGNED_CAPACITY) and do not count against
`max_instances`, so a flood of unsigned pings never takes the room of signed instances. Without
a secret nothing is signed and one cap holds for all.

Instances come from three sources: the operator (static), announcements (v0/v1), and, when it
is on, Kubernetes discovery (`discovered`/`undiscovered`, fed by pdproxy.registry.kubernetes).
Discovery says which pods exist and whether they are ready: a discovered instance never
expires, is routed to only while its pod is ready and not annotated drained, and leaves the
table at once when its pod is deleted (an announcement for it is then refused for one TTL, so a
late one cannot bring it back). Announcements for a discovered instance enrich it (model,
geometry where the pod has none, load, health) but may not move it (DISCOVERY_CONFLICT).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from enum import StrEnum

from pdproxy.base.roles import Role
from pdproxy.ids import Address
from pdproxy.registry.messages import (
    Announcement,
    Connector,
    Geometry,
    KvCoordinates,
    Load,
    Reason,
    Rejected,
)


class Source(StrEnum):
    STATIC = "static"
    V0 = "v0"
    V1 = "v1"
    DISCOVERED = "discovered"  # a Kubernetes pod (Settings.discovery = kubernetes)


@dataclass(frozen=True, slots=True)
class Instance:
    role: Role
    http_address: Address
    zmq_address: Address
    source: Source
    model: str | None = None
    connector: Connector | None = None
    geometry: Geometry | None = None
    load: Load | None = None
    healthy: bool = True
    max_model_len: int | None = None  # the context length the instance runs its model with
    coordinates: KvCoordinates | None = None  # where its connector is reached (mooncake, ...)
    # Kubernetes discovery's word (always True/False for other sources): the pod is Ready and
    # not terminating; the pod carries the drain annotation.
    ready: bool = True
    pod_drained: bool = False
    # The label this instance carries in logs, metrics and errors; read several times per
    # request, so made once.
    name: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", str(self.http_address))

    @property
    def routable(self) -> bool:
        """Whether new legs may go to it: announced healthy and, if discovered, its pod ready
        and not drained. The others stay registered and receive no requests."""
        return self.healthy and self.ready and not self.pod_drained

    def serves(self, model: str) -> bool:
        # A v0 or static instance without a model announced serves whatever it is asked.
        return self.model is None or self.model == model


class Change(StrEnum):
    REGISTERED = "registered"
    UPDATED = "updated"  # role, addresses, model, connector or geometry changed
    LOAD = "load"  # only the load report changed
    REFRESHED = "refreshed"  # nothing changed but last_seen


@dataclass(frozen=True, slots=True)
class Registration:
    instance: Instance
    first_seen: float
    last_seen: float
    v1_seen: float | None = None  # the last v1 announcement (v0 pings only refresh it)
    signed: bool = False  # registered by a signed message: unsigned ones may not change it


@dataclass(frozen=True, slots=True)
class Snapshot:
    """An immutable view of the fleet at one moment: what the planner decides on. Instances
    that are not `routable` (announced unhealthy, an unready or drained pod) are left out."""

    version: int
    prefills: tuple[Instance, ...]
    decodes: tuple[Instance, ...]


def instance_from(announcement: Announcement) -> Instance:
    return Instance(
        role=announcement.role,
        http_address=announcement.http_address,
        zmq_address=announcement.zmq_address,
        source=Source.V1 if announcement.version == 1 else Source.V0,
        model=announcement.model,
        connector=announcement.connector,
        geometry=announcement.geometry,
        load=announcement.load,
        healthy=announcement.healthy,
        max_model_len=announcement.max_model_len,
        coordinates=announcement.coordinates,
    )


# Load reports arrive every few seconds from every instance: a routing snapshot may lag them by
# this much, so that a fleet of thousands costs a few rebuilds a second, not one per report.
LOAD_REFRESH_SECONDS = 0.5


class RegistryTable:
    def __init__(
        self,
        ttl: float,
        max_instances: int,
        load_refresh: float = LOAD_REFRESH_SECONDS,
        max_unsigned: int | None = None,
    ) -> None:
        """`max_unsigned`: the separate cap of instances registered unsigned (with a secret);
        None: no separate cap, every instance counts against `max_instances`."""
        if ttl <= 0:
            raise ValueError("ttl must be positive")
        if max_instances < 1:
            raise ValueError("max_instances must be at least 1")
        if max_unsigned is not None and max_unsigned < 1:
            raise ValueError("max_unsigned must be at least 1")
        self._ttl = ttl
        self._max = max_instances
        self._max_unsigned = max_unsigned
        self._unsigned = 0  # entries counted against max_unsigned
        self._load_refresh = load_refresh
        self._entries: dict[Address, Registration] = {}
        self._static: set[Address] = set()
        # Kubernetes discovery: each discovered pod as discovery sees it, the last announcement
        # for it (what enriches it), and pods deleted lately (address -> until when refused).
        self._pods: dict[Address, Instance] = {}
        self._announced: dict[Address, Instance] = {}
        self._gone: dict[Address, float] = {}
        # zmq address -> http addresses announcing it: a connector knows its peer only by the
        # KV address in the request-id tag, and its statistics name the peer that way.
        self._by_zmq: dict[Address, set[Address]] = {}
        self._counts = dict.fromkeys(Role, 0)
        self._version = 0
        self._revision = 0
        self._snapshot: Snapshot | None = Snapshot(0, (), ())
        self._built_at: float | None = None
        self._load_stale = False

    @property
    def ttl(self) -> float:
        return self._ttl

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def version(self) -> int:
        """Moves when membership, roles, addresses, models, connectors or geometry change (the
        snapshot's version; load-only changes move it only when a snapshot is taken)."""
        return self._version

    @property
    def revision(self) -> int:
        """Moves on every change of content, load included (not on mere heartbeats): what a
        copy of this table elsewhere must follow."""
        return self._revision

    def adopt(self, entries: Iterable[Registration]) -> bool:
        """Become a copy of another table (its `registrations()`): an HTTP worker's view of the
        registry process's table. True when the instances changed, not only their times."""
        fresh = {entry.instance.http_address: entry for entry in entries}
        changed = fresh.keys() != self._entries.keys() or any(
            entry.instance != self._entries[key].instance for key, entry in fresh.items()
        )
        self._entries, self._by_zmq = {}, {}
        self._counts = dict.fromkeys(Role, 0)
        self._unsigned = 0
        self._static = {k for k, e in fresh.items() if e.instance.source is Source.STATIC}
        self._pods = {
            k: e.instance for k, e in fresh.items() if e.instance.source is Source.DISCOVERED
        }
        for entry in fresh.values():
            self._put(entry)
        if changed:
            self._changed()
        return changed

    def count(self, role: Role) -> int:
        return self._counts[role]

    def add_static(self, instance: Instance, now: float) -> None:
        if instance.source is not Source.STATIC:
            instance = replace(instance, source=Source.STATIC)
        new = Registration(instance, now, now)
        self._make_room(new, self._entries.get(instance.http_address))
        self._static.add(instance.http_address)
        self._put(new)
        self._changed()

    def announce(
        self, announcement: Announcement, now: float, *, signed: bool = False
    ) -> tuple[Change, Instance]:
        """Register or refresh an instance; `signed`: the announcement's signature was
        verified. Raises Rejected when the table (or the unsigned instances' part) is full,
        and when an unsigned announcement would change a signed instance."""
        key = announcement.http_address
        incoming = instance_from(announcement)
        v1_seen = now if announcement.version == 1 else None
        entry = self._entries.get(key)
        if entry is None:
            self._refuse_deleted_pod(key, now)
            new = Registration(incoming, now, now, v1_seen, signed)
            self._make_room(new, None)
            self._put(new)
            self._changed()
            return Change.REGISTERED, incoming
        if key in self._static:
            incoming = self._merge_static(entry.instance, incoming)
        elif key in self._pods:
            incoming = self._enrich_pod(entry, incoming, now, signed)
        elif entry.signed and not signed:
            self._refuse_unsigned_change(entry.instance, incoming)
            return Change.REFRESHED, entry.instance  # an echo: not even last_seen moves
        elif self._v0_echo(entry, incoming, now):
            # Stock vLLM's v0 ping for an instance its sidecar announces in v1: a heartbeat.
            # Taking it as the whole truth would drop model, geometry and load every 3 s.
            incoming = entry.instance
        if v1_seen is None:
            v1_seen = entry.v1_seen
        signed = signed or entry.signed
        if incoming == entry.instance and signed == entry.signed:
            self._entries[key] = replace(entry, last_seen=now, v1_seen=v1_seen)
            return Change.REFRESHED, entry.instance
        new = Registration(incoming, entry.first_seen, now, v1_seen, signed)
        self._make_room(new, entry)
        self._put(new)
        if replace(incoming, load=entry.instance.load) == entry.instance:
            self._load_stale = True
            return Change.LOAD, incoming
        self._changed()
        return Change.UPDATED, incoming

    def discovered(self, pod: Instance, now: float) -> Change:
        """Kubernetes discovery saw a pod (added, or changed: readiness, the drain
        annotation, ports): it becomes or stays a discovered instance, enriched by what was
        announced for it. Static instances stay the operator's; Rejected when the table is
        full."""
        key = pod.http_address
        if key in self._static:
            return Change.REFRESHED
        pod = replace(pod, source=Source.DISCOVERED)
        self._gone.pop(key, None)
        entry = self._entries.get(key)
        if (
            entry is not None
            and key not in self._pods
            and entry.instance.source is not Source.DISCOVERED
        ):
            self._announced[key] = entry.instance  # announced before discovery saw the pod
        merged = _enriched(pod, self._announced.get(key))
        if entry is None:
            new = Registration(merged, now, now)
        elif entry.instance == merged and key in self._pods:
            self._pods[key] = pod
            return Change.REFRESHED
        else:
            new = Registration(merged, entry.first_seen, now, entry.v1_seen, entry.signed)
        self._make_room(new, entry)
        self._pods[key] = pod
        self._put(new)
        self._changed()
        return Change.REGISTERED if entry is None else Change.UPDATED

    def undiscovered(self, http_address: Address, now: float) -> Instance | None:
        """Kubernetes discovery saw the pod deleted: out of the table at once, and refused to
        announcements for one TTL (a late one must not bring a dead pod back)."""
        if self._pods.pop(http_address, None) is None:
            return None
        self._announced.pop(http_address, None)
        self._gone[http_address] = now + self._ttl
        while len(self._gone) > self._max:  # bounded: the oldest tombstone goes first
            del self._gone[next(iter(self._gone))]
        entry = self._pop(http_address)
        if entry is None:
            return None
        self._changed()
        return entry.instance

    def _refuse_deleted_pod(self, key: Address, now: float) -> None:
        until = self._gone.get(key)
        if until is None:
            return
        if now > until:
            del self._gone[key]
            return
        raise Rejected(
            Reason.DISCOVERY_CONFLICT,
            f"{key} is a pod Kubernetes deleted moments ago: its announcements are ignored",
        )

    def _enrich_pod(
        self, entry: Registration, incoming: Instance, now: float, signed: bool
    ) -> Instance:
        """What an announcement adds to a discovered instance: it may not move it, and an
        unsigned one changes nothing of an instance signed messages announced."""
        key = incoming.http_address
        pod = self._pods[key]
        if (incoming.role, incoming.zmq_address) != (pod.role, pod.zmq_address):
            raise Rejected(
                Reason.DISCOVERY_CONFLICT,
                f"{pod.name} is a {pod.role.value} pod with zmq {pod.zmq_address} in Kubernetes "
                "discovery: an announcement cannot change that",
            )
        if entry.signed and not signed:
            return entry.instance
        known = self._announced.get(key)
        fresh_v1 = entry.v1_seen is not None and now - entry.v1_seen <= self._ttl
        # Stock vLLM's v0 ping beside a v1 announcer must not erase what the v1 one said.
        if not (
            incoming.source is Source.V0
            and known is not None
            and known.source is Source.V1
            and fresh_v1
        ):
            self._announced[key] = incoming
        return _enriched(pod, self._announced.get(key))

    def _v0_echo(self, entry: Registration, incoming: Instance, now: float) -> bool:
        """A v0 ping agreeing with a v1 announcement that is itself still alive (a sidecar
        that died without `leave` must not keep its last load and health forever)."""
        known = entry.instance
        return (
            known.source is Source.V1
            and incoming.source is Source.V0
            and entry.v1_seen is not None
            and now - entry.v1_seen <= self._ttl
            and (incoming.role, incoming.zmq_address) == (known.role, known.zmq_address)
        )

    @staticmethod
    def _refuse_unsigned_change(signed: Instance, incoming: Instance) -> None:
        """Unless `incoming` (unsigned) only echoes the signed instance's role and KV address."""
        if (incoming.role, incoming.zmq_address) != (signed.role, signed.zmq_address):
            raise Rejected(
                Reason.SIGNED_INSTANCE,
                f"{signed.name} was registered by signed messages (as {signed.role.value} with "
                f"zmq {signed.zmq_address}): an unsigned one cannot change it",
            )

    def _counts_as_unsigned(self, entry: Registration) -> bool:
        """Whether `entry` counts against max_unsigned rather than max_instances."""
        return (
            self._max_unsigned is not None
            and not entry.signed
            and entry.instance.source not in (Source.STATIC, Source.DISCOVERED)
        )

    def _make_room(self, new: Registration, old: Registration | None) -> None:
        """Raise Rejected unless `new` fits in its part of the table (replacing `old`)."""
        unsigned = self._counts_as_unsigned(new)
        if old is not None and self._counts_as_unsigned(old) == unsigned:
            return  # takes its predecessor's place
        if unsigned:
            assert self._max_unsigned is not None
            if self._unsigned >= self._max_unsigned:
                raise Rejected(
                    Reason.UNSIGNED_CAPACITY,
                    f"unsigned instances are at their cap ({self._max_unsigned})",
                )
        elif len(self._entries) - self._unsigned >= self._max:
            raise Rejected(Reason.CAPACITY, f"registry is full ({self._max} instances)")

    @staticmethod
    def _merge_static(static: Instance, incoming: Instance) -> Instance:
        """Static instances are the operator's word: an announcement may add what the operator
        left out (model, connector, geometry, load) but may not move or rename them."""
        model_conflict = static.model is not None and incoming.model not in (None, static.model)
        if (incoming.role, incoming.zmq_address) != (static.role, static.zmq_address) or (
            model_conflict
        ):
            raise Rejected(
                Reason.STATIC_CONFLICT,
                f"{static.name} is configured statically as {static.role.value} with zmq "
                f"{static.zmq_address}" + (f" and model {static.model}" if static.model else ""),
            )
        return replace(
            incoming,
            source=Source.STATIC,
            model=static.model or incoming.model,
            max_model_len=static.max_model_len or incoming.max_model_len,
            connector=static.connector or incoming.connector,
            geometry=static.geometry or incoming.geometry,
        )

    def remove(
        self, http_address: Address, *, by_operator: bool = False, signed: bool = False
    ) -> Instance | None:
        """A v1 `leave` (static and discovered instances stay: only the operator removes them,
        and a discovered one comes back at its pod's next change; a signed instance only a
        signed leave removes), or the operator's own removal."""
        if http_address in self._static or http_address in self._pods:
            if not by_operator:
                return None
            self._static.discard(http_address)
            self._pods.pop(http_address, None)
            self._announced.pop(http_address, None)
        known = self._entries.get(http_address)
        if known is not None and known.signed and not (signed or by_operator):
            raise Rejected(
                Reason.SIGNED_INSTANCE,
                f"{known.instance.name} was registered by signed messages: an unsigned leave "
                "cannot remove it",
            )
        entry = self._pop(http_address)
        if entry is None:
            return None
        self._changed()
        return entry.instance

    def expire(self, now: float) -> list[Instance]:
        """Drop every instance silent for longer than the TTL but the static and discovered
        ones (discovery says when a pod goes), and forget tombstones past their time."""
        deadline = now - self._ttl
        dead = [
            key
            for key, entry in self._entries.items()
            if entry.last_seen < deadline and key not in self._static and key not in self._pods
        ]
        for key in [key for key, until in self._gone.items() if until < now]:
            del self._gone[key]
        expired = [entry.instance for key in dead if (entry := self._pop(key)) is not None]
        if expired:
            self._changed()
        return expired

    def get(self, http_address: Address) -> Instance | None:
        entry = self._entries.get(http_address)
        return None if entry is None else entry.instance

    def lookup(self, address: Address, role: Role) -> Instance | None:
        """The registered instance of `role` whose http address is `address`, else whose zmq
        address it is (the first found if several announce the same one)."""
        instance = self.get(address)
        if instance is not None and instance.role is role:
            return instance
        for key in self._by_zmq.get(address, ()):
            instance = self._entries[key].instance
            if instance.role is role:
                return instance
        return None

    def registrations(self) -> list[Registration]:
        return list(self._entries.values())

    def snapshot(self, now: float | None = None) -> Snapshot:
        """The fleet as an immutable value, built lazily.

        Without `now` it is exact. With `now` (the routing path), load-only changes may be
        reflected up to `load_refresh` seconds late: membership and geometry never lag.
        """
        if self._load_stale and (
            now is None or self._built_at is None or now - self._built_at >= self._load_refresh
        ):
            self._changed()
        if self._snapshot is None:
            instances = [e.instance for e in self._entries.values() if e.instance.routable]
            self._snapshot = Snapshot(
                version=self._version,
                prefills=tuple(i for i in instances if i.role is Role.PREFILL),
                decodes=tuple(i for i in instances if i.role is Role.DECODE),
            )
            self._built_at = now
        return self._snapshot

    def _put(self, entry: Registration) -> None:
        key = entry.instance.http_address
        old = self._entries.get(key)
        if old is not None:
            self._counts[old.instance.role] -= 1
            self._unsigned -= self._counts_as_unsigned(old)
            self._unindex(old)
        self._entries[key] = entry
        self._revision += 1
        self._counts[entry.instance.role] += 1
        self._unsigned += self._counts_as_unsigned(entry)
        self._by_zmq.setdefault(entry.instance.zmq_address, set()).add(key)

    def _pop(self, key: Address) -> Registration | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._revision += 1
            self._counts[entry.instance.role] -= 1
            self._unsigned -= self._counts_as_unsigned(entry)
            self._unindex(entry)
        return entry

    def _unindex(self, entry: Registration) -> None:
        zmq = entry.instance.zmq_address
        keys = self._by_zmq.get(zmq)
        if keys is not None:
            keys.discard(entry.instance.http_address)
            if not keys:
                del self._by_zmq[zmq]

    def _changed(self) -> None:
        self._version += 1
        self._snapshot = None
        self._load_stale = False


def _enriched(pod: Instance, announced: Instance | None) -> Instance:
    """A discovered instance: the pod's word where it has one (role, addresses, connector,
    geometry, readiness, drain), the announcement's for the rest (model, geometry when the pod
    has none, load, health, context length)."""
    if announced is None:
        return pod
    return replace(
        pod,
        model=announced.model,
        connector=pod.connector or announced.connector,
        geometry=pod.geometry or announced.geometry,
        load=announced.load,
        healthy=announced.healthy,
        max_model_len=announced.max_model_len,
    )
