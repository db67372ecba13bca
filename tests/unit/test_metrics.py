"""pdproxy.metrics: in-flight accounting and label removal, on a registry of its own."""

from __future__ import annotations

import pytest

from pdproxy.base.roles import Role
from pdproxy.metrics import Metrics
from pdproxy.registry.kv_stats import COUNTED_OUTCOMES, TransferRecord


def value(metrics: Metrics, role: str, instance: str) -> float | None:
    return metrics.registry.get_sample_value(
        "pdproxy_inflight_legs", {"role": role, "upstream": instance}
    )


def test_legs_count_up_and_down() -> None:
    m = Metrics()
    m.instance_joined("a:1")
    m.leg_started(Role.PREFILL, "a:1")
    m.leg_started(Role.PREFILL, "a:1")
    assert value(m, "prefill", "a:1") == 2
    m.leg_finished(Role.PREFILL, "a:1")
    m.leg_finished(Role.PREFILL, "a:1")
    assert value(m, "prefill", "a:1") == 0


def test_leaving_idle_instance_drops_its_labels_at_once() -> None:
    m = Metrics()
    m.leg_started(Role.DECODE, "a:1")
    m.leg_finished(Role.DECODE, "a:1")
    m.instance_left("a:1")
    assert value(m, "decode", "a:1") is None


def test_leaving_busy_instance_keeps_labels_until_its_last_leg() -> None:
    m = Metrics()
    m.leg_started(Role.DECODE, "a:1")
    m.leg_started(Role.PREFILL, "a:1")
    m.instance_left("a:1")
    assert value(m, "decode", "a:1") == 1
    m.leg_finished(Role.DECODE, "a:1")
    assert value(m, "decode", "a:1") is None  # its last decode leg ended
    assert value(m, "prefill", "a:1") == 1
    m.leg_finished(Role.PREFILL, "a:1")
    assert value(m, "prefill", "a:1") is None
    # Never resurrected at -1, and nothing is remembered about it any more.
    assert "a:1" not in m.render().decode()


def test_rejoining_before_the_last_leg_keeps_the_labels() -> None:
    m = Metrics()
    m.leg_started(Role.DECODE, "a:1")
    m.instance_left("a:1")
    m.instance_joined("a:1")
    m.leg_finished(Role.DECODE, "a:1")
    assert value(m, "decode", "a:1") == 0


def test_every_rejection_reason_is_exported_from_the_start() -> None:
    text = Metrics().render().decode()
    assert 'pdproxy_registry_messages_total{outcome="rejected",reason="not_msgpack"} 0.0' in text
    assert 'pdproxy_registry_instances{role="prefill"} 0.0' in text


# -- KV transfers -------------------------------------------------------------------------------

UID = "0123456789abcdef0123456789abcdef"


def kv_record(
    outcome: str = "ok", bytes_: int = 1000, seconds: float | None = 0.5
) -> TransferRecord:
    return TransferRecord(f"{UID}-0", outcome, "p:1", "d:2", bytes_, 1, seconds, Role.DECODE)


def kv_sample(m: Metrics, name: str, labels: dict[str, str] | None = None) -> float | None:
    return m.registry.get_sample_value(name, labels or {})


PAIR = {"prefill": "p:1", "decode": "d:2"}


def test_kv_outcomes_start_at_zero() -> None:
    m = Metrics()
    for outcome in COUNTED_OUTCOMES:
        assert kv_sample(m, "pdproxy_kv_transfers_total", {"outcome": outcome}) == 0
    assert kv_sample(m, "pdproxy_kv_transfer_bytes_total", PAIR) is None


def test_a_counted_transfer_adds_bytes_duration_and_bandwidth() -> None:
    m = Metrics()
    m.kv_transfer_counted(kv_record(bytes_=1000, seconds=0.5), ("p:1", "d:2"))
    m.kv_transfer_counted(kv_record(bytes_=600, seconds=0.2), ("p:1", "d:2"))
    assert kv_sample(m, "pdproxy_kv_transfers_total", {"outcome": "ok"}) == 2
    assert kv_sample(m, "pdproxy_kv_transfer_bytes_total", PAIR) == 1600
    assert kv_sample(m, "pdproxy_kv_transfer_duration_seconds_count") == 2
    assert kv_sample(m, "pdproxy_kv_transfer_duration_seconds_sum") == pytest.approx(0.7)
    bucket = {"le": "0.25"}
    assert kv_sample(m, "pdproxy_kv_transfer_duration_seconds_bucket", bucket) == 1
    # The last successful transfer's bytes over its duration.
    assert kv_sample(m, "pdproxy_kv_transfer_bandwidth_bytes_per_second", PAIR) == 3000


def test_buckets_span_100_microseconds_to_a_minute() -> None:
    m = Metrics()
    m.kv_transfer_counted(kv_record(seconds=0.0001), None)
    bucket = "pdproxy_kv_transfer_duration_seconds_bucket"
    assert kv_sample(m, bucket, {"le": "0.0001"}) == 1
    assert kv_sample(m, bucket, {"le": "60.0"}) == 1
    assert kv_sample(m, bucket, {"le": "30.0"}) == 1


def test_failures_count_bytes_but_no_duration_or_bandwidth() -> None:
    m = Metrics()
    m.kv_transfer_counted(kv_record("timeout", bytes_=10, seconds=5.0), ("p:1", "d:2"))
    m.kv_transfer_counted(kv_record("incomplete", bytes_=0, seconds=None), ("p:1", "d:2"))
    assert kv_sample(m, "pdproxy_kv_transfers_total", {"outcome": "timeout"}) == 1
    assert kv_sample(m, "pdproxy_kv_transfers_total", {"outcome": "incomplete"}) == 1
    assert kv_sample(m, "pdproxy_kv_transfer_bytes_total", PAIR) == 10
    assert kv_sample(m, "pdproxy_kv_transfer_duration_seconds_count") == 0
    assert kv_sample(m, "pdproxy_kv_transfer_bandwidth_bytes_per_second", PAIR) is None


def test_a_zero_duration_sets_no_bandwidth() -> None:
    m = Metrics()
    m.kv_transfer_counted(kv_record(seconds=0.0), ("p:1", "d:2"))
    assert kv_sample(m, "pdproxy_kv_transfer_bandwidth_bytes_per_second", PAIR) is None
    assert kv_sample(m, "pdproxy_kv_transfer_bytes_total", PAIR) == 1000


def test_without_a_registered_pair_only_the_unlabelled_metrics_move() -> None:
    m = Metrics()
    m.kv_transfer_counted(kv_record(), None)
    assert kv_sample(m, "pdproxy_kv_transfers_total", {"outcome": "ok"}) == 1
    assert kv_sample(m, "pdproxy_kv_transfer_duration_seconds_count") == 1
    assert "pdproxy_kv_transfer_bytes_total{" not in m.render().decode()


def test_a_leaving_instance_takes_its_pairs_label_sets_along() -> None:
    m = Metrics()
    m.kv_transfer_counted(kv_record(), ("p:1", "d:2"))
    m.kv_transfer_counted(kv_record(), ("p:1", "d:3"))
    m.kv_transfer_counted(kv_record(), ("p:4", "d:3"))
    m.instance_left("d:3")
    other = {"prefill": "p:1", "decode": "d:3"}
    assert kv_sample(m, "pdproxy_kv_transfer_bytes_total", other) is None
    assert kv_sample(m, "pdproxy_kv_transfer_bandwidth_bytes_per_second", other) is None
    assert kv_sample(m, "pdproxy_kv_transfer_bytes_total", PAIR) == 1000  # untouched
    gone = {"prefill": "p:4", "decode": "d:3"}
    assert kv_sample(m, "pdproxy_kv_transfer_bytes_total", gone) is None
    m.instance_left("p:1")
    text = m.render().decode()
    assert "pdproxy_kv_transfer_bytes_total{" not in text
    assert "pdproxy_kv_transfer_bandwidth_bytes_per_second{" not in text
    assert kv_sample(m, "pdproxy_kv_transfers_total", {"outcome": "ok"}) == 3  # not per pair
