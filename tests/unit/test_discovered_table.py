"""The registry table with Kubernetes discovery as a source (pdproxy.registry.table): discovery
says which pods exist and are ready, announcements enrich them. Pure: `now` is an argument."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from pdproxy.base.roles import Role
from pdproxy.ids import Address
from pdproxy.registry.messages import Announcement, Connector, Geometry, Load, Reason, Rejected
from pdproxy.registry.table import Change, Instance, RegistryTable, Source

TTL = 10.0
POD_GEOMETRY = Geometry(tp_size=2, block_size=16)
ANNOUNCED_GEOMETRY = Geometry(tp_size=1, block_size=32)


def http(n: int) -> Address:
    return Address(f"10.1.0.{n}", 8000)


def zmq(n: int) -> Address:
    return Address(f"10.1.0.{n}", 21001)


def pod(n: int, *, ready: bool = True, drained: bool = False, **fields: Any) -> Instance:
    return dataclasses.replace(
        Instance(Role.DECODE, http(n), zmq(n), Source.DISCOVERED, ready=ready, pod_drained=drained),
        **fields,
    )


def announced(n: int, version: int = 1, **fields: Any) -> Announcement:
    base = Announcement(version, Role.DECODE, http(n), zmq(n))
    if version == 1:
        base = dataclasses.replace(
            base,
            model="m",
            connector=Connector.NIXL,
            geometry=ANNOUNCED_GEOMETRY,
            load=Load(running=3, waiting=0, kv_usage=0.5),
        )
    return dataclasses.replace(base, **fields)


def routed(table: RegistryTable) -> set[Address]:
    return {i.http_address for i in table.snapshot().decodes}


def test_only_ready_undrained_pods_are_routed() -> None:
    table = RegistryTable(TTL, 10)
    table.discovered(pod(1), 0.0)
    table.discovered(pod(2, ready=False), 0.0)
    table.discovered(pod(3, drained=True), 0.0)
    assert len(table) == 3 and routed(table) == {http(1)}
    assert table.discovered(pod(2), 1.0) is Change.UPDATED
    assert routed(table) == {http(1), http(2)}


def test_announcements_enrich_a_pod_where_the_pod_is_silent() -> None:
    table = RegistryTable(TTL, 10)
    table.discovered(pod(1, connector=Connector.PDPROXY, geometry=POD_GEOMETRY), 0.0)
    change, instance = table.announce(announced(1), 1.0)
    assert change is Change.UPDATED
    assert instance.source is Source.DISCOVERED
    assert instance.model == "m" and instance.load == Load(3, 0, 0.5)
    # The pod's word stands where it has one.
    assert instance.connector is Connector.PDPROXY and instance.geometry == POD_GEOMETRY
    table.discovered(pod(2), 0.0)
    _, bare = table.announce(announced(2), 1.0)
    assert bare.connector is Connector.NIXL and bare.geometry == ANNOUNCED_GEOMETRY


def test_readiness_changes_keep_what_was_announced() -> None:
    table = RegistryTable(TTL, 10)
    table.discovered(pod(1), 0.0)
    table.announce(announced(1), 1.0)
    table.discovered(pod(1, ready=False), 2.0)
    instance = table.get(http(1))
    assert instance is not None and not instance.ready and instance.model == "m"
    assert routed(table) == set()


def test_an_announcement_before_the_pod_is_kept_when_the_pod_appears() -> None:
    table = RegistryTable(TTL, 10)
    table.announce(announced(1), 0.0)
    assert table.discovered(pod(1, ready=False), 1.0) is Change.UPDATED
    instance = table.get(http(1))
    assert instance is not None and instance.source is Source.DISCOVERED
    assert instance.model == "m" and not instance.ready
    assert routed(table) == set()  # the pod is not ready: announcing does not make it so


def test_a_v0_ping_does_not_erase_a_fresh_v1_announcement() -> None:
    table = RegistryTable(TTL, 10)
    table.discovered(pod(1), 0.0)
    table.announce(announced(1), 1.0)
    table.announce(announced(1, version=0), 2.0)
    instance = table.get(http(1))
    assert instance is not None and instance.model == "m"


@pytest.mark.parametrize(
    "moved",
    [{"zmq_address": zmq(9)}, {"role": Role.PREFILL}],
    ids=["kv-address", "role"],
)
def test_an_announcement_cannot_move_a_pod(moved: dict[str, Any]) -> None:
    table = RegistryTable(TTL, 10)
    table.discovered(pod(1), 0.0)
    with pytest.raises(Rejected) as info:
        table.announce(announced(1, **moved), 1.0)
    assert info.value.reason is Reason.DISCOVERY_CONFLICT


def test_pods_never_expire_and_ignore_leave() -> None:
    table = RegistryTable(TTL, 10)
    table.discovered(pod(1), 0.0)
    assert table.expire(10 * TTL) == []
    assert table.remove(http(1)) is None  # a worker's leave: the pod says when it goes
    assert routed(table) == {http(1)}


def test_a_deleted_pod_leaves_at_once_and_late_announcements_are_refused_for_a_ttl() -> None:
    table = RegistryTable(TTL, 10)
    table.discovered(pod(1), 0.0)
    table.announce(announced(1), 0.5)
    gone = table.undiscovered(http(1), 1.0)
    assert gone is not None and gone.http_address == http(1)
    assert len(table) == 0 and routed(table) == set()
    with pytest.raises(Rejected) as info:
        table.announce(announced(1), 1.0 + TTL / 2)
    assert info.value.reason is Reason.DISCOVERY_CONFLICT
    # After a TTL it is an ordinary announcement again (a worker outside the selector).
    change, instance = table.announce(announced(1), 2.0 + TTL)
    assert change is Change.REGISTERED and instance.source is Source.V1


def test_a_pod_seen_again_after_deletion_is_back_at_once() -> None:
    table = RegistryTable(TTL, 10)
    table.discovered(pod(1), 0.0)
    table.undiscovered(http(1), 1.0)
    assert table.discovered(pod(1), 2.0) is Change.REGISTERED
    table.announce(announced(1), 2.5)  # no tombstone left to refuse it
    assert routed(table) == {http(1)}


def test_static_instances_stay_the_operators() -> None:
    table = RegistryTable(TTL, 10)
    table.add_static(Instance(Role.DECODE, http(1), zmq(1), Source.STATIC), 0.0)
    assert table.discovered(pod(1, ready=False), 1.0) is Change.REFRESHED
    instance = table.get(http(1))
    assert instance is not None and instance.source is Source.STATIC and instance.ready


def test_pods_count_against_the_cap() -> None:
    table = RegistryTable(TTL, 1)
    table.discovered(pod(1), 0.0)
    with pytest.raises(Rejected) as info:
        table.discovered(pod(2), 0.0)
    assert info.value.reason is Reason.CAPACITY


def test_a_copy_of_the_table_routes_alike() -> None:
    """What an HTTP worker of `--workers` adopts: readiness and drain travel with the rows."""
    table = RegistryTable(TTL, 10)
    table.discovered(pod(1), 0.0)
    table.discovered(pod(2, ready=False), 0.0)
    table.discovered(pod(3, drained=True), 0.0)
    copy = RegistryTable(TTL, 10)
    copy.adopt(table.registrations())
    assert routed(copy) == {http(1)}
