"""local_metrics: the lock-free values expose exactly what prometheus_client's objects would.

Each test applies the same updates to a prometheus_client object and to the local family made
from its definition, each on a registry of its own, and compares the two expositions sample by
sample (`_created` holds wall-clock stamps, so only its presence and labels are compared).
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from pdproxy.local_metrics import LocalCounter, LocalGauge, LocalHistogram
from pdproxy.metrics import Metrics

BUCKETS = (0.0005, 0.001, 0.01, 0.1, 1.0, 10.0)


def exposition(registry: CollectorRegistry) -> list[str]:
    lines = []
    for line in generate_latest(registry).decode().splitlines():
        name = line.rpartition(" ")[0]
        lines.append(f"{name} <stamp>" if "_created" in name else line)
    return lines


def pair_registries() -> tuple[CollectorRegistry, CollectorRegistry]:
    return CollectorRegistry(), CollectorRegistry()


def test_a_labelled_counter_matches() -> None:
    theirs, ours = pair_registries()
    counter = Counter("c", "A counter.", ["endpoint", "status"], registry=theirs)
    local = LocalCounter(Counter("c", "A counter.", ["endpoint", "status"], registry=None), clock)
    ours.register(local)
    assert exposition(theirs) == exposition(ours)  # no series before the first count
    rng = random.Random(7)
    for _ in range(500):
        labels = (rng.choice(["/v1/completions", "/v1/chat/completions"]), rng.choice("2345"))
        amount = rng.choice([1.0, 2.5])
        counter.labels(*labels).inc(amount)
        local.inc(labels, amount)
    assert exposition(theirs) == exposition(ours)
    assert any(line.startswith("c_created{") for line in exposition(ours))


@pytest.mark.parametrize("labelled", [False, True])
def test_a_histogram_matches_on_and_between_its_bounds(labelled: bool) -> None:
    theirs, ours = pair_registries()
    names = ["endpoint"] if labelled else []
    histogram = Histogram("h", "A histogram.", names, buckets=BUCKETS, registry=theirs)
    definition = Histogram("h", "A histogram.", names, buckets=BUCKETS, registry=None)
    local = LocalHistogram(definition, clock)
    ours.register(local)
    assert exposition(theirs) == exposition(ours)  # unlabelled: zeros from the start
    rng = random.Random(11)
    # Exactly on each bound (le is inclusive), just above it, zero, past the last, and random.
    values = [*BUCKETS, *(math.nextafter(b, math.inf) for b in BUCKETS), 0.0, 1e6]
    values += [rng.uniform(0, 20) for _ in range(1000)]
    for value in values:
        labels = (rng.choice(["a", "b"]),) if labelled else ()
        (histogram.labels(*labels) if labelled else histogram).observe(value)
        local.series(labels).observe(value)
    assert exposition(theirs) == exposition(ours)


def test_a_gauge_matches() -> None:
    theirs, ours = pair_registries()
    gauge = Gauge("g", "A gauge.", registry=theirs)
    local = LocalGauge(Gauge("g", "A gauge.", registry=None))
    ours.register(local)
    assert exposition(theirs) == exposition(ours)
    for value in (3, 0, 17, 2):
        gauge.set(value)
        local.set(value)
        assert exposition(theirs) == exposition(ours)


def test_one_process_metrics_show_the_request_updates_in_the_definitions_order() -> None:
    metrics = Metrics()
    metrics.request_answered("/v1/completions", "200", 0.004)
    metrics.request_answered("/v1/completions", "200", 0.2)
    metrics.count_request("/health", "200")
    metrics.prefill_done(0.003)
    metrics.decode_first_byte_seen(0.0007)
    metrics.first_token_sent(0.02)
    metrics.set_admitted(5)
    sample = metrics.registry.get_sample_value
    assert sample("pdproxy_requests_total", {"endpoint": "/v1/completions", "status": "200"}) == 2
    assert sample("pdproxy_requests_total", {"endpoint": "/health", "status": "200"}) == 1
    duration = {"endpoint": "/v1/completions"}
    assert sample("pdproxy_request_duration_seconds_count", duration) == 2
    assert sample("pdproxy_request_duration_seconds_sum", duration) == pytest.approx(0.204)
    assert sample("pdproxy_request_duration_seconds_bucket", {**duration, "le": "0.005"}) == 1
    assert sample("pdproxy_prefill_duration_seconds_bucket", {"le": "0.0025"}) == 0
    assert sample("pdproxy_prefill_duration_seconds_bucket", {"le": "0.005"}) == 1
    assert sample("pdproxy_decode_first_byte_seconds_bucket", {"le": "0.001"}) == 1
    assert sample("pdproxy_time_to_first_token_seconds_bucket", {"le": "0.01"}) == 0
    assert sample("pdproxy_time_to_first_token_seconds_bucket", {"le": "0.025"}) == 1
    assert sample("pdproxy_admitted_requests", {}) == 5
    families = [family.name for family in metrics.registry.collect()]
    order = ["pdproxy_requests", "pdproxy_request_duration_seconds"]
    order += ["pdproxy_prefill_duration_seconds", "pdproxy_decode_first_byte_seconds"]
    order += ["pdproxy_time_to_first_token_seconds"]
    assert families[:5] == order
    admitted = families.index("pdproxy_admitted_requests")
    assert families[admitted - 1 : admitted + 2] == [
        "pdproxy_outlier_ejections",
        "pdproxy_admitted_requests",
        "pdproxy_queued_requests",
    ]


def test_the_admitted_gauge_reads_its_count_at_scrape_time_in_one_process(
    tmp_path: Path,
) -> None:
    metrics = Metrics()
    count = [3]
    assert metrics.read_admitted(lambda: count[0])
    sample = metrics.registry.get_sample_value
    assert sample("pdproxy_admitted_requests", {}) == 3
    count[0] = 0
    assert sample("pdproxy_admitted_requests", {}) == 0
    # Several workers share files: nothing reads at scrape time, the caller sets the gauge.
    assert not Metrics(shared_dir=str(tmp_path)).read_admitted(lambda: 3)


def clock() -> float:
    return 1_700_000_000.0
