"""The stats op through RegistryServer.handle (the live loop's per-message step), with clocks
injected and no socket: who may report, how peers are resolved, what reaches the metrics, and
that a leaving instance takes its label sets along."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest

from pdproxy.base.roles import Role
from pdproxy.config import Settings
from pdproxy.metrics import Metrics
from pdproxy.registry.auth import new_nonce, signed
from pdproxy.registry.kv_stats import KvTransferStats
from pdproxy.registry.server import RegistryServer
from pdproxy.registry.table import RegistryTable
from pdproxy.vllm_side.announcement import TransferStat, WorkerIdentity, announce_message
from pdproxy.vllm_side.announcement import leave_message as worker_leave
from pdproxy.vllm_side.announcement import stats_message as worker_stats

UID = "0123456789abcdef0123456789abcdef"
SECRET = "unit-registry-secret-0123"
WALL = 1_700_000_000.0
KV_TTL = 30.0
INSTANCE_TTL = 100.0  # longer than KV_TTL: instances stay while transfers settle
P = WorkerIdentity(Role.PREFILL, "10.0.0.1:8100", "10.0.0.1:21001")
D = WorkerIdentity(Role.DECODE, "10.0.0.2:8200", "10.0.0.2:22001")
PAIR = {"prefill": P.http_address, "decode": D.http_address}


@dataclass
class Clock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Registry:
    secret: bool = False
    clock: Clock = field(default_factory=Clock)
    metrics: Metrics = field(default_factory=Metrics)

    def __post_init__(self) -> None:
        options: dict[str, Any] = {"ttl": INSTANCE_TTL}
        if self.secret:
            options["registry_secret"] = SECRET
        settings = Settings(**options)
        self.table = RegistryTable(settings.ttl, settings.max_instances)
        self.server = RegistryServer(
            settings,
            self.table,
            self.metrics,
            clock=self.clock,
            wall_clock=lambda: WALL,
            kv_stats=KvTransferStats(KV_TTL),
        )

    def send(self, message: dict[str, Any]) -> str:
        """Handle one message; the reason it was counted under ("ok" when accepted)."""
        before = self.counts()
        if self.secret and "auth" not in message:
            message = signed(message, SECRET.encode(), WALL, new_nonce())
        self.server.handle([b"test", msgpack.packb(message)])
        after = self.counts()
        [changed] = [k for k, v in after.items() if v != before.get(k, 0)]
        return changed

    def counts(self) -> dict[str, float]:
        return {
            s.labels["reason"]: s.value
            for family in self.metrics.registry_messages.collect()
            for s in family.samples
            if s.name.endswith("_total")
        }

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels or {})

    def transfers(self, outcome: str) -> float | None:
        return self.sample("pdproxy_kv_transfers_total", {"outcome": outcome})


def stat(peer: str, n: int = 0, **kw: Any) -> TransferStat:
    values: dict[str, Any] = {"bytes": 1000, "blocks": 2, "seconds": 0.5, "outcome": "ok"}
    values.update(kw)
    return TransferStat(f"{UID}-{n}", peer, **values)


def stats(who: WorkerIdentity, *entries: TransferStat, rank: int = 0, ranks: int = 1) -> Any:
    return worker_stats(who.role, who.http_address, rank, ranks, list(entries))


@pytest.fixture
def registry() -> Registry:
    r = Registry()
    assert r.send(announce_message(P)) == "ok"
    assert r.send(announce_message(D)) == "ok"
    return r


def test_a_decode_report_counts_for_the_registered_pair(registry: Registry) -> None:
    assert registry.send(stats(D, stat(P.http_address, bytes=4096, seconds=0.25))) == "ok"
    assert registry.transfers("ok") == 1
    assert registry.sample("pdproxy_kv_transfer_bytes_total", PAIR) == 4096
    assert registry.sample("pdproxy_kv_transfer_bandwidth_bytes_per_second", PAIR) == 4096 / 0.25
    assert registry.sample("pdproxy_kv_transfer_duration_seconds_count") == 1


def test_peers_are_resolved_by_their_zmq_address_too(registry: Registry) -> None:
    # What a connector knows of its peer is the KV address the request-id tag names.
    registry.send(stats(P, stat(D.zmq_address, bytes=10), ranks=1))
    registry.clock.now += KV_TTL  # no decode report: the prefill's view at the deadline
    registry.server.sweep()
    assert registry.transfers("ok") == 1
    assert registry.sample("pdproxy_kv_transfer_bytes_total", PAIR) == 10


def test_both_sides_reporting_count_once_with_the_decode_view(registry: Registry) -> None:
    registry.send(stats(P, stat(D.zmq_address, bytes=999)))
    registry.send(stats(D, stat(P.zmq_address, bytes=1000, outcome="timeout")))
    registry.clock.now += 3 * KV_TTL
    registry.server.sweep()
    assert registry.transfers("timeout") == 1
    assert registry.transfers("ok") == 0
    assert registry.sample("pdproxy_kv_transfer_bytes_total", PAIR) == 1000


def test_every_rank_must_report(registry: Registry) -> None:
    registry.send(stats(D, stat(P.http_address, bytes=100), rank=0, ranks=2))
    assert registry.transfers("ok") == 0
    registry.send(stats(D, stat(P.http_address, bytes=50), rank=1, ranks=2))
    assert registry.transfers("ok") == 1
    assert registry.sample("pdproxy_kv_transfer_bytes_total", PAIR) == 150


def test_one_message_carries_many_transfers(registry: Registry) -> None:
    entries = [stat(P.http_address, n, bytes=n) for n in range(256)]
    assert registry.send(stats(D, *entries)) == "ok"
    assert registry.transfers("ok") == 256
    assert registry.sample("pdproxy_kv_transfer_bytes_total", PAIR) == sum(range(256))


def test_an_unregistered_sender_is_refused(registry: Registry) -> None:
    stranger = WorkerIdentity(Role.DECODE, "10.0.0.9:8200", "10.0.0.9:22001")
    assert registry.send(stats(stranger, stat(P.http_address))) == "unknown_instance"
    # Registered, but not in the role it claims.
    impostor = WorkerIdentity(Role.PREFILL, D.http_address, D.zmq_address)
    assert registry.send(stats(impostor, stat(D.http_address))) == "unknown_instance"
    assert registry.transfers("ok") == 0


def test_an_unknown_peer_counts_without_a_pair(registry: Registry) -> None:
    assert registry.send(stats(D, stat("10.0.0.77:1"))) == "ok"
    assert registry.transfers("ok") == 1
    assert registry.sample("pdproxy_kv_transfer_duration_seconds_count") == 1
    assert "pdproxy_kv_transfer_bytes_total{" not in registry.metrics.render().decode()


def test_a_peer_in_the_wrong_role_is_not_a_peer(registry: Registry) -> None:
    # A decode naming another decode (itself) as where its KV came from.
    registry.send(stats(D, stat(D.http_address)))
    assert registry.transfers("ok") == 1
    assert "pdproxy_kv_transfer_bytes_total{" not in registry.metrics.render().decode()


def test_stats_do_not_keep_an_instance_alive(registry: Registry) -> None:
    seen = {e.instance.name: e.last_seen for e in registry.table.registrations()}
    registry.clock.now += INSTANCE_TTL / 2
    registry.send(stats(D, stat(P.http_address)))
    assert {e.instance.name: e.last_seen for e in registry.table.registrations()} == seen
    registry.clock.now += INSTANCE_TTL / 2 + 1  # past the TTL since the announcements
    expired = registry.server.sweep()
    assert {i.name for i in expired} == {P.http_address, D.http_address}


def test_a_leaving_instance_takes_its_label_sets_along(registry: Registry) -> None:
    registry.send(stats(D, stat(P.http_address)))
    assert registry.sample("pdproxy_kv_transfer_bytes_total", PAIR) == 1000
    registry.send(worker_leave(D))
    assert registry.sample("pdproxy_kv_transfer_bytes_total", PAIR) is None
    assert registry.sample("pdproxy_kv_transfer_bandwidth_bytes_per_second", PAIR) is None
    assert registry.transfers("ok") == 1  # counted is counted


def test_a_transfer_settled_after_its_decode_left_adds_no_label_set(registry: Registry) -> None:
    registry.send(stats(P, stat(D.http_address)))
    registry.send(worker_leave(D))
    registry.clock.now += KV_TTL
    registry.server.sweep()
    assert registry.transfers("ok") == 1
    assert registry.sample("pdproxy_kv_transfer_bytes_total", PAIR) is None


def test_an_expired_instance_takes_its_label_sets_along(registry: Registry) -> None:
    registry.send(stats(D, stat(P.http_address)))
    registry.clock.now += INSTANCE_TTL + 1
    registry.server.sweep()
    assert registry.sample("pdproxy_kv_transfer_bytes_total", PAIR) is None


def test_incomplete_transfers_are_counted_at_the_sweep(registry: Registry) -> None:
    registry.send(stats(D, stat(P.http_address), rank=0, ranks=2))
    registry.clock.now += KV_TTL - 1
    registry.server.sweep()
    assert registry.transfers("incomplete") == 0
    registry.clock.now += 1
    registry.server.sweep()
    assert registry.transfers("incomplete") == 1
    assert registry.sample("pdproxy_kv_transfer_bytes_total", PAIR) == 0  # the pair is known


def test_a_malformed_report_counts_nothing(registry: Registry) -> None:
    message = stats(D, stat(P.http_address))
    message["transfers"].append({"id": "nope"})
    assert registry.send(message) == "bad_transfer"
    assert registry.transfers("ok") == 0


def test_with_a_secret_only_signed_stats_count() -> None:
    registry = Registry(secret=True)
    assert registry.send(announce_message(P)) == "ok"
    assert registry.send(announce_message(D)) == "ok"
    unsigned = stats(D, stat(P.http_address))
    unsigned["auth"] = None  # present, so Registry.send does not sign it
    assert registry.send(unsigned) == "unsigned"
    wrong = signed(stats(D, stat(P.http_address)), b"another-secret-0123456", WALL, new_nonce())
    assert registry.send(wrong) == "bad_signature"
    assert registry.transfers("ok") == 0
    assert registry.send(stats(D, stat(P.http_address))) == "ok"
    assert registry.transfers("ok") == 1
