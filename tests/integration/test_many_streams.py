"""2,000 concurrent streaming clients held open through a live proxy, with bounded memory.

One `pdproxy serve` and fake workers (1 P + 2 D, the decodes sleeping a second per token so
every stream stays open while the others are being opened) serve 2,000 streaming completions
opened at once from this process. While all of them are held, the proxy's resident memory per
stream must stay under a generous bound; afterwards every stream must be a complete SSE stream,
every in-flight gauge back at 0, and relaying the streams to their end must not have grown the
proxy's memory further.
"""

from __future__ import annotations

import asyncio
import resource
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from pdproxy.demo.fleet import LocalFleet, WorkerSpec
from pdproxy.demo.processes import LOOPBACK, http_get, wait_until
from tests.conftest import FleetFactory
from tests.harness.stream_crowd import (
    CrowdTarget,
    StreamCrowd,
    StreamRecord,
    completion_body,
    open_fds,
    rss_kib,
    sse_events,
    stream_problems,
)

MODEL = "fake-model"
STREAMS = 2000
TOKENS = 25
TOKEN_LATENCY_MS = 1000.0
# A stream lasts TOKENS seconds: opening all of them must take less than that, or the first
# ones would end before the last ones start and fewer than STREAMS would be held at once.
# Measured: 4-9 s on 2 busy cores.
OPEN_TIMEOUT_S = 20.0
FINISH_TIMEOUT_S = 45.0
STREAM_TIMEOUT_S = OPEN_TIMEOUT_S + FINISH_TIMEOUT_S
WARMUP_STREAMS = 50
WARMUP_TOKENS = 2
# A bound that shows memory is bounded, not a tight budget (measured: about 25 KiB).
MAX_KIB_PER_STREAM = 256
# Relaying STREAMS * TOKENS chunks after the measurement may not keep memory: a leak of even
# 1 KiB per chunk (50 MB here) would cross this.
MAX_GROWTH_WHILE_RELAYING_KIB = 32 * 1024
# This process holds one socket per stream, the proxy two (client and decode leg) plus pooled
# prefill connections; the proxy inherits this process's limit.
FDS_NEEDED = 3 * STREAMS + 1024
INFLIGHT = "pdproxy_inflight_legs"


@dataclass(frozen=True)
class Held:
    """The proxy while every stream was open."""

    open_seconds: float
    rss_before_kib: int
    rss_held_kib: int
    proxy_fds: int
    open_streams: int
    decode_inflight: float

    @property
    def kib_per_stream(self) -> float:
        return (self.rss_held_kib - self.rss_before_kib) / STREAMS


@pytest.fixture
def enough_fds() -> Iterator[None]:
    """Raise this process's soft fd limit for the test (the fleet it starts inherits it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < FDS_NEEDED:
        pytest.fail(f"RLIMIT_NOFILE hard limit {hard} is below the {FDS_NEEDED} fds this needs")
    if soft != resource.RLIM_INFINITY and soft < FDS_NEEDED:
        resource.setrlimit(resource.RLIMIT_NOFILE, (FDS_NEEDED, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def inflight_gauges(proxy_url: str) -> dict[str, float]:
    """Every pdproxy_inflight_legs sample in /metrics, by its label text."""
    status, body = http_get(proxy_url + "/metrics", timeout=5)
    assert status == 200
    samples = {}
    for line in body.decode().splitlines():
        if line.startswith(INFLIGHT + "{"):
            labels, _, value = line.removeprefix(INFLIGHT).rpartition(" ")
            samples[labels] = float(value)
    return samples


def decode_inflight(proxy_url: str) -> float:
    return sum(value for labels, value in inflight_gauges(proxy_url).items() if "decode" in labels)


def all_problems(records: list[StreamRecord], tokens: int) -> list[str]:
    return [f"#{r.index}: {p}" for r in records for p in stream_problems(r, tokens)]


def response_id(record: StreamRecord) -> bytes:
    """The id field's bytes in the first event (a cheap look, without parsing JSON)."""
    first = sse_events(bytes(record.body))[0]
    return first.partition(b'"id":')[2].partition(b",")[0]


async def warm_up(target: CrowdTarget) -> None:
    """A few streams first, so imports, pools and caches are in the baseline, not the delta."""
    warmup = CrowdTarget(
        target.host, target.port, target.path, completion_body(MODEL, WARMUP_TOKENS)
    )
    async with StreamCrowd(warmup, WARMUP_STREAMS, STREAM_TIMEOUT_S) as crowd:
        crowd.start()
        await crowd.wait_all_ended(FINISH_TIMEOUT_S)
    assert all_problems(crowd.records, WARMUP_TOKENS) == []


async def hold_streams(fleet: LocalFleet) -> tuple[Held, list[StreamRecord]]:
    """Open STREAMS streams, measure the proxy once all have data, then let them finish."""
    assert fleet.proxy is not None and fleet.proxy_port is not None
    pid = fleet.proxy.pid
    body = completion_body(MODEL, TOKENS)
    target = CrowdTarget(LOOPBACK, fleet.proxy_port, "/v1/completions", body)
    await warm_up(target)
    await asyncio.to_thread(wait_for_idle_gauges, fleet.proxy_url)
    before = rss_kib(pid)
    async with StreamCrowd(target, STREAMS, STREAM_TIMEOUT_S) as crowd:
        crowd.start()
        open_seconds = await crowd.wait_all_streaming(OPEN_TIMEOUT_S)
        held = Held(
            open_seconds=open_seconds,
            rss_before_kib=before,
            rss_held_kib=rss_kib(pid),
            proxy_fds=open_fds(pid),
            open_streams=crowd.open_count(),
            decode_inflight=await asyncio.to_thread(decode_inflight, fleet.proxy_url),
        )
        await crowd.wait_all_ended(FINISH_TIMEOUT_S)
    return held, crowd.records


def wait_for_idle_gauges(proxy_url: str) -> None:
    wait_until(
        lambda: not any(inflight_gauges(proxy_url).values()), 10, "in-flight gauges back at 0"
    )


def test_2000_streams_held_open_with_bounded_memory(
    fleet_factory: FleetFactory, enough_fds: None, capsys: pytest.CaptureFixture[str]
) -> None:
    decode = WorkerSpec("D", token_latency_ms=TOKEN_LATENCY_MS)
    fleet = fleet_factory([WorkerSpec("P"), decode, decode])
    assert fleet.proxy is not None

    held, records = asyncio.run(hold_streams(fleet))

    # All of them at once, in the proxy too: none had ended, each held a decode leg.
    assert held.open_streams == STREAMS, held
    assert held.decode_inflight == STREAMS, held
    assert held.kib_per_stream < MAX_KIB_PER_STREAM, f"{held.kib_per_stream:.1f} KiB: {held}"
    assert all_problems(records, TOKENS) == []
    assert len({response_id(r) for r in records}) == STREAMS  # no stream got another's answer

    gauges = inflight_gauges(fleet.proxy_url)
    assert gauges, "no pdproxy_inflight_legs samples at all"
    wait_for_idle_gauges(fleet.proxy_url)
    rss_after = rss_kib(fleet.proxy.pid)
    assert rss_after - held.rss_held_kib < MAX_GROWTH_WHILE_RELAYING_KIB, (held, rss_after)

    with capsys.disabled():
        print(
            f"\n{STREAMS} streams held: proxy RSS {held.rss_before_kib / 1024:.1f} MiB before, "
            f"{held.rss_held_kib / 1024:.1f} MiB held, {rss_after / 1024:.1f} MiB after: "
            f"{held.kib_per_stream:.1f} KiB per stream; all open after {held.open_seconds:.1f}s; "
            f"{held.proxy_fds} proxy fds"
        )
