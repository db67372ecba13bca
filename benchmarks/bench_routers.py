"""Side-by-side benchmark: pdproxy vs. vllm-router vs. sglang-router (and nginx, a C reference)
in P/D mode, round robin.

Layout (2 cores): the router under test runs alone on core 0 (``taskset -c 0``); the two fast
fake backends (one prefill, one decode: ``fast_backend.py``), the load generator
(``loadgen.py``) and this script (the idle-stream clients) share core 1. Each router is started
with a pair of the same backends of its own, pointed at them in P/D (prefill/decode
disaggregation) mode with round robin for prefill and decode, and checked (an OpenAI-shaped 200
through P and D, both backends saw the request); then they are measured in turn, ``--rounds``
times (a VM's speed drifts by more than routers differ: ratios are taken within a round, and
the tables give the rounds' medians).

For every router (and a ``direct`` baseline: the load generator straight at the decode
backend) it measures

* non-streaming ``POST /v1/completions`` at each ``--concurrency`` (default 1, 64, 256):
  req/s, p50, p99, the router's CPU per request and the ratio to vllm-router's req/s;
* streaming (``--stream-tokens`` SSE events per answer, default 256) at
  ``--stream-concurrency`` streams (default 64): SSE chunks/s relayed, time to first byte
  (p50/p99), the router's CPU per chunk and the ratio of chunks/s to vllm-router's;
* ``--idle-streams`` (default 10,000) concurrent streams held open (the decode backend sends a
  token every ``--idle-interval-ms``): the RSS of the router's process group per held stream.

With ``nginx`` among ``--routers``, every ratio (speed, and CPU per request or chunk) is also
given to nginx's in the same round: nginx as a P/D proxy (``nginx_conf``: the prefill leg an
``auth_request`` subrequest, then the client's request proxied to decode), the cost of relaying
the same legs in C with no Python and no router logic.

The Rust routers come from PyPI, pinned, in their own venv (``router_env.py``; created on first
use); nginx is Debian's package, unpacked into a cache directory (``nginx_env.py``). Every
process it starts runs in its own process group and is stopped by PID (group) in a ``finally``
block, also on Ctrl-C, SIGTERM or failure. Everything binds 127.0.0.1.

    .venv/bin/python benchmarks/bench_routers.py [--duration 10] [--idle-streams 10000] \
        [--routers pdproxy,vllm-router,sglang-router,nginx] [--json benchmarks/results/routers.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import math
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import checkout_root  # noqa: F401  (puts the checkout on sys.path, for tests.harness)
from arg_types import positive_int, positive_ints
from bench_proxy import (
    _PREEXEC,
    BACKEND_START_TIMEOUT_S,
    BENCH_DIR,
    BODY,
    HOST,
    PATH,
    REPO_ROOT,
    BenchError,
    Pinning,
    ProcessGroup,
    Started,
    group_sys_and_switches,
    http_request,
    loadgen_result,
)
from bench_proxy import _cpu_model as cpu_model
from bench_proxy import _free_ports as free_ports
from bench_proxy import _git_rev as git_rev
from bench_proxy import _group_cpu_seconds as group_cpu_seconds
from bench_proxy import _log_tail as log_tail
from bench_proxy import _pinning as pinning
from bench_proxy import _wait_http_ok as wait_http_ok
from bench_streams import PROXY_DEFAULT_UPSTREAM_SLOTS, SLOT_HEADROOM, listen_overflows
from bench_streams import raise_fd_limit as raise_soft_fd_limit
from fast_backend import MAX_STREAM_EVENTS
from nginx_env import NginxEnv, NginxEnvError
from router_env import ROUTER_PINS, RouterEnv, RouterEnvError
from unwind import run_unwound, write_json_report

from tests.harness.stream_crowd import (
    DEFAULT_CONNECT_LIMIT,
    CrowdError,
    CrowdTarget,
    StreamCrowd,
    open_fds,
    rss_kib,
    sse_event_count,
)

ROUTERS = ("pdproxy", "pdproxy-compiled", "vllm-router", "sglang-router", "nginx")
PDPROXIES = ("pdproxy", "pdproxy-compiled")
RUST_ROUTERS = ("vllm-router", "sglang-router")
DEFAULT_ROUTERS = ("pdproxy", "vllm-router", "sglang-router")
# `make compiled`: a copy of the checkout with the hot path compiled by mypyc (setup.py).
COMPILED_TREE = REPO_ROOT / "build" / "compiled"
BASELINE = "vllm-router"  # ratios are against this router
REFERENCE = "nginx"  # ... and against this C reference, when it runs
# nginx's own limits that the other routers do not have: a connection closed after 1,000
# requests (client side and upstream), an upstream read timing out after 60 s of quiet.
NGINX_KEEPALIVE_REQUESTS = 1_000_000
NGINX_READ_TIMEOUT = "1h"
# Idle connections cached per upstream: at least the largest concurrency, since with fewer
# nginx closes the connections beyond it after each answer and opens new ones (at c=256 with 64
# the decode leg reconnected for about a third of the requests).
NGINX_UPSTREAM_KEEPALIVE = 64
NGINX_MIN_CONNECTIONS = 4096
NGINX_CONNECTIONS_PER_REQUEST = 3  # the client's, the decode leg's, the prefill leg's
MODEL = "bench"
PDPROXY_DEFAULT_MAX_INFLIGHT = 10_000  # pdproxy's --max-inflight-requests default
VLLM_ROUTER_DEFAULT_MAX_CONCURRENT = 32_768  # vllm-router's --max-concurrent-requests default
ROUTER_START_CHECK = 1  # seconds between the Rust routers' worker checks at startup
ROUTER_WORKER_TIMEOUT = 30  # seconds they wait for the workers at startup
SMOKE_TOKENS = 4
IDLE_WARMUP_STREAMS = 50
IDLE_WARMUP_INTERVAL_MS = 50
IDLE_DRAIN_TIMEOUT_S = 15.0  # how long the backend's streams may take to close after clients left
FD_HEADROOM = 4096  # asked for beyond 3 per idle stream (router 2, and the backend or client 1)
FDS_PER_STREAM = 2  # in the router: the client's socket and the decode leg's
FD_RESERVE = 3000  # the router's other descriptors: pooled prefill connections (SGLang: one per
# prefill request in flight, thousands while streams open), listeners, logs
PROXY_ENV_VARS = (
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
)


# ---- processes and /proc ---------------------------------------------------------------------


def group_pids(pgid: int) -> list[int]:
    """Live processes of process group ``pgid``."""
    pids: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def group_rss_kib(pgid: int) -> int:
    total = 0
    for pid in group_pids(pgid):
        with contextlib.suppress(OSError, ValueError):
            total += rss_kib(pid)
    return total


def group_fds(pgid: int) -> int:
    total = 0
    for pid in group_pids(pgid):
        with contextlib.suppress(OSError):
            total += open_fds(pid)
    return total


def raise_fd_limit(wanted: int) -> int:
    """RLIMIT_NOFILE up to ``wanted`` if allowed (raising the hard limit needs
    CAP_SYS_RESOURCE), else soft = hard; children inherit it. Returns the new soft limit."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if wanted > hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, wanted))
            return wanted
    return raise_soft_fd_limit()


def idle_streams_that_fit(fd_limit: int, reserve: int) -> int:
    """Streams a router can hold: two descriptors each (the client's and the decode leg's)."""
    return max(1, (fd_limit - reserve) // FDS_PER_STREAM)


def backend_stats(port: int) -> dict[str, int]:
    status, raw = http_request("GET", port, "/bench/stats", timeout=5.0)
    if status != 200:
        raise BenchError(f"GET /bench/stats on port {port} answered {status}")
    stats: dict[str, int] = json.loads(raw)
    return stats


# ---- the fleet ---------------------------------------------------------------------------------


@dataclass
class Backends:
    prefill: Started
    decode: Started
    prefill_port: int
    decode_port: int

    def stop(self, group: ProcessGroup) -> None:
        group.stop(self.decode)
        group.stop(self.prefill)

    def stats(self) -> dict[str, dict[str, int]]:
        return {
            "prefill": backend_stats(self.prefill_port),
            "decode": backend_stats(self.decode_port),
        }


def pdproxy_launcher(name: str, python: str) -> list[str]:
    """`python -m pdproxy` of this checkout, or of its compiled copy (-P: the benchmark's
    children run in the checkout, whose directory would otherwise come first on sys.path)."""
    if name == "pdproxy":
        return [python, "-m", "pdproxy"]
    return ["env", f"PYTHONPATH={COMPILED_TREE}", python, "-P", "-m", "pdproxy"]


def check_compiled_tree(python: str) -> str:
    """The compiled copy's build description; BenchError when it is missing or not compiled."""
    argv = [*pdproxy_launcher("pdproxy-compiled", python), "--version"]
    try:
        out = subprocess.run(
            argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        raise BenchError(f"{shlex.join(argv)} failed: {exc}") from None
    if "compiled with mypyc" not in out:
        raise BenchError(f"{COMPILED_TREE} is not a compiled build ({out!r}): run `make compiled`")
    return out


def router_argv(
    name: str, args: argparse.Namespace, env: RouterEnv | None, backends: Backends, ports: list[int]
) -> list[str]:
    """The command that starts router ``name`` on ``ports[0]`` (the others: its side ports)."""
    port = str(ports[0])
    prefill_url = f"http://{HOST}:{backends.prefill_port}"
    decode_url = f"http://{HOST}:{backends.decode_port}"
    wanted_streams = 0 if args.skip_idle else args.idle_streams + SLOT_HEADROOM
    if name in PDPROXIES:
        argv = [
            *pdproxy_launcher(name, args.python), "serve",
            "--host", HOST,
            "--port", port,
            "--registry-bind", f"tcp://{HOST}:{ports[1]}",
            "--prefill", f"http={HOST}:{backends.prefill_port},zmq={HOST}:{ports[2]}",
            "--decode", f"http={HOST}:{backends.decode_port},zmq={HOST}:{ports[3]}",
            "--prefill-policy", "round_robin",
            "--decode-policy", "round_robin",
            "--log-level", "warning",
        ]  # fmt: skip
        if wanted_streams > PROXY_DEFAULT_UPSTREAM_SLOTS:
            argv += ["--upstream-max-connections", str(wanted_streams)]
        if wanted_streams > PDPROXY_DEFAULT_MAX_INFLIGHT:
            argv += ["--max-inflight-requests", str(wanted_streams)]
        if args.pdproxy_workers > 1:
            argv += ["--workers", str(args.pdproxy_workers)]
        return argv
    assert env is not None
    common = [
        "--host", HOST,
        "--port", port,
        "--prefill", prefill_url,
        "--decode", decode_url,
        "--policy", "round_robin",
        "--prefill-policy", "round_robin",
        "--decode-policy", "round_robin",
        "--prometheus-host", HOST,
        "--prometheus-port", str(ports[1]),
        "--worker-startup-timeout-secs", str(ROUTER_WORKER_TIMEOUT),
        "--worker-startup-check-interval", str(ROUTER_START_CHECK),
    ]  # fmt: skip
    if name == "vllm-router":
        argv = [str(env.bin("vllm-router")), "--vllm-pd-disaggregation", *common]
        argv += ["--log-level", "warning"]
        if wanted_streams > VLLM_ROUTER_DEFAULT_MAX_CONCURRENT:
            argv += ["--max-concurrent-requests", str(wanted_streams)]
        return argv
    if name == "sglang-router":
        argv = [str(env.python), "-m", "sglang_router.launch_router", "--pd-disaggregation"]
        return [*argv, *common, "--log-level", "warn"]  # no concurrency cap by default
    raise BenchError(f"unknown router {name!r}")


# The prefill leg's body: nginx cannot put the client's body into an auth subrequest, so it sends
# a fixed one-token request (the prefill backend answers one token whatever it is asked). nginx
# reads only the head of an auth subrequest's answer and then closes the upstream connection
# when the answer has a body, so the prefill leg opens a connection per request (keepalive does
# not help there); the decode leg reuses its connections.
NGINX_PREFILL_BODY = {"model": MODEL, "prompt": "hello world", "max_tokens": 1, "stream": False}


def nginx_conf(
    prefix: Path,
    port: int,
    prefill_port: int,
    decode_port: int,
    worker_connections: int,
    keepalive: int = NGINX_UPSTREAM_KEEPALIVE,
) -> str:
    """An nginx configuration that proxies like the P/D routers: per ``POST /v1/completions`` a
    prefill leg (an ``auth_request`` subrequest: the client's request waits for its 2xx), then
    the client's request to decode, relayed as it arrives. Everything it writes stays under
    ``prefix``; the error log goes to stderr (the child's log file)."""
    body = json.dumps(NGINX_PREFILL_BODY, separators=(",", ":"))
    assert "'" not in body  # single-quoted in the configuration
    temp = "\n".join(
        f"    {kind}_temp_path {prefix / kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    upstreams = "\n".join(
        f"    upstream {role} {{\n"
        f"        server {HOST}:{upstream_port};\n"
        f"        keepalive {keepalive};\n"
        f"        keepalive_requests {NGINX_KEEPALIVE_REQUESTS};\n"
        "    }"
        for role, upstream_port in (("prefill", prefill_port), ("decode", decode_port))
    )
    return f"""\
daemon off;
master_process on;
worker_processes 1;
error_log stderr warn;
pid {prefix / "nginx.pid"};

events {{
    worker_connections {worker_connections};
}}

http {{
    access_log off;
    keepalive_requests {NGINX_KEEPALIVE_REQUESTS};
{temp}

{upstreams}

    server {{
        listen {HOST}:{port};

        location = /readiness {{
            return 200;
        }}

        location = {PATH} {{
            auth_request /_prefill;
            proxy_pass http://decode;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout {NGINX_READ_TIMEOUT};
        }}

        location = /_prefill {{
            internal;
            proxy_pass http://prefill{PATH};
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_method POST;
            proxy_pass_request_headers off;
            proxy_set_header Content-Type application/json;
            proxy_set_body '{body}';
        }}

        location / {{
            return 404;
        }}
    }}
}}
"""


def nginx_busiest(args: argparse.Namespace) -> int:
    """The most requests the load runs keep in flight at once."""
    busiest: int = max([*args.concurrency, 0 if args.skip_stream else args.stream_concurrency])
    return busiest


def nginx_worker_connections(args: argparse.Namespace) -> int:
    """Connections nginx's worker may hold: three per request in flight, and two per idle
    stream plus the descriptors the other routers are allowed beside them."""
    wanted = NGINX_CONNECTIONS_PER_REQUEST * nginx_busiest(args) + 1024
    if not args.skip_idle:
        wanted = max(wanted, FDS_PER_STREAM * (args.idle_streams + SLOT_HEADROOM) + args.fd_reserve)
    return max(NGINX_MIN_CONNECTIONS, wanted)


def nginx_argv(
    nginx: NginxEnv, args: argparse.Namespace, backends: Backends, port: int, prefix: Path
) -> list[str]:
    """Write nginx's configuration under ``prefix`` and return the command that runs it in the
    foreground (its master and one worker, one process group)."""
    prefix.mkdir(parents=True, exist_ok=True)
    conf = prefix / "nginx.conf"
    conf.write_text(
        nginx_conf(
            prefix,
            port,
            backends.prefill_port,
            backends.decode_port,
            nginx_worker_connections(args),
            max(NGINX_UPSTREAM_KEEPALIVE, nginx_busiest(args)),
        ),
        encoding="utf-8",
    )
    return [*nginx.env_prefix(), str(nginx.binary), "-p", str(prefix), "-c", str(conf)]


def ready_path(name: str) -> str:
    return "/ready" if name in PDPROXIES else "/readiness"


def start_backends(group: ProcessGroup, pin: Pinning, python: str, owner: str) -> Backends:
    """A fresh prefill + decode pair on new ports for ``owner`` (a router, or ``direct``).

    Fresh ports per router: the thousands of connections an idle-streams run closes stay in
    TIME_WAIT for a minute, and on one destination port they would use up the ephemeral ports
    the next router needs to reach the same backend."""
    prefill_port, decode_port = free_ports(2)
    items: dict[str, Started] = {}
    for role, port in (("prefill", prefill_port), ("decode", decode_port)):
        argv = [
            *pin.prefix(pin.aux_core),
            python,
            str(BENCH_DIR / "fast_backend.py"),
            "--host", HOST,
            "--port", str(port),
            "--stream-chunked",  # vLLM and SGLang stream with chunked transfer-encoding
        ]  # fmt: skip
        if role == "prefill":
            argv.append("--prefill")
        items[role] = group.spawn(f"{owner}-backend-{role}", argv)
    for role, item in items.items():
        port = prefill_port if role == "prefill" else decode_port
        wait_http_ok(item, port, "/health", BACKEND_START_TIMEOUT_S)
    return Backends(items["prefill"], items["decode"], prefill_port, decode_port)


def check_router(
    name: str, port: int, item: Started, backends: Backends, timeout_s: float
) -> dict[str, Any]:
    """One plain and one streamed request through the router must answer an OpenAI-shaped 200,
    and both backends must have seen them. Retried (bounded): a router may register its workers
    a moment after it says it is ready."""
    before = backends.stats()
    deadline = time.monotonic() + timeout_s
    body = json.dumps(BODY).encode()
    last = "no answer"
    while True:
        if item.proc.poll() is not None:
            raise BenchError(f"{name} exited with code {item.proc.returncode}" + log_tail(item))
        try:
            status, raw = http_request("POST", port, PATH, body, timeout=10.0)
        except OSError as exc:
            last = f"{type(exc).__name__}: {exc}"
        else:
            if status == 200 and _openai_shaped(raw):
                break
            last = f"HTTP {status}: {raw[:300]!r}"
        if time.monotonic() > deadline:
            raise BenchError(
                f"{name}: no OpenAI-shaped 200 within {timeout_s:g} s ({last})" + log_tail(item)
            )
        time.sleep(0.25)
    stream_body = json.dumps(
        {"model": MODEL, "prompt": "hello world", "max_tokens": SMOKE_TOKENS, "stream": True}
    ).encode()
    status, raw = http_request("POST", port, PATH, stream_body, timeout=10.0)
    events = [e for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    if status != 200 or len(events) != SMOKE_TOKENS + 1 or events[-1] != b"data: [DONE]":
        raise BenchError(
            f"{name}: streamed smoke answer HTTP {status}: {raw[:400]!r}" + log_tail(item)
        )
    if not all(_openai_shaped(e[len(b"data: ") :]) for e in events[:-1]):
        raise BenchError(f"{name}: streamed events are not OpenAI-shaped: {events[0][:300]!r}")
    after = backends.stats()
    seen = {
        role: {key: after[role][key] - before[role][key] for key in after[role]}
        for role in ("prefill", "decode")
    }
    for role in ("prefill", "decode"):
        if seen[role]["completions"] < 2:
            raise BenchError(
                f"{name}: the {role} backend saw {seen[role]['completions']} of the 2 requests"
            )
    return seen


def _openai_shaped(raw: bytes) -> bool:
    try:
        data = json.loads(raw)
    except ValueError:
        return False
    return (
        isinstance(data, dict) and isinstance(data.get("choices"), list) and bool(data["choices"])
    )


# ---- closed-loop load (loadgen.py) -------------------------------------------------------------


def run_loadgen(
    group: ProcessGroup,
    pin: Pinning,
    args: argparse.Namespace,
    *,
    label: str,
    port: int,
    body: dict[str, Any],
    concurrency: int,
    server: Started,
    backends: Backends,
    expect_events: int | None = None,
) -> dict[str, Any]:
    argv = [
        *pin.prefix(pin.aux_core),
        args.python,
        str(BENCH_DIR / "loadgen.py"),
        "--host", HOST,
        "--port", str(port),
        "--path", PATH,
        "--body", json.dumps(body),
        "--concurrency", str(concurrency),
        "--duration", str(args.duration),
        "--warmup", str(args.warmup),
        "--target", label,
        "--json", "-",
    ]  # fmt: skip
    if expect_events is not None:
        argv += ["--sse", "--expect-events", str(expect_events)]
    aux = [backends.prefill.proc.pid, backends.decode.proc.pid]
    server_cpu0 = group_cpu_seconds(server.proc.pid)
    server_sys0 = group_sys_and_switches(server.proc.pid)
    aux_cpu0 = [group_cpu_seconds(pid) for pid in aux]
    started = time.monotonic()
    proc = subprocess.Popen(
        argv,
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # own process group, stopped by PID
        preexec_fn=_PREEXEC,  # noqa: PLW1509 - single-threaded script
    )
    item = Started(f"loadgen-{label}-c{concurrency}", proc, None)
    group.started.append(item)
    try:
        out, err = item.proc.communicate(timeout=args.duration + args.warmup + 60.0)
    except Exception:
        group.stop(item)
        raise
    wall = time.monotonic() - started
    server_cpu1 = group_cpu_seconds(server.proc.pid)
    server_sys1 = group_sys_and_switches(server.proc.pid)
    aux_cpu1 = [group_cpu_seconds(pid) for pid in aux]
    group.stop(item)
    result = loadgen_result(item.proc.returncode, out, err, f"{label} c={concurrency}")
    result["router"] = label
    result["server_cpu_s"] = None
    result["server_cpu_us_per_req"] = None
    result["server_cpu_us_per_chunk"] = None
    if server_cpu0 is not None and server_cpu1 is not None:
        cpu = server_cpu1 - server_cpu0
        result["server_cpu_s"] = cpu
        if result.get("total_ok"):
            result["server_cpu_us_per_req"] = cpu / result["total_ok"] * 1e6
            if expect_events:
                result["server_cpu_us_per_chunk"] = cpu / (result["total_ok"] * expect_events) * 1e6
    result["server_sys_us_per_req"] = result["server_waits_per_req"] = None
    result["server_preempted_per_req"] = None
    if server_sys0 is not None and server_sys1 is not None and result.get("total_ok"):
        ok = result["total_ok"]
        result["server_sys_us_per_req"] = (server_sys1[0] - server_sys0[0]) / ok * 1e6
        result["server_waits_per_req"] = (server_sys1[1] - server_sys0[1]) / ok
        result["server_preempted_per_req"] = (server_sys1[2] - server_sys0[2]) / ok
    aux_cpu = sum((b or 0.0) - (a or 0.0) for a, b in zip(aux_cpu0, aux_cpu1, strict=True)) + (
        result.get("client_cpu_s") or 0.0
    )
    result["aux_cpu_s"] = aux_cpu
    result["aux_busy"] = aux_cpu / wall if wall > 0 else None
    return result


# ---- idle streams ------------------------------------------------------------------------------


def idle_tokens(args: argparse.Namespace) -> int:
    """Tokens per idle stream: enough that none ends before the measurement is over (at most
    what the backend streams)."""
    seconds: float = args.idle_open_timeout + args.idle_hold + 60.0
    interval_ms: int = args.idle_interval_ms
    return min(MAX_STREAM_EVENTS, max(2, math.ceil(seconds * 1000.0 / interval_ms) + 1))


def stream_body(tokens: int, interval_ms: int) -> bytes:
    payload = {
        "model": MODEL,
        "prompt": "hold this stream open",
        "max_tokens": tokens,
        "stream": True,
        "bench_token_interval_ms": interval_ms,
    }
    return json.dumps(payload).encode()


async def _wait_backend_streams(
    backends: Backends, at_most: int, timeout_s: float
) -> tuple[int, float]:
    """Wait (bounded) until the decode backend writes at most ``at_most`` slow streams."""
    started = time.monotonic()
    while True:
        stats = await asyncio.to_thread(backend_stats, backends.decode_port)
        open_now = stats["slow_streams_open"]
        waited = time.monotonic() - started
        if open_now <= at_most or waited > timeout_s:
            return open_now, waited
        await asyncio.sleep(0.1)


async def _sample_fds(pgid: int, peak: list[int]) -> None:
    """Track the router's open descriptors (peak[0]) until cancelled."""
    while True:
        peak[0] = max(peak[0], await asyncio.to_thread(group_fds, pgid))
        await asyncio.sleep(0.2)


async def measure_idle(name: str, target: Target, args: argparse.Namespace) -> dict[str, Any]:
    port, item, backends = target.port, target.server, target.backends
    pgid = item.proc.pid
    n: int = args.idle_streams
    # Warm-up: a few short slow streams, run to the end, so the first-use allocations are done.
    warm = CrowdTarget(HOST, port, PATH, stream_body(2, IDLE_WARMUP_INTERVAL_MS))
    async with StreamCrowd(warm, IDLE_WARMUP_STREAMS, 30.0) as crowd:
        crowd.start()
        await crowd.wait_all_ended(30.0)
    failed = [r for r in crowd.records if r.error or r.status != 200]
    if failed:
        raise BenchError(f"{name}: idle warm-up streams failed: {crowd.describe()}")
    await _wait_backend_streams(backends, 0, IDLE_DRAIN_TIMEOUT_S)
    await asyncio.sleep(0.5)
    rss_before = group_rss_kib(pgid)
    fds_before = group_fds(pgid)
    tokens = idle_tokens(args)
    streams = CrowdTarget(HOST, port, PATH, stream_body(tokens, args.idle_interval_ms))
    limit = args.idle_open_timeout + args.idle_hold + 60.0
    print(f"  opening {n:,} streams through {name} ...", flush=True)
    overflows0 = listen_overflows()
    cpu0 = group_cpu_seconds(pgid) or 0.0
    peak_fds = [0]
    sampler = asyncio.create_task(_sample_fds(pgid, peak_fds))
    async with StreamCrowd(streams, n, limit, args.connect_limit) as crowd:
        crowd.start()
        try:
            open_s = await crowd.wait_all_streaming(args.idle_open_timeout)
        except CrowdError as exc:
            raise BenchError(
                f"{name}: {exc} (router descriptors peaked at {peak_fds[0]:,})" + log_tail(item)
            ) from None
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        hold_cpu0 = group_cpu_seconds(pgid) or 0.0
        open_cpu = hold_cpu0 - cpu0
        rss_open = group_rss_kib(pgid)
        hold_events0 = sse_event_count(crowd.records)
        print(
            f"  all {n:,} streaming after {open_s:.1f} s; holding {args.idle_hold:g} s ...",
            flush=True,
        )
        await asyncio.sleep(args.idle_hold)
        hold_cpu = (group_cpu_seconds(pgid) or 0.0) - hold_cpu0
        hold_events = sse_event_count(crowd.records) - hold_events0
        rss_held = group_rss_kib(pgid)
        fds_held = group_fds(pgid)
        held = crowd.open_count()
        backend_open = (await asyncio.to_thread(backend_stats, backends.decode_port))[
            "slow_streams_open"
        ]
        errors = sum(1 for r in crowd.records if r.error)
        print(f"  all {n:,} streams open; closing them ...", flush=True)
    # Leaving the crowd closed every client connection: the router should close its upstream
    # streams too.
    left_open, drain_s = await _wait_backend_streams(backends, 0, IDLE_DRAIN_TIMEOUT_S)
    overflows1 = listen_overflows()
    await asyncio.sleep(0.5)
    rss_after = group_rss_kib(pgid)
    rss_peak = max(rss_open, rss_held)
    return {
        "router": name,
        "streams": n,
        "tokens_per_stream": tokens,
        "token_interval_ms": args.idle_interval_ms,
        "held_at_once": held,
        "backend_streams_open": backend_open,
        "client_errors": errors,
        "open_s": open_s,
        "open_router_cpu_s": open_cpu,
        "hold_s": args.idle_hold,
        "hold_chunks": hold_events,
        "hold_router_cpu_s": hold_cpu,
        "hold_router_cpu_us_per_chunk": hold_cpu / hold_events * 1e6 if hold_events else None,
        "rss_before_kib": rss_before,
        "rss_open_kib": rss_open,
        "rss_held_kib": rss_held,
        "rss_after_kib": rss_after,
        "kib_per_stream": (rss_peak - rss_before) / n,
        "fds_before": fds_before,
        "fds_held": fds_held,
        "fds_peak": max(peak_fds[0], fds_held),
        "upstream_left_open": left_open,
        "upstream_close_s": drain_s,
        # System-wide count of connections dropped because an accept queue was full.
        "listen_overflows": (
            None if overflows0 is None or overflows1 is None else overflows1 - overflows0
        ),
    }


# ---- the run -----------------------------------------------------------------------------------


def nonstream_body() -> dict[str, Any]:
    return dict(BODY)


def streaming_body(tokens: int, interval_ms: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": "hello world",
        "max_tokens": tokens,
        "stream": True,
    }
    if interval_ms > 0:  # paced: the decode backend writes one event per interval
        body["bench_token_interval_ms"] = interval_ms
    return body


@dataclass
class Target:
    """A started router (or, for ``direct``, the decode backend itself) and its backends."""

    port: int
    server: Started
    backends: Backends


def round_order(names: list[str], round_index: int) -> list[str]:
    """Each round starts one target later, so that no target always runs first (just after the
    idle gap) or just after the same neighbour."""
    shift = round_index % len(names) if names else 0
    return names[shift:] + names[:shift]


def run_target(
    name: str,
    target: Target,
    group: ProcessGroup,
    pin: Pinning,
    args: argparse.Namespace,
    out: dict[str, list[dict[str, Any]]],
    round_index: int,
) -> None:
    for conc in args.concurrency:
        print(
            f"  non-streaming c={conc} ({args.warmup:g} s warm-up + {args.duration:g} s) ...",
            flush=True,
        )
        res = run_loadgen(
            group, pin, args, label=name, port=target.port, body=nonstream_body(),
            concurrency=conc, server=target.server, backends=target.backends,
        )  # fmt: skip
        res["round"] = round_index
        out["nonstream"].append(res)
        _check_alive(name, target.server)
    if not args.skip_stream:
        conc = args.stream_concurrency
        print(f"  streaming {args.stream_tokens} tokens, {conc} streams ...", flush=True)
        body = streaming_body(args.stream_tokens, args.stream_interval_ms)
        res = run_loadgen(
            group, pin, args, label=name, port=target.port, body=body,
            concurrency=conc, server=target.server, backends=target.backends,
            expect_events=args.stream_tokens,
        )  # fmt: skip
        res["round"] = round_index
        out["stream"].append(res)
        _check_alive(name, target.server)


def _check_alive(name: str, item: Started) -> None:
    if item.proc.poll() is not None:
        raise BenchError(
            f"{name} exited with code {item.proc.returncode} during the run" + log_tail(item)
        )


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    for var in PROXY_ENV_VARS:  # the children talk to 127.0.0.1 only
        os.environ.pop(var, None)
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = f"{HOST},localhost"
    pin = pinning(args.router_core, args.aux_core, args.no_pin)
    print(f"pinning: {pin.note}", flush=True)
    if pin.enabled:
        os.sched_setaffinity(0, {pin.aux_core})  # this script holds the idle streams' clients
    fd_limit = raise_fd_limit(0 if args.skip_idle else 3 * args.idle_streams + FD_HEADROOM)
    idle_note = None
    fitting = idle_streams_that_fit(fd_limit, args.fd_reserve)
    if not args.skip_idle and args.idle_streams > fitting:
        idle_note = (
            f"--idle-streams {args.idle_streams:,} capped to {fitting:,}: RLIMIT_NOFILE is "
            f"{fd_limit:,} and cannot be raised here, a router needs {FDS_PER_STREAM} "
            f"descriptors per stream plus {args.fd_reserve:,} (--fd-reserve)"
        )
        print(f"WARNING: {idle_note}", flush=True)
        args.idle_streams_requested = args.idle_streams
        args.idle_streams = fitting
    env: RouterEnv | None = None
    versions: dict[str, str] = {}
    if "pdproxy-compiled" in args.routers:
        print(f"pdproxy-compiled: {check_compiled_tree(args.python)}", flush=True)
    if any(r in RUST_ROUTERS for r in args.routers):
        env = (
            RouterEnv(Path(args.routers_venv), pins=args.pins)
            if args.routers_venv
            else RouterEnv.default(args.pins)
        )
        print(f"router venv: {env.root} ...", flush=True)
        try:
            seconds = env.ensure()
            versions = env.versions()
        except RouterEnvError as exc:
            raise BenchError(f"router install failed: {exc} (log: {env.log_path})") from None
        state = f"installed in {seconds:.0f} s" if seconds else "cached"
        print(
            f"routers: {', '.join(f'{k} {v}' for k, v in sorted(versions.items()))} ({state})",
            flush=True,
        )
    nginx = NginxEnv.default()
    if REFERENCE in args.routers:
        print(f"nginx: {nginx.root} ...", flush=True)
        try:
            seconds = nginx.ensure()
        except NginxEnvError as exc:
            raise BenchError(f"nginx install failed: {exc} (log: {nginx.log_path})") from None
        versions[REFERENCE] = nginx.version()
        state = f"unpacked in {seconds:.0f} s" if seconds else "cached"
        print(f"nginx: {nginx.version()} (Debian package, {state})", flush=True)
    log_dir = (
        Path(args.log_dir)
        if args.log_dir
        else Path(tempfile.mkdtemp(prefix="pdproxy-bench-routers-"))
    )
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"logs: {log_dir}", flush=True)
    load_before = os.getloadavg()

    results: dict[str, list[dict[str, Any]]] = {"nonstream": [], "stream": [], "idle": []}
    commands: dict[str, str] = {}
    nginx_conf_text: str | None = None  # the configuration nginx ran with, for the JSON
    seen: dict[str, Any] = {}
    group = ProcessGroup(log_dir)
    try:
        # Every target is started (and checked) before any is measured, so that the rounds can
        # take turns: a VM's speed drifts by more than the routers differ within minutes, and
        # ratios taken within one round cancel that drift. A router that is not being measured
        # is idle and costs the others nothing.
        targets: dict[str, Target] = {}
        if not args.skip_direct:
            backends = start_backends(group, pin, args.python, "direct")
            targets["direct"] = Target(backends.decode_port, backends.decode, backends)
        for name in args.routers:
            backends = start_backends(group, pin, args.python, name)
            ports = free_ports(4)
            if name == REFERENCE:
                prefix = log_dir / "nginx-prefix"
                command = nginx_argv(nginx, args, backends, ports[0], prefix)
                nginx_conf_text = (prefix / "nginx.conf").read_text(encoding="utf-8")
            else:
                command = router_argv(name, args, env, backends, ports)
            argv = [*pin.prefix(pin.proxy_core), *command]
            commands[name] = shlex.join(argv)
            print(f"{name}: {commands[name]}", flush=True)
            item = group.spawn(name, argv)
            started = time.monotonic()
            wait_http_ok(item, ports[0], ready_path(name), args.ready_timeout)
            seen[name] = check_router(name, ports[0], item, backends, args.ready_timeout)
            print(
                f"  ready after {time.monotonic() - started:.1f} s; smoke check OK "
                f"(prefill saw {seen[name]['prefill']}, decode saw {seen[name]['decode']})",
                flush=True,
            )
            targets[name] = Target(ports[0], item, backends)
        for round_index in range(args.rounds):
            for name in round_order(list(targets), round_index):
                label = f"round {round_index + 1} of {args.rounds}: " if args.rounds > 1 else ""
                print(f"{label}{name}", flush=True)
                run_target(name, targets[name], group, pin, args, results, round_index)
        if not args.skip_idle:
            for name in args.routers:
                target = targets[name]
                results["idle"].append(asyncio.run(measure_idle(name, target, args)))
                _check_alive(name, target.server)
    finally:
        group.stop_all()

    add_ratios(results)
    return {
        "meta": {
            "rounds": args.rounds,
            "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "git_rev": git_rev(),
            "python": platform.python_version(),
            "cpu": cpu_model(),
            "cpu_count": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "pinned": pin.enabled,
            "pinning": pin.note,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "body": BODY,
            "stream_tokens": args.stream_tokens,
            "stream_interval_ms": args.stream_interval_ms,
            "stream_concurrency": args.stream_concurrency,
            "idle_streams": None if args.skip_idle else args.idle_streams,
            "idle_streams_requested": getattr(args, "idle_streams_requested", args.idle_streams),
            "idle_interval_ms": args.idle_interval_ms,
            "fd_limit": fd_limit,
            "idle_streams_note": idle_note,
            "router_versions": versions,
            "router_commands": commands,
            "nginx_conf": nginx_conf_text,
            "smoke_backend_requests": seen,
        },
        "results": results,
        "summary": {kind: summarize(results[kind]) for kind in ("nonstream", "stream")},
    }


# Per kind of run: the speed the ratios compare, and the router's CPU per unit of work.
RATIO_KEYS = {
    "nonstream": ("rps", "server_cpu_us_per_req"),
    "stream": ("events_per_s", "server_cpu_us_per_chunk"),
}


def _ratio(value: Any, base: Any) -> float | None:
    ok = isinstance(value, (int, float)) and isinstance(base, (int, float)) and base > 0
    return value / base if ok else None


def add_ratios(results: dict[str, list[dict[str, Any]]]) -> None:
    """Each run's ratio to the baseline router's run of the same round and concurrency, to
    nginx's (speed, and CPU per request or chunk), and (pdproxy's runs) to the faster Rust
    router's. ``direct`` gets none: its server is the backend, not a router."""
    for kind, (key, cpu_key) in RATIO_KEYS.items():
        base: dict[tuple[int, int], float] = {}
        ref: dict[tuple[int, int], dict[str, Any]] = {}
        fastest: dict[tuple[int, int], float] = {}
        for r in results[kind]:
            when = (r["round"], r["concurrency"])
            if r["router"] == BASELINE:
                base[when] = r[key]
            if r["router"] == REFERENCE:
                ref[when] = r
            if r["router"] in RUST_ROUTERS:
                fastest[when] = max(fastest.get(when, 0.0), r[key])
        for r in results[kind]:
            when = (r["round"], r["concurrency"])
            router = r["router"] != "direct"
            nginx = ref.get(when, {})
            r["vs_baseline"] = _ratio(r[key], base.get(when)) if router else None
            r["vs_nginx"] = _ratio(r[key], nginx.get(key)) if router else None
            r["cpu_vs_nginx"] = _ratio(r.get(cpu_key), nginx.get(cpu_key)) if router else None
            pdproxy = r["router"] in PDPROXIES
            r["vs_fastest_rust"] = _ratio(r[key], fastest.get(when)) if pdproxy else None
    idle = {r["router"]: r["kib_per_stream"] for r in results["idle"]}
    for r in results["idle"]:
        r["vs_baseline"] = _ratio(r["kib_per_stream"], idle.get(BASELINE))
        r["vs_nginx"] = _ratio(r["kib_per_stream"], idle.get(REFERENCE))


# The speed ratios, each with its column's name (the per-round range is given for each).
RATIO_COLUMNS = {
    "vs_baseline": f"vs {BASELINE}",
    "vs_fastest_rust": "vs faster Rust router",
    "vs_nginx": f"vs {REFERENCE}",
}

# The medians a summary row gives over a router's rounds (the ratio's median is the median of
# the per-round ratios, not the ratio of the medians).
SUMMARY_MEDIANS = (
    "rps",
    "p50_ms",
    "p99_ms",
    "events_per_s",
    "ttfb_p50_ms",
    "ttfb_p99_ms",
    "server_cpu_us_per_req",
    "server_cpu_us_per_chunk",
    "server_sys_us_per_req",
    "server_waits_per_req",
    "server_preempted_per_req",
    "aux_busy",
    "vs_baseline",
    "vs_fastest_rust",
    "vs_nginx",
    "cpu_vs_nginx",
)


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (router, concurrency): medians over the rounds, errors summed, and the
    spread of the per-round ratio to the baseline."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["router"], r["concurrency"]), []).append(r)
    summary = []
    for (router, conc), runs in groups.items():
        row: dict[str, Any] = {"router": router, "concurrency": conc, "rounds": len(runs)}
        for key in SUMMARY_MEDIANS:
            values = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
            row[key] = statistics.median(values) if values else None
        row["errors"] = sum(r["errors"] for r in runs)
        for key in RATIO_COLUMNS:
            ratios = [r[key] for r in runs if r.get(key) is not None]
            row[f"{key}_min"] = min(ratios) if ratios else None
            row[f"{key}_max"] = max(ratios) if ratios else None
            row[f"{key}_ahead"] = sum(1 for x in ratios if x > 1.0)
        summary.append(row)
    return summary


# ---- output ------------------------------------------------------------------------------------


def _num(value: Any, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "-"


def _md(header: list[str], rows: list[list[str]]) -> str:
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(" --- " if i == 0 else " ---: " for i in range(len(header))) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _spread(r: dict[str, Any], key: str) -> list[str]:
    """The per-round ratio's range and how many rounds the router was ahead."""
    if r.get(f"{key}_min") is None:
        return ["-", "-"]
    span = f"{r[f'{key}_min']:.2f}-{r[f'{key}_max']:.2f}"
    return [span, f"{r[f'{key}_ahead']} of {r['rounds']}"]


def _ratio_keys(with_nginx: bool) -> tuple[str, ...]:
    return tuple(key for key in RATIO_COLUMNS if with_nginx or key != "vs_nginx")


def _ratios(r: dict[str, Any], rounds: int, with_nginx: bool) -> list[str]:
    """The ratio columns: median ratio to the baseline, to the faster Rust router and to nginx,
    and with several rounds their ranges and the rounds ahead."""
    cells = []
    for key in _ratio_keys(with_nginx):
        cells.append(_num(r.get(key), ".2f"))
        if rounds > 1:
            cells += _spread(r, key)
    return cells


def _ratio_header(rounds: int, with_nginx: bool) -> list[str]:
    header = []
    for key in _ratio_keys(with_nginx):
        name = RATIO_COLUMNS[key]
        header += [name, "range", "rounds ahead"] if rounds > 1 else [name]
    return header


def _cpu_vs_nginx(r: dict[str, Any], with_nginx: bool) -> list[str]:
    return [_num(r.get("cpu_vs_nginx"), ".2f")] if with_nginx else []


def tables(report: dict[str, Any]) -> str:
    res = report["results"]
    summary = report["summary"]
    meta = report["meta"]
    rounds = meta["rounds"]
    median = " (medians of the rounds)" if rounds > 1 else ""
    ran = {r["router"] for kind in ("nonstream", "stream", "idle") for r in res[kind]}
    nginx = REFERENCE in ran  # the columns of ratios to nginx only when it ran
    cpu_header = [f"CPU vs {REFERENCE}"] if nginx else []
    parts: list[str] = []
    if summary["nonstream"]:
        rows = [
            [
                r["router"],
                str(r["concurrency"]),
                _num(r["rps"], ",.0f"),
                _num(r["p50_ms"], ".3f"),
                _num(r["p99_ms"], ".3f"),
                str(r["errors"]),
                *_ratios(r, rounds, nginx),
                _num(r.get("server_cpu_us_per_req"), ",.0f"),
                *_cpu_vs_nginx(r, nginx),
                _num(r.get("server_sys_us_per_req"), ",.0f"),
                _num(r.get("server_waits_per_req"), ".2f"),
                _num(r.get("server_preempted_per_req"), ".2f"),
                _num(r.get("aux_busy"), ".0%"),
            ]
            for r in sorted(
                summary["nonstream"], key=lambda r: (r["concurrency"], _order(r["router"]))
            )
        ]
        header = ["router", "conc", "req/s", "p50 ms", "p99 ms", "errors",
                  *_ratio_header(rounds, nginx), "server CPU us/req", *cpu_header,
                  "of it system us/req", "waits/req", "preempted/req", "aux core busy"]  # fmt: skip
        title = f"### Non-streaming POST /v1/completions{median}"
        parts.append(title + "\n\n" + _md(header, rows))
    if summary["stream"]:
        rows = [
            [
                r["router"],
                str(r["concurrency"]),
                _num(r["events_per_s"], ",.0f"),
                _num(r["rps"], ",.0f"),
                _num(r.get("ttfb_p50_ms"), ".3f"),
                _num(r.get("ttfb_p99_ms"), ".3f"),
                _num(r["p50_ms"], ".3f"),
                _num(r["p99_ms"], ".3f"),
                str(r["errors"]),
                *_ratios(r, rounds, nginx),
                _num(r.get("server_cpu_us_per_chunk"), ",.1f"),
                *_cpu_vs_nginx(r, nginx),
                _num(r.get("aux_busy"), ".0%"),
            ]
            for r in sorted(summary["stream"], key=lambda r: _order(r["router"]))
        ]
        header = ["router", "streams", "chunks/s", "answers/s", "TTFB p50 ms", "TTFB p99 ms",
                  "whole p50 ms", "whole p99 ms", "errors", *_ratio_header(rounds, nginx),
                  "server CPU us/chunk", *cpu_header, "aux core busy"]  # fmt: skip
        pace = meta["stream_interval_ms"]
        how = f"one every {pace} ms" if pace else "written at once by the backend"
        title = f"### Streaming: {meta['stream_tokens']} SSE events per answer, {how}{median}"
        parts.append(title + "\n\n" + _md(header, rows))
    if res["idle"]:
        mib = 1024.0
        rows = [
            [
                r["router"],
                f"{r['held_at_once']:,}",
                _num(r["open_s"], ".1f"),
                _num(r["rss_before_kib"] / mib, ",.1f"),
                _num(max(r["rss_open_kib"], r["rss_held_kib"]) / mib, ",.1f"),
                _num(r["kib_per_stream"], ",.1f"),
                _num(r.get("vs_baseline"), ".2f"),
                *([_num(r.get("vs_nginx"), ".2f")] if nginx else []),
                f"{r['fds_held']:,} ({r['fds_peak']:,})",
                _num(r.get("hold_router_cpu_us_per_chunk"), ",.0f"),
                _num(r["rss_after_kib"] / mib, ",.1f"),
                f"{r['upstream_left_open']:,}",
            ]
            for r in sorted(res["idle"], key=lambda r: _order(r["router"]))
        ]
        header = ["router", "streams held", "open s", "RSS before MiB", "RSS held MiB",
                  "KiB per stream", f"vs {BASELINE}", *([f"vs {REFERENCE}"] if nginx else []),
                  "fds held (peak)", "CPU us/chunk held",
                  "RSS after MiB", "upstream streams left open"]  # fmt: skip
        title = (
            f"### Idle streams: one token every {meta['idle_interval_ms'] / 1000:g} s, RSS of the "
            "router's process group"
        )
        parts.append(title + "\n\n" + _md(header, rows))
    return "\n\n".join(parts)


def _order(name: str) -> int:
    order = ("direct", *ROUTERS)
    return order.index(name) if name in order else len(order)


# ---- CLI ---------------------------------------------------------------------------------------


def _csv_routers(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in ROUTERS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"routers must be among {','.join(ROUTERS)}: {text!r}")
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="pdproxy vs. vllm-router vs. sglang-router and nginx (P/D, round robin), one "
        "core each."
    )
    add = parser.add_argument
    add("--duration", type=float, default=10.0, help="measured seconds per load run (default 10)")
    add("--warmup", type=float, default=2.0, help="unmeasured seconds per load run (default 2)")
    add("--concurrency", type=positive_ints, default=[1, 64, 256],
        help="non-streaming connection counts (default 1,64,256)")  # fmt: skip
    add("--routers", type=_csv_routers, default=list(DEFAULT_ROUTERS),
        help=f"routers to run, in order, among {','.join(ROUTERS)} (default "
        f"{','.join(DEFAULT_ROUTERS)}; pdproxy-compiled needs `make compiled` first; nginx, "
        "the C reference, is Debian's package, fetched on first use)")  # fmt: skip
    add("--stream-tokens", type=positive_int, default=256, help="SSE events per streamed answer")
    add(
        "--stream-interval-ms",
        type=int,
        default=0,
        help="ms between two events of a streamed answer (default 0: all in one write)",
    )
    add(
        "--stream-concurrency",
        type=positive_int,
        default=64,
        help="concurrent streams (default 64)",
    )
    add(
        "--idle-streams",
        type=positive_int,
        default=10_000,
        help="idle streams held (default 10000)",
    )
    add("--idle-interval-ms", type=positive_int, default=5000,
        help="ms between two tokens of an idle stream (default 5000)")  # fmt: skip
    add(
        "--idle-hold", type=float, default=5.0, help="seconds all idle streams are held (default 5)"
    )
    add(
        "--idle-open-timeout",
        type=float,
        default=180.0,
        help="seconds to open them all (default 180)",
    )
    add("--connect-limit", type=positive_int, default=DEFAULT_CONNECT_LIMIT,
        help=f"idle streams being connected at once (default {DEFAULT_CONNECT_LIMIT})")  # fmt: skip
    add(
        "--fd-reserve",
        type=positive_int,
        default=FD_RESERVE,
        help="descriptors a router needs beside 2 per idle stream; --idle-streams is capped to "
        f"fit RLIMIT_NOFILE (default {FD_RESERVE})",
    )
    add("--skip-idle", action="store_true", help="skip the idle-streams part")
    add("--skip-stream", action="store_true", help="skip the streaming part")
    add("--skip-direct", action="store_true", help="skip the direct baseline")
    add(
        "--rounds",
        type=positive_int,
        default=1,
        help="load runs per target, taken in turns (all targets are started first; each round "
        "starts one target later); the tables give medians and the per-round ratios' range",
    )
    add("--json", default=None, metavar="PATH", help="also write every number here")
    add("--no-pin", action="store_true", help="do not use taskset")
    add("--router-core", type=int, default=0)
    add(
        "--pdproxy-workers",
        type=positive_int,
        default=1,
        help="pdproxy's --workers (with --no-pin: the Rust routers use every core too)",
    )
    add("--aux-core", type=int, default=1, help="core of the backends, loadgen and this script")
    add("--ready-timeout", type=float, default=60.0, help="seconds a router may take to serve")
    add("--routers-venv", default=None, help="venv of the Rust routers (default: router_env.py's)")
    add("--vllm-router-version", default=ROUTER_PINS["vllm-router"])
    add("--sglang-router-version", default=ROUTER_PINS["sglang-router"])
    add("--python", default=sys.executable, help="interpreter for pdproxy, backends, loadgen")
    add("--log-dir", default=None, help="child logs (default: a new temp dir)")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.warmup < 0 or args.idle_hold < 0 or args.idle_open_timeout <= 0:
        parser.error(
            "--duration and --idle-open-timeout must be > 0, --warmup and --idle-hold >= 0"
        )
    if args.stream_interval_ms < 0:
        parser.error("--stream-interval-ms must be >= 0")
    args.pins = {
        "vllm-router": args.vllm_router_version,
        "sglang-router": args.sglang_router_version,
    }
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run_unwound(lambda: run_bench(args), (BenchError, CrowdError))
    meta = report["meta"]
    print()
    print(tables(report))
    print()
    versions = ", ".join(f"{k} {v}" for k, v in sorted(meta["router_versions"].items()))
    load = f"{meta['loadavg_before'][0]:.2f} / {meta['loadavg_after'][0]:.2f}"
    print(f"routers: {versions or 'pdproxy only'}; pinning: {meta['pinning']}")
    print(f"load average (1 min) before / after: {load}")
    if meta["idle_streams_note"]:
        print(f"NOTE: {meta['idle_streams_note']}")
    if args.json:
        write_json_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
