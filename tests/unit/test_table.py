"""pdproxy.registry.table: membership, TTL, static instances, capacity. The clock is `now`."""

from __future__ import annotations

import dataclasses
import math

import pytest

from pdproxy.base.roles import Role
from pdproxy.ids import Address
from pdproxy.registry.messages import Announcement, Connector, Geometry, Load, Reason, Rejected
from pdproxy.registry.table import (
    Change,
    Instance,
    Registration,
    RegistryTable,
    Snapshot,
    Source,
    instance_from,
)

TTL = 10.0


def http(n: int) -> Address:
    return Address(f"10.0.0.{n}", 8100)


def zmq(n: int) -> Address:
    return Address(f"10.0.0.{n}", 21001)


def v1(
    n: int,
    role: Role = Role.PREFILL,
    *,
    model: str | None = "m",
    load: Load | None = None,
    zmq_address: Address | None = None,
) -> Announcement:
    return Announcement(
        version=1,
        role=role,
        http_address=http(n),
        zmq_address=zmq(n) if zmq_address is None else zmq_address,
        model=model,
        load=load,
    )


def v0(n: int, role: Role = Role.PREFILL) -> Announcement:
    return Announcement(0, role, http(n), zmq(n))


def static(n: int, role: Role = Role.PREFILL, model: str | None = None) -> Instance:
    return Instance(role, http(n), zmq(n), Source.STATIC, model=model)


def table(max_instances: int = 100) -> RegistryTable:
    return RegistryTable(ttl=TTL, max_instances=max_instances)


def entry(t: RegistryTable, address: Address) -> Registration:
    (found,) = [e for e in t.registrations() if e.instance.http_address == address]
    return found


# ---------------------------------------------------------------------------------------------
# construction


def test_empty_table() -> None:
    t = table()
    assert len(t) == 0
    assert t.ttl == TTL
    assert t.registrations() == []
    assert t.snapshot() == Snapshot(0, (), ())
    assert t.snapshot() is t.snapshot()


@pytest.mark.parametrize("ttl", [0.0, -1.0])
def test_ttl_must_be_positive(ttl: float) -> None:
    with pytest.raises(ValueError, match="ttl"):
        RegistryTable(ttl=ttl, max_instances=1)


@pytest.mark.parametrize("max_instances", [0, -1])
def test_max_instances_at_least_one(max_instances: int) -> None:
    with pytest.raises(ValueError, match="max_instances"):
        RegistryTable(ttl=1.0, max_instances=max_instances)


# ---------------------------------------------------------------------------------------------
# instances from announcements


def test_instance_from_v1() -> None:
    geometry = Geometry(tp_size=2)
    load = Load(running=1, waiting=2, kv_usage=0.5)
    announcement = Announcement(
        1, Role.DECODE, http(2), zmq(2), "m", Connector.NIXL, geometry, load
    )
    assert instance_from(announcement) == Instance(
        Role.DECODE, http(2), zmq(2), Source.V1, "m", Connector.NIXL, geometry, load
    )


def test_instance_from_v0() -> None:
    assert instance_from(v0(1)) == Instance(Role.PREFILL, http(1), zmq(1), Source.V0)


def test_instance_name() -> None:
    instance = Instance(Role.PREFILL, Address("p-0.svc", 8100), zmq(1), Source.V1)
    assert instance.name == "p-0.svc:8100"


def test_serves() -> None:
    assert Instance(Role.PREFILL, http(1), zmq(1), Source.V1, model="a").serves("a")
    assert not Instance(Role.PREFILL, http(1), zmq(1), Source.V1, model="a").serves("b")
    assert Instance(Role.PREFILL, http(1), zmq(1), Source.V0).serves("anything")


# ---------------------------------------------------------------------------------------------
# register, refresh, update


def test_register() -> None:
    t = table()
    change, instance = t.announce(v1(1), now=100.0)
    assert change is Change.REGISTERED
    assert instance == Instance(Role.PREFILL, http(1), zmq(1), Source.V1, model="m")
    assert len(t) == 1
    assert t.registrations() == [
        Registration(instance, first_seen=100.0, last_seen=100.0, v1_seen=100.0)
    ]
    snapshot = t.snapshot()
    assert snapshot == Snapshot(1, (instance,), ())


def test_refresh_only_moves_last_seen_and_keeps_the_snapshot_object() -> None:
    t = table()
    _, registered = t.announce(v1(1), now=100.0)
    before = t.snapshot()
    change, instance = t.announce(v1(1), now=103.0)
    assert change is Change.REFRESHED
    assert instance is registered
    assert t.registrations() == [
        Registration(registered, first_seen=100.0, last_seen=103.0, v1_seen=103.0)
    ]
    assert t.snapshot() is before
    assert t.snapshot().version == 1


def test_refresh_of_v0() -> None:
    t = table()
    t.announce(v0(1), now=1.0)
    before = t.snapshot()
    assert t.announce(v0(1), now=2.0)[0] is Change.REFRESHED
    assert t.snapshot() is before


@pytest.mark.parametrize(
    "changed",
    [
        v1(1, load=Load(running=5)),
        v1(1, model="other"),
        v1(1, model=None),
        v1(1, role=Role.DECODE),
        v1(1, zmq_address=Address("10.0.0.1", 21002)),
    ],
    ids=["load", "model", "no model", "role", "zmq address"],
)
def test_update_yields_a_new_snapshot_version(changed: Announcement) -> None:
    t = table()
    t.announce(v1(1), now=100.0)
    before = t.snapshot()
    change, instance = t.announce(changed, now=104.0)
    only_load = changed.load is not None and changed.model == "m" and changed.version == 1
    assert change is (Change.LOAD if only_load else Change.UPDATED)
    assert instance == instance_from(changed)
    assert t.registrations() == [
        Registration(instance, first_seen=100.0, last_seen=104.0, v1_seen=104.0)
    ]
    after = t.snapshot()
    assert after is not before
    assert after.version == before.version + 1
    assert (*after.prefills, *after.decodes) == (instance,)


def test_role_change_moves_instance_between_lists() -> None:
    t = table()
    t.announce(v1(1), now=0.0)
    assert len(t.snapshot().prefills) == 1
    t.announce(v1(1, role=Role.DECODE), now=1.0)
    assert t.snapshot().prefills == ()
    assert [i.http_address for i in t.snapshot().decodes] == [http(1)]


def test_load_only_update_then_same_load_refreshes() -> None:
    t = table()
    t.announce(v1(1, load=Load(running=1)), now=0.0)
    assert t.announce(v1(1, load=Load(running=2)), now=1.0)[0] is Change.LOAD
    version = t.snapshot().version
    assert t.announce(v1(1, load=Load(running=2)), now=2.0)[0] is Change.REFRESHED
    assert t.snapshot().version == version


def test_snapshot_is_built_lazily_once_per_burst() -> None:
    t = table()
    t.announce(v1(1), now=0.0)
    for i in range(5):
        t.announce(v1(1, load=Load(running=i + 10)), now=float(i))
    snapshot = t.snapshot()
    assert snapshot.version == 2  # one build for the registration, one for the whole burst
    assert snapshot.prefills[0].load == Load(running=14)
    assert t.snapshot() is snapshot


def test_versions_increase_strictly() -> None:
    t = table()
    versions = [t.snapshot().version]
    t.announce(v1(1), 0.0)
    versions.append(t.snapshot().version)
    t.announce(v1(2), 0.0)
    versions.append(t.snapshot().version)
    t.announce(v1(2, model="x"), 0.0)
    versions.append(t.snapshot().version)
    t.remove(http(1))
    versions.append(t.snapshot().version)
    t.expire(100.0)
    versions.append(t.snapshot().version)
    assert versions == [0, 1, 2, 3, 4, 5]


def test_role_split_keeps_registration_order() -> None:
    t = table()
    t.announce(v1(1, Role.PREFILL), 0.0)
    t.announce(v1(2, Role.DECODE), 0.0)
    t.announce(v0(3, Role.PREFILL), 0.0)
    t.announce(v0(4, Role.DECODE), 0.0)
    t.announce(v1(5, Role.DECODE), 0.0)
    snapshot = t.snapshot()
    assert [i.http_address for i in snapshot.prefills] == [http(1), http(3)]
    assert [i.http_address for i in snapshot.decodes] == [http(2), http(4), http(5)]
    assert all(i.role is Role.PREFILL for i in snapshot.prefills)
    assert all(i.role is Role.DECODE for i in snapshot.decodes)
    assert [i.source for i in snapshot.prefills] == [Source.V1, Source.V0]


def test_instances_are_keyed_by_http_address() -> None:
    t = table()
    t.announce(v1(1, zmq_address=Address("10.9.9.9", 1)), 0.0)
    t.announce(Announcement(1, Role.PREFILL, Address("10.0.0.1", 8101), zmq(1)), 0.0)
    assert len(t) == 2


# ---------------------------------------------------------------------------------------------
# expiry


def test_expires_only_after_ttl() -> None:
    t = table()
    t.announce(v1(1), now=100.0)
    before = t.snapshot()
    assert t.expire(100.0 + TTL - 1e-6) == []
    assert t.expire(math.nextafter(100.0 + TTL, 0.0)) == []
    assert t.expire(100.0 + TTL) == []  # silent for exactly the TTL: still within it
    assert t.snapshot() is before
    assert len(t) == 1
    expired = t.expire(math.nextafter(100.0 + TTL, math.inf))
    assert [i.http_address for i in expired] == [http(1)]
    assert len(t) == 0
    assert t.snapshot() == Snapshot(before.version + 1, (), ())


def test_expiry_counts_from_last_seen_not_first_seen() -> None:
    t = table()
    t.announce(v1(1), now=0.0)
    t.announce(v1(1), now=8.0)  # refresh
    t.announce(v1(1, load=Load(running=1)), now=16.0)  # update
    assert t.expire(16.0 + TTL) == []
    assert len(t.expire(16.0 + TTL + 0.001)) == 1


def test_expire_drops_only_the_silent() -> None:
    t = table()
    t.announce(v1(1), now=0.0)
    t.announce(v1(2, Role.DECODE), now=5.0)
    t.announce(v1(3), now=9.0)
    expired = t.expire(now=15.5)
    assert [i.http_address for i in expired] == [http(1), http(2)]
    assert [e.instance.http_address for e in t.registrations()] == [http(3)]
    assert t.snapshot().decodes == ()


def test_expired_instance_registers_again() -> None:
    t = table()
    t.announce(v1(1), now=0.0)
    t.expire(now=100.0)
    change, _ = t.announce(v1(1), now=100.0)
    assert change is Change.REGISTERED
    assert t.registrations()[0].first_seen == 100.0


# ---------------------------------------------------------------------------------------------
# leave


def test_leave_removes_at_once() -> None:
    t = table()
    _, instance = t.announce(v1(1), now=0.0)
    t.announce(v1(2, Role.DECODE), now=0.0)
    before = t.snapshot()
    assert t.remove(http(1)) == instance
    assert len(t) == 1
    after = t.snapshot()
    assert after.version == before.version + 1
    assert after.prefills == ()
    assert len(after.decodes) == 1


def test_remove_unknown_changes_nothing() -> None:
    t = table()
    t.announce(v1(1), now=0.0)
    before = t.snapshot()
    assert t.remove(http(9)) is None
    assert t.snapshot() is before


# ---------------------------------------------------------------------------------------------
# static instances


def test_static_never_expires_and_is_not_removed() -> None:
    t = table()
    t.add_static(static(1), now=0.0)
    before = t.snapshot()
    assert t.expire(now=1e12) == []
    assert t.remove(http(1)) is None
    assert len(t) == 1
    assert t.snapshot() is before
    assert before.prefills == (static(1),)


def test_add_static_forces_static_source() -> None:
    t = table()
    t.add_static(Instance(Role.DECODE, http(1), zmq(1), Source.V1, model="m"), now=0.0)
    assert t.snapshot().decodes == (static(1, Role.DECODE, model="m"),)
    assert t.snapshot().decodes[0].source is Source.STATIC


def test_add_static_over_a_dynamic_instance() -> None:
    t = table()
    t.announce(v1(1), now=0.0)
    t.add_static(static(1), now=1.0)
    assert len(t) == 1
    assert t.expire(now=1e9) == []
    assert t.snapshot().prefills == (static(1),)


def test_a_v0_ping_for_a_v1_instance_is_a_heartbeat() -> None:
    # Stock vLLM pings v0 every 3 s while its sidecar announces v1 for the same server: the ping
    # must not erase the model, geometry and load the sidecar announced.
    t = table()
    _, announced = t.announce(v1(1, load=Load(running=2)), now=100.0)
    before = t.snapshot()
    change, instance = t.announce(v0(1), now=103.0)
    assert change is Change.REFRESHED
    assert instance == announced and instance.source is Source.V1 and instance.model == "m"
    # last_seen moves, v1_seen does not: the v1 announcement itself is 3 s old.
    assert t.registrations() == [
        Registration(announced, first_seen=100.0, last_seen=103.0, v1_seen=100.0)
    ]
    assert t.snapshot() is before


def test_v0_pings_stop_echoing_once_the_v1_announcer_is_silent_for_a_ttl() -> None:
    # A sidecar that died without `leave` must not keep its last load and health forever:
    # once its v1 is older than the TTL, vLLM's own v0 ping is taken as the whole truth.
    t = table()
    t.announce(v1(1, load=Load(running=2)), now=100.0)
    assert t.announce(v0(1), now=100.0 + TTL)[0] is Change.REFRESHED
    change, instance = t.announce(v0(1), now=100.0 + TTL + 0.5)
    assert change is Change.UPDATED
    assert instance == instance_from(v0(1)) and instance.load is None
    assert t.registrations()[0].v1_seen == 100.0  # remembered, no longer echoed


@pytest.mark.parametrize(
    "moved",
    [v0(1, Role.DECODE), Announcement(0, Role.PREFILL, http(1), Address("10.0.0.1", 21002))],
    ids=["other role", "other zmq address"],
)
def test_a_v0_ping_that_disagrees_with_v1_replaces_it(moved: Announcement) -> None:
    t = table()
    t.announce(v1(1), now=100.0)
    change, instance = t.announce(moved, now=101.0)
    assert change is Change.UPDATED
    assert instance == instance_from(moved) and instance.source is Source.V0


def test_v1_after_v0_takes_over() -> None:
    t = table()
    t.announce(v0(1), now=100.0)
    change, instance = t.announce(v1(1), now=101.0)
    assert change is Change.UPDATED and instance.source is Source.V1


@pytest.mark.parametrize(
    "conflicting",
    [
        v1(1, Role.DECODE, model=None),
        v0(1, Role.DECODE),
        v1(1, model=None, zmq_address=Address("10.0.0.1", 21009)),
        v1(1, model=None, zmq_address=Address("10.0.0.99", 21001)),
    ],
    ids=["v1 other role", "v0 other role", "other zmq port", "other zmq host"],
)
def test_static_rejects_a_conflicting_announcement(conflicting: Announcement) -> None:
    t = table()
    t.add_static(static(1), now=0.0)
    before = t.snapshot()
    with pytest.raises(Rejected) as info:
        t.announce(conflicting, now=1.0)
    assert info.value.reason is Reason.STATIC_CONFLICT
    assert t.snapshot() is before
    assert t.registrations() == [Registration(static(1), 0.0, 0.0)]


def test_static_accepts_a_matching_v0_announcement() -> None:
    t = table()
    t.add_static(static(1), now=0.0)
    before = t.snapshot()
    change, instance = t.announce(v0(1), now=5.0)
    assert change is Change.REFRESHED
    assert instance == static(1)
    assert t.registrations() == [Registration(static(1), 0.0, 5.0)]
    assert t.snapshot() is before


def test_static_accepts_a_matching_v1_announcement_and_stays_static() -> None:
    t = table()
    t.add_static(static(1, model="m"), now=0.0)
    change, instance = t.announce(v1(1, model="m", load=Load(kv_usage=0.5)), now=5.0)
    assert change is Change.LOAD
    assert instance.source is Source.STATIC
    assert instance.load == Load(kv_usage=0.5)
    assert t.expire(now=1e9) == []
    assert t.remove(http(1)) is None
    assert t.snapshot().prefills == (instance,)


def test_static_model_cannot_be_renamed_by_an_announcement() -> None:
    t = table()
    t.add_static(static(1, model="m"), now=0.0)
    with pytest.raises(Rejected) as info:
        t.announce(v1(1, model="other"), now=1.0)
    assert info.value.reason is Reason.STATIC_CONFLICT
    assert "model m" in info.value.detail
    assert t.snapshot().prefills == (static(1, model="m"),)


def test_static_without_model_learns_the_announced_one() -> None:
    t = table()
    t.add_static(static(1), now=0.0)
    _, instance = t.announce(v1(1, model="learned"), now=1.0)
    assert instance == static(1, model="learned")
    # A later announcement without a model keeps what the instance is.
    _, instance = t.announce(v0(1), now=2.0)
    assert instance.source is Source.STATIC


# ---------------------------------------------------------------------------------------------
# capacity


def test_capacity_rejects_new_but_refreshes_and_updates_existing() -> None:
    t = table(max_instances=2)
    t.announce(v1(1), now=0.0)
    t.announce(v1(2), now=0.0)
    before = t.snapshot()
    with pytest.raises(Rejected) as info:
        t.announce(v1(3), now=1.0)
    assert info.value.reason is Reason.CAPACITY
    assert len(t) == 2
    assert t.snapshot() is before
    assert t.announce(v1(1), now=2.0)[0] is Change.REFRESHED
    assert t.announce(v1(2, load=Load(running=1)), now=2.0)[0] is Change.LOAD
    assert entry(t, http(1)).last_seen == 2.0


def test_capacity_frees_after_leave_and_expiry() -> None:
    t = table(max_instances=1)
    t.announce(v1(1), now=0.0)
    t.remove(http(1))
    t.announce(v1(2), now=0.0)
    t.expire(now=100.0)
    assert t.announce(v1(3), now=100.0)[0] is Change.REGISTERED


def test_capacity_applies_to_static() -> None:
    t = table(max_instances=1)
    t.add_static(static(1), now=0.0)
    with pytest.raises(Rejected) as info:
        t.add_static(static(2), now=0.0)
    assert info.value.reason is Reason.CAPACITY
    t.add_static(static(1, model="m"), now=0.0)  # replacing an existing one fits
    assert t.snapshot().prefills == (static(1, model="m"),)
    with pytest.raises(Rejected) as info:
        t.announce(v1(2), now=0.0)
    assert info.value.reason is Reason.CAPACITY


# ---------------------------------------------------------------------------------------------
# signed instances (with a registry secret)


def guarded(max_instances: int = 100, max_unsigned: int = 25) -> RegistryTable:
    return RegistryTable(ttl=TTL, max_instances=max_instances, max_unsigned=max_unsigned)


@pytest.mark.parametrize(
    "moved",
    [v0(1, Role.DECODE), Announcement(0, Role.PREFILL, http(1), Address("10.0.0.66", 21002))],
    ids=["other role", "other zmq address"],
)
def test_an_unsigned_ping_cannot_change_a_signed_instance(moved: Announcement) -> None:
    t = guarded()
    _, announced = t.announce(v1(1, load=Load(running=2)), now=100.0, signed=True)
    before, revision = t.snapshot(), t.revision
    with pytest.raises(Rejected) as info:
        t.announce(moved, now=101.0)
    assert info.value.reason is Reason.SIGNED_INSTANCE
    assert "10.0.0.1:8100" in info.value.detail and "signed" in info.value.detail
    assert t.registrations() == [Registration(announced, 100.0, 100.0, 100.0, signed=True)]
    assert t.snapshot() is before and t.revision == revision


def test_an_unsigned_ping_that_echoes_a_signed_instance_changes_nothing() -> None:
    """Stock vLLM beside its signing sidecar: accepted, but it neither rewrites the instance
    nor keeps it alive once the signed announcements stop."""
    t = guarded()
    _, announced = t.announce(v1(1), now=100.0, signed=True)
    change, instance = t.announce(v0(1), now=100.0 + TTL + 0.5)
    assert change is Change.REFRESHED and instance == announced
    assert entry(t, http(1)).last_seen == 100.0
    assert t.expire(now=100.0 + TTL + 1.0) == [announced]


def test_only_a_signed_leave_or_the_operator_removes_a_signed_instance() -> None:
    t = guarded()
    _, announced = t.announce(v1(1), now=0.0, signed=True)
    t.announce(v1(2), now=0.0, signed=True)
    with pytest.raises(Rejected) as info:
        t.remove(http(1))
    assert info.value.reason is Reason.SIGNED_INSTANCE
    assert t.get(http(1)) == announced
    assert t.remove(http(1), signed=True) == announced
    assert t.remove(http(2), by_operator=True) is not None
    assert len(t) == 0


def test_a_signed_announcement_takes_over_an_unsigned_instance() -> None:
    t = guarded(max_unsigned=1)
    t.announce(v0(1), now=0.0)
    change, instance = t.announce(v1(1), now=1.0, signed=True)
    assert change is Change.UPDATED and instance.source is Source.V1
    assert entry(t, http(1)).signed
    # Its unsigned place is free again, and it is now the signer's.
    assert t.announce(v0(2), now=1.0)[0] is Change.REGISTERED
    with pytest.raises(Rejected) as info:
        t.announce(v0(1, Role.DECODE), now=2.0)
    assert info.value.reason is Reason.SIGNED_INSTANCE


def test_unsigned_instances_have_a_cap_of_their_own() -> None:
    t = guarded(max_instances=3, max_unsigned=2)
    for n in (1, 2):
        t.announce(v0(n), now=0.0)
    with pytest.raises(Rejected) as info:
        t.announce(v0(3), now=0.0)
    assert info.value.reason is Reason.UNSIGNED_CAPACITY
    assert "(2)" in info.value.detail
    assert t.announce(v0(1), now=1.0)[0] is Change.REFRESHED  # those in are still heard
    # The unsigned ones take none of the signed instances' room...
    for n in (10, 11, 12):
        assert t.announce(v1(n), now=1.0, signed=True)[0] is Change.REGISTERED
    with pytest.raises(Rejected) as info:
        t.announce(v1(13), now=1.0, signed=True)
    assert info.value.reason is Reason.CAPACITY
    assert len(t) == 5
    # ... and a leaving unsigned instance frees a place for another.
    t.remove(http(2))
    assert t.announce(v0(3), now=2.0)[0] is Change.REGISTERED


def test_a_static_instance_counts_against_max_instances_not_the_unsigned_cap() -> None:
    t = guarded(max_instances=1, max_unsigned=1)
    t.announce(v0(1), now=0.0)
    t.add_static(static(1), now=0.0)  # the operator's word over an unsigned instance
    assert t.announce(v0(2), now=0.0)[0] is Change.REGISTERED
    with pytest.raises(Rejected) as info:
        t.add_static(static(3), now=0.0)
    assert info.value.reason is Reason.CAPACITY


def test_without_a_separate_cap_unsigned_instances_share_max_instances() -> None:
    t = table(max_instances=2)  # no secret: nothing is signed, one cap for all
    t.announce(v0(1), now=0.0)
    t.announce(v0(2), now=0.0)
    with pytest.raises(Rejected) as info:
        t.announce(v1(3), now=0.0)
    assert info.value.reason is Reason.CAPACITY


def test_a_copy_keeps_which_instances_are_signed() -> None:
    t = guarded()
    t.announce(v1(1), now=0.0, signed=True)
    t.announce(v0(2), now=0.0)
    copy = table()
    copy.adopt(t.registrations())
    assert [e.signed for e in copy.registrations()] == [True, False]


# ---------------------------------------------------------------------------------------------
# load reports and counts


def test_load_only_change_is_its_own_kind_and_lags_the_routing_snapshot() -> None:
    t = RegistryTable(ttl=TTL, max_instances=10, load_refresh=0.5)
    t.announce(v1(1, load=Load(running=1)), now=0.0)
    routed = t.snapshot(now=0.0)
    change, instance = t.announce(v1(1, load=Load(running=7)), now=0.1)
    assert change is Change.LOAD and instance.load == Load(running=7)
    # Within load_refresh the routing snapshot is the same object: no rebuild per report.
    assert t.snapshot(now=0.2) is routed
    later = t.snapshot(now=0.6)
    assert later is not routed and later.version > routed.version
    assert later.prefills[0].load == Load(running=7)
    # The exact view never lags.
    t.announce(v1(1, load=Load(running=9)), now=0.7)
    assert t.snapshot().prefills[0].load == Load(running=9)


def test_a_model_change_is_not_a_load_change() -> None:
    t = table()
    t.announce(v1(1, model="a"), now=0.0)
    routed = t.snapshot(now=0.0)
    change, _ = t.announce(v1(1, model="b"), now=0.1)
    assert change is Change.UPDATED
    assert t.snapshot(now=0.1) is not routed  # membership-relevant changes never lag


def test_counts_follow_every_path() -> None:
    t = table()
    t.announce(v1(1), now=0.0)
    t.announce(v1(2, Role.DECODE), now=0.0)
    t.add_static(static(3, Role.DECODE), now=0.0)
    assert (t.count(Role.PREFILL), t.count(Role.DECODE)) == (1, 2)
    t.announce(v1(1, Role.DECODE), now=1.0)  # the instance changed role
    assert (t.count(Role.PREFILL), t.count(Role.DECODE)) == (0, 3)
    t.remove(http(2))
    assert t.count(Role.DECODE) == 2
    t.expire(now=TTL + 5)
    assert (t.count(Role.PREFILL), t.count(Role.DECODE)) == (0, 1)  # the static one stays


# -- finding an instance by either of its addresses (KV transfer peers) ----------------------


def test_lookup_by_http_then_by_zmq_address_in_a_role() -> None:
    table = RegistryTable(TTL, 10)
    table.announce(v1(1), 0.0)
    table.announce(v1(2, Role.DECODE), 0.0)
    assert table.get(http(1)) is not None and table.get(http(9)) is None
    assert table.lookup(http(1), Role.PREFILL) == table.get(http(1))
    assert table.lookup(zmq(1), Role.PREFILL) == table.get(http(1))
    assert table.lookup(zmq(2), Role.DECODE) == table.get(http(2))
    assert table.lookup(zmq(1), Role.DECODE) is None  # a prefill is not a decode
    assert table.lookup(Address("10.0.0.1", 9), Role.PREFILL) is None


def test_the_zmq_index_follows_moves_leaves_and_expiry() -> None:
    table = RegistryTable(TTL, 10)
    table.announce(v1(1), 0.0)
    table.announce(v1(1, zmq_address=zmq(7)), 1.0)  # moved its KV port
    assert table.lookup(zmq(1), Role.PREFILL) is None
    assert table.lookup(zmq(7), Role.PREFILL) == table.get(http(1))
    table.remove(http(1))
    assert table.lookup(zmq(7), Role.PREFILL) is None
    table.announce(v1(3), 2.0)
    table.expire(2.0 + TTL + 1)
    assert table.lookup(zmq(3), Role.PREFILL) is None


def test_two_instances_announcing_one_zmq_address_are_both_found_by_role() -> None:
    table = RegistryTable(TTL, 10)
    table.announce(v1(1, zmq_address=zmq(5)), 0.0)
    table.announce(v1(2, Role.DECODE, zmq_address=zmq(5)), 0.0)
    assert table.lookup(zmq(5), Role.PREFILL) == table.get(http(1))
    assert table.lookup(zmq(5), Role.DECODE) == table.get(http(2))
    table.remove(http(1))
    assert table.lookup(zmq(5), Role.DECODE) == table.get(http(2))


# ---------------------------------------------------------------------------------------------
# revision and copies (the HTTP workers' view of the registry process's table)


def test_revision_moves_on_content_and_load_not_on_heartbeats() -> None:
    t = table()
    revisions = [t.revision]
    t.announce(v1(1), 0.0)
    revisions.append(t.revision)
    t.announce(v1(1), 1.0)  # heartbeat
    revisions.append(t.revision)
    t.announce(v1(1, load=Load(running=3)), 2.0)
    revisions.append(t.revision)
    t.remove(http(1))
    revisions.append(t.revision)
    assert revisions[1] > revisions[0]
    assert revisions[2] == revisions[1]
    assert revisions[4] > revisions[3] > revisions[2]


def test_a_copy_adopts_entries_counts_lookups_and_statics() -> None:
    owner = table()
    owner.add_static(static(1, Role.DECODE), 0.0)
    owner.announce(v1(2), 1.0)
    owner.announce(v1(3, Role.DECODE, zmq_address=zmq(9)), 2.0)
    copy = table()
    assert copy.adopt(owner.registrations()) is True
    assert copy.registrations() == owner.registrations()
    mine, theirs = copy.snapshot(), owner.snapshot()
    assert (mine.prefills, mine.decodes) == (theirs.prefills, theirs.decodes)
    assert (copy.count(Role.PREFILL), copy.count(Role.DECODE)) == (1, 2)
    assert copy.lookup(zmq(9), Role.DECODE) == owner.get(http(3))
    # A static instance stays static in the copy: a `leave` cannot remove it.
    assert copy.remove(http(1)) is None


def test_adopting_only_newer_times_keeps_the_snapshot() -> None:
    owner = table()
    owner.announce(v1(1), 0.0)
    copy = table()
    copy.adopt(owner.registrations())
    snapshot = copy.snapshot()
    owner.announce(v1(1), 5.0)  # heartbeat: last_seen moves
    assert copy.adopt(owner.registrations()) is False
    assert copy.snapshot() is snapshot
    assert entry(copy, http(1)).last_seen == 5.0


def test_adopting_a_change_builds_a_new_snapshot() -> None:
    owner = table()
    owner.announce(v1(1), 0.0)
    owner.announce(v1(2, Role.DECODE), 0.0)
    copy = table()
    copy.adopt(owner.registrations())
    before = copy.snapshot()
    owner.announce(v1(1, load=Load(running=7)), 1.0)
    owner.remove(http(2))
    assert copy.adopt(owner.registrations()) is True
    after = copy.snapshot()
    assert after.version > before.version
    assert after.prefills[0].load == Load(running=7) and after.decodes == ()
    assert copy.count(Role.DECODE) == 0 and copy.get(http(2)) is None


# ---------------------------------------------------------------------------------------------
# max_model_len


def test_the_announced_max_model_len_is_the_instances_and_a_change_updates() -> None:
    t = table()
    announced = dataclasses.replace(v1(1), max_model_len=4096)
    assert instance_from(announced).max_model_len == 4096
    t.announce(announced, now=0.0)
    assert t.snapshot().prefills[0].max_model_len == 4096
    change, instance = t.announce(dataclasses.replace(announced, max_model_len=8192), now=1.0)
    assert change is Change.UPDATED and instance.max_model_len == 8192
    # A stock vLLM v0 ping beside the v1 announcer keeps what v1 said.
    assert t.announce(v0(1), now=2.0)[1].max_model_len == 8192


def test_a_static_max_model_len_is_the_operators_word() -> None:
    t = table()
    t.add_static(dataclasses.replace(static(1, model="m"), max_model_len=2048), now=0.0)
    announced = dataclasses.replace(v1(1), max_model_len=4096)
    assert t.announce(announced, now=1.0)[1].max_model_len == 2048
    t.add_static(static(2, model="m"), now=0.0)  # none configured: the announced one
    announced = dataclasses.replace(v1(2), max_model_len=4096)
    assert t.announce(announced, now=1.0)[1].max_model_len == 4096


def test_a_static_connector_and_geometry_are_the_operators_word() -> None:
    declared = Geometry(tp_size=2, block_size=16)
    t = table()
    t.add_static(
        dataclasses.replace(static(1, model="m"), connector=Connector.NIXL, geometry=declared),
        now=0.0,
    )
    announced = dataclasses.replace(
        v1(1), connector=Connector.PDPROXY, geometry=Geometry(tp_size=4, block_size=128)
    )
    instance = t.announce(announced, now=1.0)[1]
    assert (instance.connector, instance.geometry) == (Connector.NIXL, declared)
    t.add_static(static(2, model="m"), now=0.0)  # none declared: the announced ones
    instance = t.announce(
        dataclasses.replace(announced, http_address=http(2), zmq_address=zmq(2)), now=1.0
    )[1]
    assert (instance.connector, instance.geometry) == (Connector.PDPROXY, announced.geometry)
