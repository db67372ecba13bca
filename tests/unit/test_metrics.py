"""pdproxy.metrics: in-flight accounting and label removal, on a registry of its own."""

from __future__ import annotations

from pdproxy.metrics import Metrics


def value(metrics: Metrics, role: str, instance: str) -> float | None:
    return metrics.registry.get_sample_value(
        "pdproxy_inflight_requests", {"role": role, "instance": instance}
    )


def test_legs_count_up_and_down() -> None:
    m = Metrics()
    m.instance_joined("a:1")
    m.leg_started("prefill", "a:1")
    m.leg_started("prefill", "a:1")
    assert value(m, "prefill", "a:1") == 2
    m.leg_finished("prefill", "a:1")
    m.leg_finished("prefill", "a:1")
    assert value(m, "prefill", "a:1") == 0


def test_leaving_idle_instance_drops_its_labels_at_once() -> None:
    m = Metrics()
    m.leg_started("decode", "a:1")
    m.leg_finished("decode", "a:1")
    m.instance_left("a:1")
    assert value(m, "decode", "a:1") is None


def test_leaving_busy_instance_keeps_labels_until_its_last_leg() -> None:
    m = Metrics()
    m.leg_started("decode", "a:1")
    m.leg_started("prefill", "a:1")
    m.instance_left("a:1")
    assert value(m, "decode", "a:1") == 1
    m.leg_finished("decode", "a:1")
    assert value(m, "decode", "a:1") is None  # its last decode leg ended
    assert value(m, "prefill", "a:1") == 1
    m.leg_finished("prefill", "a:1")
    assert value(m, "prefill", "a:1") is None
    # Never resurrected at -1, and nothing is remembered about it any more.
    assert "a:1" not in m.render().decode()


def test_rejoining_before_the_last_leg_keeps_the_labels() -> None:
    m = Metrics()
    m.leg_started("decode", "a:1")
    m.instance_left("a:1")
    m.instance_joined("a:1")
    m.leg_finished("decode", "a:1")
    assert value(m, "decode", "a:1") == 0


def test_every_rejection_reason_is_exported_from_the_start() -> None:
    text = Metrics().render().decode()
    assert 'pdproxy_registry_messages_total{outcome="rejected",reason="not_msgpack"} 0.0' in text
    assert 'pdproxy_registry_instances{role="P"} 0.0' in text
