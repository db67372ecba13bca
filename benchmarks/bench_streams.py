"""Benchmark: thousands of concurrent SSE streams held open through pdproxy, memory per stream.

Starts a local fleet on 127.0.0.1 (``pdproxy serve`` plus fake P and D workers, each its own
process, from ``pdproxy.demo.fleet``); the decode workers sleep ``--token-latency-ms`` before
each token, so streams stay open. After a small warm-up it reads the proxy's RSS, opens
``--streams`` streaming ``/v1/completions`` requests at once from one event loop (raw asyncio
streams, ``tests.harness.stream_crowd``), and once every stream has its first SSE event reads
the RSS again; then it lets every stream run to ``data: [DONE]``, checks each one, and reads the
RSS a last time. Reports RSS before/held/after, KiB per held stream, the time to open all
streams, and the chunks per second relayed while all were open (with the proxy's CPU per chunk).

When pinning is possible the proxy (all its threads) runs alone on ``--proxy-core``; the fake
workers and this load generator share ``--aux-core``. Every process it starts is stopped by PID
(its process group) in a ``finally`` block, also on Ctrl-C, SIGTERM or failure.

    .venv/bin/python benchmarks/bench_streams.py                        # 2,000 streams, ~40 s
    .venv/bin/python benchmarks/bench_streams.py --streams 10000 --token-latency-ms 5000 \
        --tokens 8                                                      # 10,000 idle streams

Each held stream costs the proxy two file descriptors (the client's socket and the decode leg's)
and one upstream slot: more than about (RLIMIT_NOFILE / 2) streams cannot be held, and more than
``--upstream-max-connections`` (pdproxy's default 4096) wait for a slot and get 503. This script
raises its soft fd limit to the hard one (the children inherit it) and, unless told otherwise,
passes ``--upstream-max-connections`` large enough for the streams asked for.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import os
import platform
import resource
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import checkout_root  # noqa: F401  (puts the checkout on sys.path, for tests.harness)
from arg_types import positive_int
from unwind import run_unwound, write_json_report

from pdproxy.demo.fleet import LocalFleet, WorkerSpec
from pdproxy.demo.processes import LOOPBACK, http_get, wait_until
from tests.harness.stream_crowd import (
    DEFAULT_CONNECT_LIMIT,
    CrowdError,
    CrowdTarget,
    StreamCrowd,
    StreamRecord,
    completion_body,
    open_fds,
    rss_kib,
    sse_event_count,
    stream_problems,
)

MODEL = "fake-model"
PATH = "/v1/completions"
PROXY_DEFAULT_UPSTREAM_SLOTS = 4096  # pdproxy's upstream_max_connections default
SLOT_HEADROOM = 1024  # prefill legs of streams still opening need slots too
FDS_PER_STREAM = 2  # in the proxy: the client's socket and the decode leg's
FD_HEADROOM = 512  # pooled prefill connections, the registry, logs...
WARMUP_STREAMS = 50
WARMUP_TOKENS = 2
IDLE_TIMEOUT_S = 15.0
SHOWN_PROBLEMS = 5


class BenchError(RuntimeError):
    """A failure that ends the benchmark with a message instead of a traceback."""


@dataclass
class Result:
    streams: int
    tokens: int
    token_latency_ms: float
    held_at_once: int  # streams open when the proxy was measured (all of them, normally)
    open_s: float  # start until every stream had its first SSE event
    open_proxy_cpu_s: float  # the proxy's CPU while they were being opened
    open_harness_cpu_s: float  # the fake workers' and the clients' CPU meanwhile
    rss_before_kib: int
    rss_held_kib: int
    rss_after_kib: int
    kib_per_stream: float
    proxy_fds_held: int
    decode_inflight_held: float
    relay_s: float  # from the held measurement until the last stream ended
    chunks_relayed: int  # SSE data events the clients got in that window
    chunks_per_s: float
    steady_s: float  # from the held measurement until the first stream ended: all open
    steady_chunks_per_s: float  # SSE data events relayed per second in that window
    offered_chunks_per_s: float  # what the decode workers generate with every stream open
    steady_proxy_cpu_s: float  # the proxy's CPU in the steady window
    proxy_cpu_us_per_chunk: float | None
    bad_streams: int
    problems: list[str]
    listen_overflows: int | None  # system-wide TcpExt ListenOverflows during the run


# ---- process facts -------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU of process `pid` (all its threads), from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return ticks / os.sysconf("SC_CLK_TCK")


def harness_cpu_seconds(fleet: LocalFleet) -> float:
    """CPU of everything but the proxy: the fake workers and this process (the clients)."""
    workers = sum(cpu_seconds(worker.process.pid) for worker in fleet.workers)
    return workers + time.process_time()


def listen_overflows() -> int | None:
    """The kernel's count of connections dropped because an accept queue was full."""
    with contextlib.suppress(OSError, ValueError):
        lines = Path("/proc/net/netstat").read_text().splitlines()
        for names, values in zip(lines[::2], lines[1::2], strict=False):
            if names.startswith("TcpExt:"):
                table = dict(zip(names.split()[1:], values.split()[1:], strict=True))
                return int(table["ListenOverflows"])
    return None


def raise_fd_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard one (children inherit it); returns the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def pin_process(pid: int, cores: set[int]) -> None:
    """Pin every thread of `pid` (threads already running do not follow the process)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task.name), cores)


def pinning_note(args: argparse.Namespace) -> str | None:
    """None when the cores can be used, else why the run is unpinned."""
    if args.no_pin:
        return "pinning disabled by --no-pin"
    wanted = {args.proxy_core, args.aux_core}
    allowed = os.sched_getaffinity(0)
    if args.proxy_core == args.aux_core or not wanted <= allowed:
        return f"cores {sorted(wanted)} not both available (allowed {sorted(allowed)})"
    return None


# ---- the proxy's metrics -------------------------------------------------------------------


def decode_inflight(proxy_url: str) -> float:
    status, body = http_get(proxy_url + "/metrics", timeout=10)
    if status != 200:
        raise BenchError(f"GET /metrics answered {status}")
    return sum(
        float(line.rpartition(" ")[2])
        for line in body.decode().splitlines()
        if line.startswith("pdproxy_inflight_legs{") and 'role="decode"' in line
    )


def wait_idle(proxy_url: str) -> None:
    wait_until(lambda: decode_inflight(proxy_url) == 0, IDLE_TIMEOUT_S, "no decode leg in flight")


# ---- the measurement -----------------------------------------------------------------------


def stream_seconds(args: argparse.Namespace) -> float:
    tokens: int = args.tokens
    latency_ms: float = args.token_latency_ms
    return tokens * latency_ms / 1000.0


async def warm_up(target: CrowdTarget, args: argparse.Namespace) -> None:
    body = completion_body(MODEL, WARMUP_TOKENS)
    warmup = CrowdTarget(target.host, target.port, target.path, body)
    limit = args.open_timeout + WARMUP_TOKENS * args.token_latency_ms / 1000.0 + 30.0
    async with StreamCrowd(warmup, WARMUP_STREAMS, limit) as crowd:
        crowd.start()
        await crowd.wait_all_ended(limit)
    bad = problems(crowd.records, WARMUP_TOKENS)
    if bad:
        raise BenchError(f"warm-up streams failed: {bad[:SHOWN_PROBLEMS]}")


def problems(records: list[StreamRecord], tokens: int) -> list[str]:
    return [f"#{r.index}: {p}" for r in records for p in stream_problems(r, tokens)]


async def measure(fleet: LocalFleet, args: argparse.Namespace) -> Result:
    assert fleet.proxy is not None and fleet.proxy_port is not None
    pid, url = fleet.proxy.pid, fleet.proxy_url
    target = CrowdTarget(LOOPBACK, fleet.proxy_port, PATH, completion_body(MODEL, args.tokens))
    await warm_up(target, args)
    await asyncio.to_thread(wait_idle, url)
    overflows_before = listen_overflows()
    before = rss_kib(pid)
    limit = args.open_timeout + 2 * stream_seconds(args) + 30.0
    print(f"opening {args.streams} streams ...", flush=True)
    async with StreamCrowd(target, args.streams, limit, args.connect_limit) as crowd:
        cpu_start, harness_start = cpu_seconds(pid), harness_cpu_seconds(fleet)
        crowd.start()
        try:
            open_s = await crowd.wait_all_streaming(args.open_timeout)
        except CrowdError as exc:
            raise BenchError(f"{exc}\n--- proxy log\n{fleet.proxy.log_tail()}") from None
        held, held_at = rss_kib(pid), time.monotonic()
        held_at_once, fds = crowd.open_count(), open_fds(pid)
        cpu_held, chunks_held = cpu_seconds(pid), sse_event_count(crowd.records)
        open_cpu = cpu_held - cpu_start
        open_harness_cpu = harness_cpu_seconds(fleet) - harness_start
        inflight = await asyncio.to_thread(decode_inflight, url)
        print(f"all {args.streams} streaming after {open_s:.2f} s; relaying ...", flush=True)
        await crowd.wait_any_ended(limit)
        # The steady state: every stream still open (ended_at of the first one aside).
        steady_s = time.monotonic() - held_at
        steady_chunks, steady_cpu = sse_event_count(crowd.records), cpu_seconds(pid)
        await crowd.wait_all_ended(limit)
    relay_s = max(r.ended_at or held_at for r in crowd.records) - held_at
    chunks = sse_event_count(crowd.records) - chunks_held
    steady_chunks -= chunks_held
    steady_cpu -= cpu_held
    await asyncio.to_thread(wait_idle, url)
    bad = problems(crowd.records, args.tokens)
    overflows_after = listen_overflows()
    return Result(
        streams=args.streams,
        tokens=args.tokens,
        token_latency_ms=args.token_latency_ms,
        held_at_once=held_at_once,
        open_s=open_s,
        open_proxy_cpu_s=open_cpu,
        open_harness_cpu_s=open_harness_cpu,
        rss_before_kib=before,
        rss_held_kib=held,
        rss_after_kib=rss_kib(pid),
        kib_per_stream=(held - before) / args.streams,
        proxy_fds_held=fds,
        decode_inflight_held=inflight,
        relay_s=relay_s,
        chunks_relayed=chunks,
        chunks_per_s=chunks / relay_s if relay_s > 0 else 0.0,
        steady_s=steady_s,
        steady_chunks_per_s=steady_chunks / steady_s if steady_s > 0 else 0.0,
        offered_chunks_per_s=args.streams * 1000.0 / args.token_latency_ms,
        steady_proxy_cpu_s=steady_cpu,
        proxy_cpu_us_per_chunk=steady_cpu / steady_chunks * 1e6 if steady_chunks else None,
        bad_streams=len({p.split(":", 1)[0] for p in bad}),
        problems=bad[:SHOWN_PROBLEMS],
        listen_overflows=(
            None
            if overflows_before is None or overflows_after is None
            else overflows_after - overflows_before
        ),
    )


# ---- the fleet -----------------------------------------------------------------------------


def proxy_args(args: argparse.Namespace) -> list[str]:
    extra = ["--log-level", "warning"]
    slots = args.upstream_max_connections
    if slots is None and args.streams + SLOT_HEADROOM > PROXY_DEFAULT_UPSTREAM_SLOTS:
        slots = args.streams + SLOT_HEADROOM
    if slots is not None:
        extra += ["--upstream-max-connections", str(slots)]
    return extra + list(args.proxy_arg)


def fleet_specs(args: argparse.Namespace) -> list[WorkerSpec]:
    decode = WorkerSpec("D", token_latency_ms=args.token_latency_ms)
    return [WorkerSpec("P")] * args.prefills + [decode] * args.decodes


def pin_fleet(fleet: LocalFleet, args: argparse.Namespace) -> None:
    assert fleet.proxy is not None
    pin_process(fleet.proxy.pid, {args.proxy_core})
    for worker in fleet.workers:
        pin_process(worker.process.pid, {args.aux_core})
    os.sched_setaffinity(0, {args.aux_core})


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    fd_limit = raise_fd_limit()
    needed = FDS_PER_STREAM * args.streams + FD_HEADROOM
    if needed > fd_limit:
        print(
            f"WARNING: the proxy needs about {needed} file descriptors for {args.streams} "
            f"streams, RLIMIT_NOFILE is {fd_limit}: expect it to run out",
            flush=True,
        )
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdproxy-bench-streams-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    note = pinning_note(args)
    print(f"logs: {log_dir}\npinning: {note or f'proxy on core {args.proxy_core}'}", flush=True)
    fleet = LocalFleet(log_dir, fleet_specs(args), proxy_args(args))
    try:
        fleet.start()
        if note is None:
            pin_fleet(fleet, args)
        result = asyncio.run(measure(fleet, args))
    finally:
        fleet.stop()
    return {"meta": meta(args, fd_limit, note, fleet), "result": asdict(result)}


def meta(
    args: argparse.Namespace, fd_limit: int, note: str | None, fleet: LocalFleet
) -> dict[str, Any]:
    return {
        "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "pinned": note is None,
        "pinning": note or f"proxy on core {args.proxy_core}, the rest on {args.aux_core}",
        "fd_limit": fd_limit,
        "prefills": args.prefills,
        "decodes": args.decodes,
        "connect_limit": args.connect_limit,
        "proxy_args": list(fleet.proxy_args),
    }


# ---- output --------------------------------------------------------------------------------


def report_lines(result: dict[str, Any]) -> list[str]:
    r = result
    mib = 1024.0
    per_chunk = r["proxy_cpu_us_per_chunk"]
    cpu_text = "-" if per_chunk is None else f"{per_chunk:,.0f} us/chunk"
    return [
        f"streams                {r['streams']:,} ({r['tokens']} tokens, one per "
        f"{r['token_latency_ms']:g} ms)",
        f"held at once           {r['held_at_once']:,} (decode legs in flight: "
        f"{r['decode_inflight_held']:,.0f}; proxy fds: {r['proxy_fds_held']:,})",
        f"time to open all       {r['open_s']:.2f} s ({r['streams'] / r['open_s']:,.0f} streams/s;"
        f" CPU: proxy {r['open_proxy_cpu_s'] / r['open_s']:.0%} of a core,"
        f" fake workers + clients {r['open_harness_cpu_s'] / r['open_s']:.0%})",
        f"proxy RSS before       {r['rss_before_kib'] / mib:,.1f} MiB",
        f"proxy RSS held         {r['rss_held_kib'] / mib:,.1f} MiB",
        f"proxy RSS after        {r['rss_after_kib'] / mib:,.1f} MiB",
        f"KiB per held stream    {r['kib_per_stream']:,.1f}",
        f"chunks/s, all open     {r['steady_chunks_per_s']:,.0f} "
        f"(offered {r['offered_chunks_per_s']:,.0f}; over {r['steady_s']:.1f} s)",
        f"chunks/s, to the end   {r['chunks_per_s']:,.0f} "
        f"({r['chunks_relayed']:,} chunks in {r['relay_s']:.1f} s, streams ending)",
        f"proxy CPU, all open    {r['steady_proxy_cpu_s']:.1f} s "
        f"({cpu_text}, {r['steady_proxy_cpu_s'] / max(r['steady_s'], 1e-9):.0%} of a core)",
        f"bad streams            {r['bad_streams']:,} {r['problems'] or ''}",
        f"listen overflows       {r['listen_overflows']} (system-wide, whole run)",
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Hold many concurrent SSE streams open through pdproxy; memory per stream."
    )
    add = parser.add_argument
    add("--streams", type=positive_int, default=2000, help="concurrent streams (default 2000)")
    add("--tokens", type=positive_int, default=20, help="tokens per stream (default 20)")
    add("--token-latency-ms", type=float, default=1000.0, help="decode sleep per token")
    add("--prefills", type=positive_int, default=1, help="fake prefill workers (default 1)")
    add("--decodes", type=positive_int, default=2, help="fake decode workers (default 2)")
    add(
        "--connect-limit",
        type=positive_int,
        default=DEFAULT_CONNECT_LIMIT,
        help=f"connections being opened at once (default {DEFAULT_CONNECT_LIMIT})",
    )
    add("--open-timeout", type=float, default=120.0, help="seconds to open all (default 120)")
    add(
        "--upstream-max-connections",
        type=positive_int,
        default=None,
        help="the proxy's upstream slots (default: its own, or streams + "
        f"{SLOT_HEADROOM} when more are needed)",
    )
    add("--proxy-arg", action="append", default=[], help="extra `pdproxy serve` argument")
    add("--proxy-core", type=int, default=0)
    add("--aux-core", type=int, default=1, help="core of the fake workers and this client")
    add("--no-pin", action="store_true", help="do not pin processes to cores")
    add("--log-dir", default=None, help="child logs (default: a new temp dir)")
    add("--json", default=None, metavar="PATH", help="also write the results here")
    args = parser.parse_args(argv)
    if args.token_latency_ms <= 0 or args.open_timeout <= 0:
        parser.error("--token-latency-ms and --open-timeout must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run_unwound(
        lambda: run_bench(args), (BenchError, CrowdError, TimeoutError, RuntimeError)
    )
    result = report["result"]
    print()
    print("\n".join(report_lines(result)))
    if result["held_at_once"] < result["streams"]:
        print("\nNOTE: some streams ended before all were open: raise --tokens")
    if not report["meta"]["pinned"]:
        print(f"\nNOTE: unpinned: {report['meta']['pinning']}")
    if args.json:
        write_json_report(args.json, report)
    return 1 if result["bad_streams"] else 0


if __name__ == "__main__":
    sys.exit(main())
