"""Every Prometheus metric pdproxy exports, defined once, on a registry the app owns.

Names are `pdproxy_*` in base units (seconds, bytes) and say what they count (legs are not
requests). Label names are one word each: `role` (prefill, decode), `upstream` (an instance's
http address; never `instance`, which Prometheus sets to the scraped target), `prefill` and
`decode` (a pair's two upstreams), `reason` (what kind of failure or refusal), `outcome` (how
something ended, success included). Label values come from bounded sets (endpoint, status
class, role, reason enums) or from registered instances, whose labels are removed when the
instance leaves, so label cardinality is bounded by the registry cap (in one process; see below
for several).

With several HTTP workers (`--workers`), every process writes its values to files in one
directory (prometheus_client's multiprocess mode) and /metrics, whichever worker answers, sums
them: counters and histograms over every process that ever ran (a restarted worker's counts are
not lost), gauges over the live ones. That mode cannot remove a label set, so there an
instance's series stay when it leaves (its in-flight and bandwidth gauges at 0, its KV byte
counters at their last value) until the processes are restarted: the series grow with every
instance ever seen, not with the registry cap.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from pdproxy.base.roles import Role
from pdproxy.local_metrics import LocalCounter, LocalGauge, LocalHistogram
from pdproxy.pairing.planner import Unpaired
from pdproxy.registry.kv_stats import COUNTED_OUTCOMES, TransferRecord
from pdproxy.registry.messages import Reason, TransferOutcome
from pdproxy.reliability.failures import FAILURES, RETRIED_KINDS, FailureKind, Origin
from pdproxy.reliability.outlier import CIRCUIT_LEVEL, Circuit

# Latency buckets from sub-millisecond proxy overhead to multi-minute prefills of long prompts.
_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)

# KV transfers: from a few blocks over shared memory to gigabytes over a slow network.
_KV_TRANSFER_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST
REFUSALS = ("queue_full", "queue_timeout", "draining", "unauthorized", "ambiguous_authorization")
DECODE_REFUSED = "decode_refused"
KV_ORPHAN_REASONS = (DECODE_REFUSED,)


# pdproxy_inflight_legs: a gauge with several workers, else read by _InflightCollector.
_INFLIGHT = (
    "pdproxy_inflight_legs",
    "Legs in flight, by role and upstream (the instance's http address).",
    ("role", "upstream"),
)
# Read from the outlier detector at scrape time (_CircuitCollector); the gauge only defines it.
_CIRCUIT = (
    "pdproxy_upstream_circuit_state",
    "Outlier state of upstreams that failed lately: 0 closed, 1 half-open (on probation), 2 "
    "open (ejected). Upstreams never seen failing are not listed. With several workers, the "
    "state seen by the worker that answered the scrape.",
    ("upstream",),
)


# How a migration ended (pdproxy_migrations_total's `outcome`).
MIGRATION_OUTCOMES = ("completed", "failed", "refused")


class Metrics:
    def __init__(
        self, registry: CollectorRegistry | None = None, shared_dir: str | None = None
    ) -> None:
        """`shared_dir`: the directory several processes count into (prometheus_client's
        multiprocess mode, chosen at its import by the environment; see multiworker)."""
        self.registry = registry or CollectorRegistry(auto_describe=True)
        shared = self.shared = shared_dir is not None
        # What /metrics shows: this registry, or with several workers the sum of all processes.
        self.exposed = self.registry
        if shared_dir is not None:
            self.exposed = CollectorRegistry()
            MultiProcessCollector(self.exposed, shared_dir)  # type: ignore[no-untyped-call]
        r = self.registry
        # The metrics every request updates (requests, the four latencies, admitted): with
        # several workers prometheus_client's values, which go to the shared files; in one
        # process lock-free local values (local_metrics.py), registered in their place, and the
        # definitions below, unregistered, only say what they are.
        hot = r if shared else None
        self.requests = Counter(
            "pdproxy_requests",
            "Client requests answered, by endpoint and HTTP status code.",
            ["endpoint", "status"],
            registry=hot,
        )
        self.request_duration = Histogram(
            "pdproxy_request_duration_seconds",
            "End-to-end latency of client requests, until the last byte is sent.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=hot,
        )
        self.prefill_duration = Histogram(
            "pdproxy_prefill_duration_seconds",
            "Latency of the prefill leg (max_tokens=1), read to the end.",
            buckets=_LATENCY_BUCKETS,
            registry=hot,
        )
        self.decode_first_byte = Histogram(
            "pdproxy_decode_first_byte_seconds",
            "Time from sending the decode leg to its first body byte.",
            buckets=_LATENCY_BUCKETS,
            registry=hot,
        )
        self.time_to_first_token = Histogram(
            "pdproxy_time_to_first_token_seconds",
            "Streamed completion requests: from their arrival to the first body byte relayed "
            "to the client (queueing, prefill and the decode's first byte together).",
            buckets=_LATENCY_BUCKETS,
            registry=hot,
        )
        self._local: _LocalValues | None = None
        if not shared:
            self._local = _LocalValues(self)
            for family in self._local.first:
                r.register(family)
        # Legs in flight. Several workers must each write theirs to the shared files: a gauge.
        # In one process a collector reads the leg counts at scrape time instead (why:
        # docs/performance.md, "Per-request metrics"); the gauge, unregistered, defines it.
        self.inflight = Gauge(
            *_INFLIGHT,
            registry=r if shared else None,
            multiprocess_mode="livesum",
        )
        self._legs: dict[tuple[str, str], _Legs] = {}
        # The (role, instance) pairs with an in-flight series: given a leg, not removed since.
        self._inflight_sets: set[tuple[str, str]] = set()
        if not shared:
            r.register(_InflightCollector(self._legs, self._inflight_sets))
        self.registry_instances = Gauge(
            "pdproxy_registry_instances",
            "Registered instances by role.",
            ["role"],
            registry=r,
            multiprocess_mode="livemax",  # only the registry's process sets it
        )
        self.registry_messages = Counter(
            "pdproxy_registry_messages",
            "Registry frames received, by outcome (accepted/rejected) and reason.",
            ["outcome", "reason"],
            registry=r,
        )
        self.registry_stalls = Counter(
            "pdproxy_registry_stalls",
            "Sweeps that found the proxy had not run for over two sweep periods (descheduled, "
            "CPU-throttled, stopped) and so expired no one: what the workers sent meanwhile was "
            "not read yet. The first sweep after a period the proxy ran through judges.",
            registry=r,
        )
        self.upstream_errors = Counter(
            "pdproxy_upstream_errors",
            "Legs failed by their upstream or the exchange with it, by role and reason "
            "(connect, timeout, status_5xx...). The proxy's own saturation is counted in "
            "pdproxy_saturated_legs_total instead.",
            ["role", "reason"],
            registry=r,
        )
        self.saturated_legs = Counter(
            "pdproxy_saturated_legs",
            "Legs the proxy could not send for its own lack of capacity (no free upstream "
            "connection slot, no descriptor or port left), by role: answered 503, no upstream "
            "blamed.",
            ["role"],
            registry=r,
        )
        self.discovery_watch_restarts = Counter(
            "pdproxy_discovery_watch_restarts",
            "Kubernetes discovery's pod watches started again, by role and reason (expired: "
            "410 Gone, listed again; failed: an error, resumed after a backoff; closed: ended "
            "at once without an event).",
            ["role", "reason"],
            registry=r,
        )
        self.unpaired = Counter(
            "pdproxy_unpaired_requests",
            "Requests refused because no compatible prefill/decode pair could serve them "
            "(503; 404 for a model no registered instance serves: no_instance), by reason "
            "(no_instance, no_prefill, no_decode, incompatible).",
            ["reason"],
            registry=r,
        )
        self.direct = Counter(
            "pdproxy_direct_requests",
            "Requests with a short prompt sent straight to a decode instance that computes it "
            "itself (conditional disaggregation: no prefill leg, no KV transfer).",
            registry=r,
        )
        self.retries = Counter(
            "pdproxy_retries",
            "Attempts retried after a leg failed before the client saw a byte, by the failed "
            "leg's role and the failure's reason.",
            ["role", "reason"],
            registry=r,
        )
        self.migrations = Counter(
            "pdproxy_migrations",
            "Answers (streamed, or whole and long) continued on another pair after their decode "
            "failed mid-answer, "
            "by the failure's reason and the migration's outcome: completed (the continuation "
            "ended the answer), failed (it failed too, or no pair was left), refused (not "
            "migrated: migration_limit reached, no token ids, a tool call or reasoning sent).",
            ["reason", "outcome"],
            registry=r,
        )
        self.migration_recomputed_tokens = Counter(
            "pdproxy_migration_recomputed_tokens",
            "Tokens prefilled again by migrations: each continuation's prompt (the original "
            "prompt plus the tokens generated before the cut).",
            registry=r,
        )
        self.ejections = Counter(
            "pdproxy_outlier_ejections",
            "Instances taken out of rotation after failing repeatedly, by role.",
            ["role"],
            registry=r,
        )
        self.admitted = Gauge(
            "pdproxy_admitted_requests",
            "Completion requests admitted and not finished (capped by max_inflight_requests).",
            registry=hot,
            multiprocess_mode="livesum",
        )
        if self._local is not None:
            self._local.admitted = LocalGauge(self.admitted)
            r.register(self._local.admitted)
        self.queued = Gauge(
            "pdproxy_queued_requests",
            "Requests waiting for a slot or for an instance below its cap.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.refused = Counter(
            "pdproxy_refused_requests",
            "Requests refused before any work, by reason (queue_full, queue_timeout, draining, "
            "unauthorized, ambiguous_authorization: several Authorization headers).",
            ["reason"],
            registry=r,
        )
        self.health_probes = Counter(
            "pdproxy_health_probes",
            "Active GET /health probes of registered instances, by outcome (ok, failed).",
            ["outcome"],
            registry=r,
        )
        self.kv_transfer_bytes = Counter(
            "pdproxy_kv_transfer_bytes",
            "KV bytes moved by counted transfers (what the counted side reported: the decode's "
            "received bytes, else the prefill's sent bytes), by prefill and decode instance.",
            ["prefill", "decode"],
            registry=r,
        )
        self.kv_transfers = Counter(
            "pdproxy_kv_transfers",
            "KV transfers, each counted once when every rank of its decode (else, after a "
            "timeout, its prefill) reported, by outcome (ok, dropped, missing, timeout, error; "
            "incomplete: some rank never reported).",
            ["outcome"],
            registry=r,
        )
        self.kv_transfer_duration = Histogram(
            "pdproxy_kv_transfer_duration_seconds",
            "Duration of successful KV transfers (the slowest rank of the counted side).",
            buckets=_KV_TRANSFER_BUCKETS,
            registry=r,
        )
        self.kv_transfer_bandwidth = Gauge(
            "pdproxy_kv_transfer_bandwidth_bytes_per_second",
            "Effective bandwidth of the last successful KV transfer between a prefill and a "
            "decode instance: its bytes over its duration.",
            ["prefill", "decode"],
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.kv_orphaned = Counter(
            "pdproxy_kv_orphaned_prefills",
            "Prefill legs whose KV no decode took, by reason (decode_refused: the prefill "
            "succeeded, then the decode answered 4xx; its KV was pushed or held for nothing).",
            ["reason"],
            registry=r,
        )
        for outcome in COUNTED_OUTCOMES:
            self.kv_transfers.labels(outcome)
        for reason in KV_ORPHAN_REASONS:
            self.kv_orphaned.labels(reason)
        for reason in REFUSALS:
            self.refused.labels(reason)
        for role in Role:
            for kind, policy in FAILURES.items():
                if policy.origin is Origin.UPSTREAM:
                    self.upstream_errors.labels(role, kind.value)
            self.saturated_legs.labels(role)
            for kind in sorted(RETRIED_KINDS):
                self.retries.labels(role, kind.value)
        for kind in sorted(RETRIED_KINDS):
            for outcome in MIGRATION_OUTCOMES:
                self.migrations.labels(kind.value, outcome)
        for outcome in ("ok", "failed"):
            self.health_probes.labels(outcome)
        for role in Role:
            self.ejections.labels(role)
        for unpaired in Unpaired:
            self.unpaired.labels(unpaired.value)
        for role in Role:
            self.registry_instances.labels(role)
        for reason in Reason:
            self.registry_messages.labels("rejected", reason.value)
        self._departed: set[str] = set()
        self._kv_pairs: set[tuple[str, str]] = set()
        # Upstream circuits: none until the proxy's outlier detector is watched.
        self.circuit = Gauge(*_CIRCUIT, registry=None)
        self._circuit_states = _CircuitCollector(dict)
        self.exposed.register(self._circuit_states)

    def kv_transfer_counted(self, record: TransferRecord, pair: tuple[str, str] | None) -> None:
        """Count one transfer. `pair` (prefill, decode) is given only when both instances are
        registered: per-pair label sets exist only for registered instances."""
        self.kv_transfers.labels(record.outcome).inc()
        # Durations of failures are their timeouts: they would only blur the percentiles.
        seconds = record.seconds if record.outcome == TransferOutcome.OK.value else None
        if seconds is not None:
            self.kv_transfer_duration.observe(seconds)
        if pair is None:
            return
        self._kv_pairs.add(pair)
        self.kv_transfer_bytes.labels(*pair).inc(record.bytes)
        if seconds:  # a zero duration has no bandwidth
            self.kv_transfer_bandwidth.labels(*pair).set(record.bytes / seconds)

    # -- the updates of every request ---------------------------------------------------------

    def count_request(self, endpoint: str, status: str) -> None:
        if self._local is None:
            self.requests.labels(endpoint, status).inc()
        else:
            self._local.requests.inc((endpoint, status))

    def request_answered(self, endpoint: str, status: str, seconds: float) -> None:
        """A completion request's answer: counted, and its latency observed."""
        self.count_request(endpoint, status)
        if self._local is None:
            self.request_duration.labels(endpoint).observe(seconds)
        else:
            self._local.request_duration.series((endpoint,)).observe(seconds)

    def prefill_done(self, seconds: float) -> None:
        if self._local is None:
            self.prefill_duration.observe(seconds)
        else:
            self._local.prefill.observe(seconds)

    def decode_first_byte_seen(self, seconds: float) -> None:
        if self._local is None:
            self.decode_first_byte.observe(seconds)
        else:
            self._local.decode_first_byte.observe(seconds)

    def first_token_sent(self, seconds: float) -> None:
        if self._local is None:
            self.time_to_first_token.observe(seconds)
        else:
            self._local.time_to_first_token.observe(seconds)

    def read_admitted(self, count: Callable[[], int]) -> bool:
        """In one process the admitted gauge reads `count` at scrape time (True), not on every
        request; with several workers (False) the caller sets it (`set_admitted`)."""
        if self._local is None:
            return False
        self._local.admitted.reader = count
        return True

    def set_admitted(self, count: int) -> None:
        if self._local is None:
            self.admitted.set(count)
        else:
            self._local.admitted.set(count)

    def leg_started(self, role: Role, instance: str) -> None:
        key = (role, instance)
        legs = self._legs.get(key)
        if legs is None:
            # The gauge's label lookup once per busy period, not twice per leg.
            gauge = self.inflight.labels(role, instance) if self.shared else None
            legs = self._legs[key] = _Legs(gauge)
            self._inflight_sets.add(key)
        legs.count += 1
        if legs.gauge is not None:
            legs.gauge.inc()

    def leg_finished(self, role: Role, instance: str) -> None:
        key = (role, instance)
        legs = self._legs[key]
        legs.count -= 1
        if legs.count:
            if legs.gauge is not None:
                legs.gauge.dec()
            return
        del self._legs[key]
        if instance in self._departed:
            self._remove_inflight(role, instance)
        elif legs.gauge is not None:
            legs.gauge.set(0)

    def instance_joined(self, instance: str) -> None:
        self._departed.discard(instance)

    def instance_left(self, instance: str) -> None:
        """Drop the instance's label sets now, or when its last in-flight leg ends (removing a
        gauge that is still decremented later would resurrect it at -1)."""
        busy = False
        for role in Role:
            if (role, instance) in self._legs:
                busy = True
            else:
                self._remove_inflight(role, instance)
        if busy:
            self._departed.add(instance)
        for pair in [p for p in self._kv_pairs if instance in p]:
            self._kv_pairs.discard(pair)
            if self.shared:
                self.kv_transfer_bandwidth.labels(*pair).set(0)
                continue
            for family in (self.kv_transfer_bytes, self.kv_transfer_bandwidth):
                with contextlib.suppress(KeyError):
                    family.remove(*pair)

    def _remove_inflight(self, role: Role, instance: str) -> None:
        if self.shared:  # a series in the shared files cannot be removed, only zeroed
            if (role, instance) in self._inflight_sets:  # never make a series to zero it
                self.inflight.labels(role, instance).set(0)
        else:
            self._inflight_sets.discard((role, instance))
        if all((r, instance) not in self._legs for r in Role):
            self._departed.discard(instance)

    def watch_circuits(self, circuits: Callable[[], Mapping[str, Circuit]]) -> None:
        """Export each instance's circuit (0 closed, 1 half-open, 2 open), read at scrape
        time from the outlier detector, so it never outlives the instance."""
        self._circuit_states.circuits = circuits

    def leg_failed(self, role: Role, kind: FailureKind) -> None:
        """Count a leg's failure: an upstream error, or the proxy's own saturation."""
        if FAILURES[kind].origin is Origin.LOCAL:
            self.saturated_legs.labels(role).inc()
        else:
            self.upstream_errors.labels(role, kind.value).inc()

    def render(self) -> bytes:
        return generate_latest(self.exposed)


class _LocalValues:
    """The local values of the metrics every request updates (one process only)."""

    def __init__(self, metrics: Metrics) -> None:
        self.requests = LocalCounter(metrics.requests, time.time)
        self.request_duration = LocalHistogram(metrics.request_duration, time.time)
        prefill = LocalHistogram(metrics.prefill_duration, time.time)
        decode_first_byte = LocalHistogram(metrics.decode_first_byte, time.time)
        first_token = LocalHistogram(metrics.time_to_first_token, time.time)
        self.prefill = prefill.series(())
        self.decode_first_byte = decode_first_byte.series(())
        self.time_to_first_token = first_token.series(())
        # Registered in the order of their definitions; the admitted gauge comes later.
        self.first = (
            self.requests,
            self.request_duration,
            prefill,
            decode_first_byte,
            first_token,
        )
        self.admitted: LocalGauge  # set once its definition exists


class _Legs:
    """The legs in flight to one instance in one role, and their gauge (shared metrics only)."""

    __slots__ = ("count", "gauge")

    def __init__(self, gauge: Gauge | None) -> None:
        self.count = 0
        self.gauge = gauge


class _InflightCollector(Collector):
    """pdproxy_inflight_legs of one process, read from the leg counts at scrape time."""

    def __init__(
        self, legs: Mapping[tuple[str, str], _Legs], series: Iterable[tuple[str, str]]
    ) -> None:
        self._legs = legs
        self._series = series

    def describe(self) -> list[Metric]:
        return [self._family()]

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        for key in sorted(self._series):
            legs = self._legs.get(key)
            family.add_metric(key, 0 if legs is None else legs.count)
        return [family]

    @staticmethod
    def _family() -> GaugeMetricFamily:
        name, documentation, labels = _INFLIGHT
        return GaugeMetricFamily(name, documentation, labels=labels)


class _CircuitCollector(Collector):
    def __init__(self, circuits: Callable[[], Mapping[str, Circuit]]) -> None:
        self.circuits = circuits

    def describe(self) -> list[Metric]:
        return [self._family()]

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        for upstream, circuit in sorted(self.circuits().items()):
            family.add_metric([upstream], CIRCUIT_LEVEL[circuit])
        return [family]

    @staticmethod
    def _family() -> GaugeMetricFamily:
        name, documentation, labels = _CIRCUIT
        return GaugeMetricFamily(name, documentation, labels=labels)
