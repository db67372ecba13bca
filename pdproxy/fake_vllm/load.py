"""The load a fake worker announces: measured from the requests it is generating, or forced by
a test (POST /_fake/load) so routing policies can be checked without real traffic."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from pdproxy.fake_vllm.http_json import ApiError
from pdproxy.registry.messages import Load, known_fields
from pdproxy.vllm_side.vllm_metrics import KV_USAGE, RUNNING, WAITING


@dataclass(frozen=True, slots=True)
class ForcedLoad:
    """Fields a test fixed; None keeps the measured value."""

    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    prefill_tokens: int | None = None


class Share:
    """One request's part of the load: its prompt and the tokens generated so far."""

    def __init__(self, tracker: LoadTracker, tokens: int) -> None:
        self._tracker = tracker
        self.tokens = tokens

    def generated(self, tokens: int) -> None:
        self.tokens += tokens
        self._tracker.tokens += tokens


class LoadTracker:
    def __init__(self, capacity_tokens: int, counts_prefill_work: bool = False) -> None:
        self.capacity_tokens = capacity_tokens
        self.running = 0
        self.peak_running = 0  # the most requests ever running at once (tests check caps)
        self.tokens = 0  # KV held by in-flight requests: prompt plus generated tokens
        # A prefill's work, as pdproxy's connector announces it: here every prompt in flight
        # (the fake computes nothing, so none is part-way done).
        self._counts_prefill_work = counts_prefill_work
        self.prompt_tokens = 0
        self.forced = ForcedLoad()

    @contextlib.contextmanager
    def occupy(self, prompt_tokens: int) -> Iterator[Share]:
        """Count a request as running, holding its tokens' KV, until it ends in any way."""
        share = Share(self, prompt_tokens)
        self.running += 1
        self.peak_running = max(self.peak_running, self.running)
        self.tokens += prompt_tokens
        self.prompt_tokens += prompt_tokens
        try:
            yield share
        finally:
            self.running -= 1
            self.tokens -= share.tokens
            self.prompt_tokens -= prompt_tokens

    def measured(self) -> Load:
        # Nothing queues in the fake: every admitted request runs at once, so waiting is 0.
        usage = min(1.0, max(0.0, self.tokens / self.capacity_tokens))
        work = self.prompt_tokens if self._counts_prefill_work else None
        return Load(running=self.running, waiting=0, kv_usage=usage, prefill_tokens=work)

    def announced(self) -> Load:
        measured, forced = self.measured(), self.forced
        return Load(
            running=measured.running if forced.running is None else forced.running,
            waiting=measured.waiting if forced.waiting is None else forced.waiting,
            kv_usage=measured.kv_usage if forced.kv_usage is None else forced.kv_usage,
            prefill_tokens=(
                measured.prefill_tokens if forced.prefill_tokens is None else forced.prefill_tokens
            ),
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "announced": known_fields(self.announced()),
            "measured": known_fields(self.measured()),
            "forced": asdict(self.forced),
            "capacity_tokens": self.capacity_tokens,
            "peak_running": self.peak_running,
        }


def count(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ApiError(400, f"{name} must be a non-negative integer or null", name)
    return value


def parse_forced_load(body: dict[str, Any]) -> ForcedLoad:
    """The whole forced load is replaced: an absent or null field means "measured"."""
    unknown = set(body) - {"running", "waiting", "kv_usage", "prefill_tokens"}
    if unknown:
        raise ApiError(400, f"unknown load fields {sorted(unknown)}")
    usage = body.get("kv_usage")
    if usage is not None and (
        not isinstance(usage, int | float) or isinstance(usage, bool) or not 0.0 <= usage <= 1.0
    ):
        raise ApiError(400, "kv_usage must be a number in 0..1 or null", "kv_usage")
    return ForcedLoad(
        count(body, "running"),
        count(body, "waiting"),
        None if usage is None else float(usage),
        count(body, "prefill_tokens"),
    )


# vLLM's own names for the gauges `pdproxy announce` scrapes (vllm_side/vllm_metrics.py), so
# the sidecar can be tried against a fake worker as against a real server.
_GAUGES = (
    (RUNNING, "Number of requests in model execution batches.", "running"),
    (WAITING, "Number of requests waiting to be processed.", "waiting"),
    (KV_USAGE, "KV-cache usage. 1 means 100 percent usage.", "kv_usage"),
)


def vllm_metrics_text(load: Load, model: str) -> str:
    labels = f'{{engine="0",model_name="{_escaped(model)}"}}'
    lines = []
    for name, meaning, field_name in _GAUGES:
        value = getattr(load, field_name)
        lines += [f"# HELP {name} {meaning}", f"# TYPE {name} gauge"]
        if value is not None:
            lines.append(f"{name}{labels} {float(value)}")
    return "\n".join(lines) + "\n"


def _escaped(label: str) -> str:
    return label.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
