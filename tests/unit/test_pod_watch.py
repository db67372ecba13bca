"""pdproxy.registry.kubernetes.RoleWatch: list and watch events turned into what the table is
told (a recording sink stands in for the registry server), and the namespace default."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdproxy.base.roles import Role
from pdproxy.config import Settings
from pdproxy.ids import Address
from pdproxy.registry.kubernetes import RoleWatch, namespace, pod_keys
from pdproxy.registry.table import Instance

KEYS = pod_keys(Settings())


class Recorder:
    def __init__(self) -> None:
        self.seen: list[Instance] = []
        self.gone: list[Address] = []

    def discovered(self, instance: Instance) -> None:
        self.seen.append(instance)

    def undiscovered(self, http_address: Address) -> None:
        self.gone.append(http_address)


def api_pod(name: str, ip: str, http_port: str = "8000") -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "annotations": {"pdproxy.io/http-port": http_port, "pdproxy.io/kv-port": "21001"},
        },
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }


def test_a_list_forgets_the_pods_it_lacks() -> None:
    sink = Recorder()
    watch = RoleWatch(Role.DECODE, KEYS, sink)
    watch.listed([api_pod("a", "10.0.0.1"), api_pod("b", "10.0.0.2")])
    assert {i.http_address.host for i in sink.seen} == {"10.0.0.1", "10.0.0.2"}
    watch.listed([api_pod("b", "10.0.0.2")])
    assert sink.gone == [Address("10.0.0.1", 8000)]


def test_deleted_and_moved_pods_leave_their_old_address() -> None:
    sink = Recorder()
    watch = RoleWatch(Role.DECODE, KEYS, sink)
    watch.event("ADDED", api_pod("a", "10.0.0.1"))
    watch.event("MODIFIED", api_pod("a", "10.0.0.1", http_port="9000"))
    assert sink.gone == [Address("10.0.0.1", 8000)]
    watch.event("DELETED", api_pod("a", "10.0.0.1", http_port="9000"))
    assert sink.gone[-1] == Address("10.0.0.1", 9000)
    watch.event("DELETED", api_pod("never-seen", "10.0.0.9"))
    assert len(sink.gone) == 2


def test_a_pod_made_unusable_leaves_and_a_bad_new_one_never_enters() -> None:
    sink = Recorder()
    watch = RoleWatch(Role.PREFILL, KEYS, sink)
    watch.event("ADDED", api_pod("a", "10.0.0.1"))
    watch.event("MODIFIED", api_pod("a", "10.0.0.1", http_port="none"))
    assert sink.gone == [Address("10.0.0.1", 8000)]
    watch.event("ADDED", api_pod("b", "10.0.0.2", http_port="none"))
    assert [i.http_address.host for i in sink.seen] == ["10.0.0.1"]


def test_the_namespace_defaults_to_the_service_accounts(tmp_path: Path) -> None:
    own = tmp_path / "namespace"
    assert namespace(Settings(), own) == "default"
    own.write_text("inference\n", encoding="utf-8")
    assert namespace(Settings(), own) == "inference"
    assert namespace(Settings(kubernetes_namespace="other"), own) == "other"
