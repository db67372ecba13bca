"""Lock-free values for the metrics every request updates, in a process that serves alone.

prometheus_client guards each value with a lock and finds a histogram's bucket with a Python
loop over its bounds, on every request (docs/performance.md, "Per-request metrics"). One
process that updates and scrapes its metrics on one event loop needs neither (`/metrics` is
rendered on that loop). So there the request counter, the latency histograms and the admitted
gauge count into plain numbers that a collector exposes at scrape time; with several workers
prometheus_client's own values stay, because they write to the shared files.

Each family is made from its prometheus_client definition (name, help, labels, buckets), and its
samples come out as that object's would: the same names, labels, order and `_created` series.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class LocalCount:
    __slots__ = ("created", "value")

    def __init__(self, created: float) -> None:
        self.value = 0.0
        self.created = created


class LocalBuckets:
    """One histogram series: a count per bucket (the last is +Inf) and the sum."""

    __slots__ = ("_bounds", "counts", "created", "total")

    def __init__(self, bounds: tuple[float, ...], created: float) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.created = created

    def observe(self, value: float) -> None:
        # bisect_left: the first bound >= value, i.e. the smallest `le` bucket holding it.
        self.counts[bisect_left(self._bounds, value)] += 1
        self.total += value


class _LocalFamily(Collector):
    """Registered where prometheus_client's object would be, so /metrics keeps its order."""

    def __init__(self, definition: Counter | Histogram | Gauge) -> None:
        self.definition = definition
        # prometheus_client's switch (PROMETHEUS_DISABLE_CREATED_SERIES), read as it reads it.
        self._with_created = bool(prometheus_metrics._use_created)

    def _empty(self) -> Metric:
        d = self.definition
        return Metric(d._name, d._documentation, d._type, d._unit)

    def describe(self) -> list[Metric]:
        return [self._empty()]


class LocalCounter(_LocalFamily):
    """A counter family keyed by its label values. `clock`: wall-clock time, for `_created`."""

    def __init__(self, definition: Counter, clock: Callable[[], float]) -> None:
        super().__init__(definition)
        self._clock = clock
        self._series: dict[tuple[str, ...], LocalCount] = {}

    def inc(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        series = self._series.get(labels)
        if series is None:
            series = self._series[labels] = LocalCount(self._clock())
        series.value += amount

    def collect(self) -> list[Metric]:
        d = self.definition
        metric = self._empty()
        for labels, series in list(self._series.items()):
            names = dict(zip(d._labelnames, labels, strict=True))
            metric.add_sample(d._name + "_total", names, series.value)
            if self._with_created:
                metric.add_sample(d._name + "_created", names, series.created)
        return [metric]


class LocalHistogram(_LocalFamily):
    """A histogram family keyed by its label values; one without labels exists from the start,
    as prometheus_client's does."""

    def __init__(self, definition: Histogram, clock: Callable[[], float]) -> None:
        super().__init__(definition)
        self._clock = clock
        # The definition's bounds end with +Inf; the counts have a slot for it already.
        self._bounds = tuple(definition._upper_bounds[:-1])
        # The `le` label of each bucket, written as prometheus_client writes it.
        self._les: list[str] = [
            floatToGoString(bound)  # type: ignore[no-untyped-call]
            for bound in definition._upper_bounds
        ]
        self._series: dict[tuple[str, ...], LocalBuckets] = {}
        if not definition._labelnames:
            self.series(())

    def series(self, labels: tuple[str, ...]) -> LocalBuckets:
        series = self._series.get(labels)
        if series is None:
            series = self._series[labels] = LocalBuckets(self._bounds, self._clock())
        return series

    def collect(self) -> list[Metric]:
        d = self.definition
        metric = self._empty()
        for labels, series in list(self._series.items()):
            names = dict(zip(d._labelnames, labels, strict=True))
            cumulative = 0
            for le, count in zip(self._les, list(series.counts), strict=True):
                cumulative += count
                metric.add_sample(d._name + "_bucket", {**names, "le": le}, cumulative)
            metric.add_sample(d._name + "_count", names, cumulative)
            metric.add_sample(d._name + "_sum", names, series.total)
            if self._with_created:
                metric.add_sample(d._name + "_created", names, series.created)
        return [metric]


class LocalGauge(_LocalFamily):
    """A gauge without labels: set, or read from `reader` at scrape time when one is given."""

    def __init__(self, definition: Gauge) -> None:
        super().__init__(definition)
        self.value = 0.0
        self.reader: Callable[[], float] | None = None

    def set(self, value: float) -> None:
        self.value = value

    def collect(self) -> list[Metric]:
        metric = self._empty()
        value = self.value if self.reader is None else self.reader()
        metric.add_sample(self.definition._name, {}, value)
        return [metric]
