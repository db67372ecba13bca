"""A vLLM server's load, read from its own Prometheus text. Pure: text in, load out.

Absent metrics are tolerated (older or newer vLLM, a server still starting): the field is
then unknown. Several engines (data parallel) each report a series: counts add up, and the
KV usage is the fullest engine's, since that is the one a new request may queue on.
"""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from pdproxy.registry.messages import Load

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"  # a fraction in [0, 1] despite its name


class MetricsFormatError(ValueError):
    pass


def load_from_metrics(text: str) -> Load:
    values: dict[str, list[float]] = {RUNNING: [], WAITING: [], KV_USAGE: []}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                # NaN or Inf says nothing about load: such a sample is as good as absent.
                if sample.name in values and math.isfinite(sample.value):
                    values[sample.name].append(float(sample.value))
    except ValueError as exc:
        raise MetricsFormatError(f"not Prometheus text: {exc}") from None
    running, waiting, usage = values[RUNNING], values[WAITING], values[KV_USAGE]
    return Load(
        running=_count(running),
        waiting=_count(waiting),
        kv_usage=min(1.0, max(0.0, *usage)) if usage else None,
    )


def _count(samples: list[float]) -> int | None:
    return max(0, round(sum(samples))) if samples else None
