"""Benchmark pdproxy on one pinned core against fast fake backends.

Layout (2 cores): the proxy runs alone on core 0 (``taskset -c 0``); the two fast backends
("prefill" and "decode") and the load generator share core 1. For each concurrency it measures

* ``direct``: load generator -> decode backend (one HTTP call per request: the baseline), and
* ``proxy``:  load generator -> pdproxy -> prefill backend, then decode backend (two calls),

with the same non-streaming request to ``/v1/completions``, and prints a table with the
proxy/direct throughput ratio. Every process it starts runs in its own process group and is
stopped by PID (group) in a ``finally`` block, also on Ctrl-C, SIGTERM or failure.

    .venv/bin/python benchmarks/bench_proxy.py [--duration 10] [--warmup 2] \
        [--concurrency 1,64] [--json benchmarks/results/run.json]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as dt
import http.client
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arg_types import positive_ints
from unwind import run_unwound, write_json_report

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
HOST = "127.0.0.1"
PATH = "/v1/completions"
BODY = {"model": "bench", "prompt": "hello world", "max_tokens": 16}
DEFAULT_PROXY_CMD = (
    "{python} -m pdproxy serve --host {host} --port {port}"
    " --registry-bind tcp://{host}:{registry_port}"
    " --prefill http={host}:{prefill_port},zmq={host}:{prefill_zmq_port}"
    " --decode http={host}:{decode_port},zmq={host}:{decode_zmq_port}"
    " --log-level warning"
)
STOP_TIMEOUT_S = 5.0
BACKEND_START_TIMEOUT_S = 10.0


class BenchError(RuntimeError):
    """A failure that ends the benchmark with a message instead of a traceback."""


@dataclass
class Pinning:
    enabled: bool
    proxy_core: int
    aux_core: int
    note: str

    def prefix(self, core: int) -> list[str]:
        return ["taskset", "-c", str(core)] if self.enabled else []


@dataclass
class Started:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path | None


@dataclass
class ProcessGroup:
    """Every process this script started; each leads its own process group."""

    log_dir: Path
    started: list[Started] = field(default_factory=list)

    def spawn(self, name: str, argv: Sequence[str]) -> Started:
        """Start ``argv`` in its own process group, stdout + stderr to ``LOG_DIR/NAME.log``."""
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "w", encoding="utf-8") as out:
            proc = subprocess.Popen(
                list(argv),
                cwd=REPO_ROOT,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: killpg(pid) reaches only it
                preexec_fn=_PREEXEC,  # noqa: PLW1509 - single-threaded script
            )
        item = Started(name, proc, log_path)
        self.started.append(item)
        return item

    def stop(self, item: Started) -> None:
        _stop_process_group(item.proc)
        if item in self.started:
            self.started.remove(item)

    def stop_all(self) -> None:
        for item in reversed(list(self.started)):
            self.stop(item)


def _die_with_parent() -> None:
    """Child pre-exec hook (Linux): get SIGKILL if this script dies without cleaning up."""
    with contextlib.suppress(Exception):
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


_PREEXEC = _die_with_parent if sys.platform.startswith("linux") else None


def _stop_process_group(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM the process group led by ``proc`` (by its PID), then SIGKILL if it lingers."""
    pgid = proc.pid  # start_new_session=True made the child the leader of group == its pid
    for sig, wait_s in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, STOP_TIMEOUT_S)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        # The leader is gone; make sure nothing else of its group survives.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        return


def _group_stats(pgid: int) -> list[tuple[str, list[str]]] | None:
    """(pid, /proc/PID/stat fields after the parenthesised command) of the live processes of
    process group ``pgid`` (Linux): state ppid pgrp ... utime(11) stime(12), zero-based."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    found = []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[2]) == pgid:
            found.append((entry, fields))
    return found


def _clock_tick() -> int | None:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None


def group_sys_and_switches(pgid: int) -> tuple[float, int, int] | None:
    """System CPU seconds, voluntary context switches (a thread waited: an event loop with
    nothing to do) and involuntary ones (preempted) of every thread of the live processes of
    process group ``pgid`` (Linux): where CPU goes besides the code itself."""
    tick, processes = _clock_tick(), _group_stats(pgid)
    if tick is None or not processes:
        return None
    system, voluntary, involuntary = 0, 0, 0
    for pid, fields in processes:
        system += int(fields[12])
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                for line in (task / "status").read_text().splitlines():
                    if line.startswith("voluntary_ctxt_switches:"):
                        voluntary += int(line.split(":")[1])
                    elif line.startswith("nonvoluntary_ctxt_switches:"):
                        involuntary += int(line.split(":")[1])
        except OSError:
            continue  # it ended meanwhile
    return system / tick, voluntary, involuntary


def _group_cpu_seconds(pgid: int) -> float | None:
    """User + system CPU seconds of the live processes of process group ``pgid`` (Linux)."""
    tick, processes = _clock_tick(), _group_stats(pgid)
    if tick is None or not processes:
        return None
    return sum(int(fields[11]) + int(fields[12]) for _, fields in processes) / tick


def _free_ports(count: int) -> list[int]:
    """Distinct currently free TCP ports on 127.0.0.1 (all held open while choosing)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def http_request(
    method: str, port: int, path: str, body: bytes | None = None, timeout: float = 2.0
) -> tuple[int, bytes]:
    # http.client, not urllib: urllib would honour http_proxy variables for 127.0.0.1.
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _log_tail(item: Started, lines: int = 30) -> str:
    if item.log_path is None or not item.log_path.exists():
        return ""
    text = item.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
    tail = "\n".join("    " + line for line in text[-lines:])
    return f"\n  last lines of {item.log_path}:\n{tail}" if tail else ""


def _wait_http_ok(item: Started, port: int, path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        code = item.proc.poll()
        if code is not None:
            raise BenchError(
                f"{item.name} exited with code {code} before {path} was OK" + _log_tail(item)
            )
        try:
            status, _ = http_request("GET", port, path, timeout=1.0)
        except OSError as exc:
            last = f"{type(exc).__name__}: {exc}"
        else:
            if status == 200:
                return
            last = f"HTTP {status}"
        time.sleep(0.1)
    raise BenchError(
        f"{item.name}: GET {path} on port {port} not 200 within {timeout_s:.0f} s ({last})"
        + _log_tail(item)
    )


def _smoke(name: str, port: int, item: Started | None = None) -> None:
    """One request through the target: it must answer 200 with an OpenAI-shaped body."""
    try:
        status, raw = http_request("POST", port, PATH, json.dumps(BODY).encode(), timeout=10.0)
    except OSError as exc:
        raise BenchError(
            f"smoke request to {name} failed: {exc}" + (_log_tail(item) if item else "")
        ) from exc
    ok = status == 200
    with contextlib.suppress(ValueError):
        ok = ok and isinstance(json.loads(raw).get("choices"), list)
    if not ok:
        raise BenchError(
            f"smoke request to {name} answered HTTP {status}: {raw[:300]!r}"
            + (_log_tail(item) if item else "")
        )


def _pinning(proxy_core: int, aux_core: int, disabled: bool) -> Pinning:
    if disabled:
        return Pinning(False, proxy_core, aux_core, "pinning disabled by --no-pin")
    if shutil.which("taskset") is None:
        return Pinning(False, proxy_core, aux_core, "taskset not found: running UNPINNED")
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        allowed = set(range(os.cpu_count() or 1))
    missing = {proxy_core, aux_core} - allowed
    if missing:
        return Pinning(
            False,
            proxy_core,
            aux_core,
            f"cores {sorted(missing)} not available (allowed {sorted(allowed)}): running UNPINNED",
        )
    if proxy_core == aux_core:
        note = f"proxy and load share core {proxy_core}"
    else:
        note = f"proxy on core {proxy_core}; backends + load generator on core {aux_core}"
    return Pinning(True, proxy_core, aux_core, note)


def _run_loadgen(
    group: ProcessGroup,
    pin: Pinning,
    python: str,
    *,
    server: Started,
    target: str,
    port: int,
    concurrency: int,
    duration_s: float,
    warmup_s: float,
) -> dict[str, Any]:
    argv = [
        *pin.prefix(pin.aux_core),
        python,
        str(BENCH_DIR / "loadgen.py"),
        "--host", HOST,
        "--port", str(port),
        "--path", PATH,
        "--body", json.dumps(BODY),
        "--concurrency", str(concurrency),
        "--duration", str(duration_s),
        "--warmup", str(warmup_s),
        "--target", target,
        "--json", "-",
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv,
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_PREEXEC,  # noqa: PLW1509 - single-threaded script
    )
    item = Started(f"loadgen-{target}-c{concurrency}", proc, None)
    group.started.append(item)
    cpu_before = _group_cpu_seconds(server.proc.pid)
    try:
        out, err = proc.communicate(timeout=duration_s + warmup_s + 60.0)
        cpu_after = _group_cpu_seconds(server.proc.pid)
    except subprocess.TimeoutExpired as exc:
        raise BenchError(f"load generator for {target} c={concurrency} did not finish") from exc
    finally:
        group.stop(item)
    result = loadgen_result(proc.returncode, out, err, f"{target} c={concurrency}")
    # CPU the server under test (proxy, or the backend for `direct`) spent per answered
    # request over the whole load run, warm-up included. Clock ticks are 10 ms, so this is
    # meaningful for runs of a few seconds or more.
    result["server_cpu_s"] = None
    result["server_cpu_us_per_req"] = None
    if cpu_before is not None and cpu_after is not None:
        cpu = cpu_after - cpu_before
        result["server_cpu_s"] = cpu
        if result.get("total_ok"):
            result["server_cpu_us_per_req"] = cpu / result["total_ok"] * 1e6
    return result


def loadgen_result(returncode: int | None, out: bytes, err: bytes, what: str) -> dict[str, Any]:
    """The load generator's summary (the JSON of its last stdout line), or a BenchError that
    says how it failed."""
    if returncode != 0:
        raise BenchError(
            f"load generator for {what} failed ({returncode}):\n"
            + err.decode(errors="replace")[-2000:]
        )
    lines = out.decode().strip().splitlines()
    if not lines:
        raise BenchError(f"load generator for {what} printed nothing")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def _fmt_table(rows: list[dict[str, Any]]) -> str:
    header = (
        "target",
        "conc",
        "req/s",
        "p50 ms",
        "p99 ms",
        "errors",
        "proxy/direct",
        "server CPU us/req",
    )
    body: list[tuple[str, ...]] = []
    for r in rows:
        ratio = r.get("proxy_over_direct")
        cpu = r.get("server_cpu_us_per_req")
        body.append(
            (
                r["target"],
                str(r["concurrency"]),
                f"{r['rps']:,.0f}",
                f"{r['p50_ms']:.3f}",
                f"{r['p99_ms']:.3f}",
                str(r["errors"]),
                f"{ratio:.3f}" if isinstance(ratio, float) else "-",
                f"{cpu:,.0f}" if isinstance(cpu, float) else "-",
            )
        )
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(header)]
    lines = [
        "  ".join(
            h.ljust(w) if i == 0 else h.rjust(w)
            for i, (h, w) in enumerate(zip(header, widths, strict=True))
        ),
        "  ".join("-" * w for w in widths),
    ]
    for row in body:
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    return "\n".join(lines)


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _git_rev() -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
        if out.returncode == 0:
            return out.stdout.strip()
    return None


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    pin = _pinning(args.proxy_core, args.aux_core, args.no_pin)
    print(f"pinning: {pin.note}", flush=True)
    python: str = args.python
    log_dir = (
        Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="pdproxy-bench-"))
    )
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"logs: {log_dir}", flush=True)

    ports = dict(
        zip(
            ("port", "registry_port", "prefill_port", "prefill_zmq_port", "decode_port",
             "decode_zmq_port"),
            _free_ports(6),
            strict=True,
        )
    )  # fmt: skip
    group = ProcessGroup(log_dir)
    results: list[dict[str, Any]] = []
    try:
        backends: dict[str, Started] = {}
        for role in ("prefill", "decode"):
            port = ports[f"{role}_port"]
            backends[role] = group.spawn(
                f"backend-{role}",
                [
                    *pin.prefix(pin.aux_core),
                    python,
                    str(BENCH_DIR / "fast_backend.py"),
                    "--host", HOST,
                    "--port", str(port),
                ],
            )  # fmt: skip
        for role, item in backends.items():
            _wait_http_ok(item, ports[f"{role}_port"], "/health", BACKEND_START_TIMEOUT_S)

        proxy_cmd = args.proxy_cmd.format(python=shlex.quote(python), host=HOST, **ports)
        proxy_argv = [*pin.prefix(pin.proxy_core), *shlex.split(proxy_cmd)]
        print(f"proxy: {shlex.join(proxy_argv)}", flush=True)
        proxy = group.spawn("proxy", proxy_argv)
        t0 = time.monotonic()
        _wait_http_ok(proxy, ports["port"], args.ready_path, args.ready_timeout)
        print(f"proxy ready after {time.monotonic() - t0:.2f} s", flush=True)

        _smoke("decode backend", ports["decode_port"], backends["decode"])
        _smoke("proxy", ports["port"], proxy)

        for conc in args.concurrency:
            pair: dict[str, dict[str, Any]] = {}
            runs = (
                ("direct", ports["decode_port"], backends["decode"]),
                ("proxy", ports["port"], proxy),
            )
            for target, port, server in runs:
                print(
                    f"running {target:6s} c={conc:<4d} "
                    f"({args.warmup:g} s warm-up + {args.duration:g} s) ...",
                    flush=True,
                )
                res = _run_loadgen(
                    group,
                    pin,
                    python,
                    server=server,
                    target=target,
                    port=port,
                    concurrency=conc,
                    duration_s=args.duration,
                    warmup_s=args.warmup,
                )
                pair[target] = res
                if proxy.proc.poll() is not None:
                    raise BenchError(
                        f"proxy exited with code {proxy.proc.returncode} during the run"
                        + _log_tail(proxy)
                    )
            direct_rps = pair["direct"]["rps"]
            pair["proxy"]["proxy_over_direct"] = (
                pair["proxy"]["rps"] / direct_rps if direct_rps > 0 else None
            )
            results.extend((pair["direct"], pair["proxy"]))
    finally:
        group.stop_all()

    return {
        "meta": {
            "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "git_rev": _git_rev(),
            "python": platform.python_version(),
            "cpu": _cpu_model(),
            "cpu_count": os.cpu_count(),
            "pinned": pin.enabled,
            "pinning": pin.note,
            "proxy_core": pin.proxy_core if pin.enabled else None,
            "aux_core": pin.aux_core if pin.enabled else None,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "path": PATH,
            "body": BODY,
            "proxy_cmd": args.proxy_cmd,
        },
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Benchmark pdproxy (pinned to one core) against fast fake backends."
    )
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds per run")
    parser.add_argument(
        "--concurrency",
        type=positive_ints,
        default=[1, 64],
        help="comma-separated connection counts (default 1,64)",
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also write results here")
    parser.add_argument(
        "--proxy-cmd",
        default=DEFAULT_PROXY_CMD,
        help="proxy command template; placeholders: {python} {host} {port} {registry_port} "
        "{prefill_port} {prefill_zmq_port} {decode_port} {decode_zmq_port} "
        "(taskset -c PROXY_CORE is prepended when pinning)",
    )
    parser.add_argument("--ready-path", default="/ready", help="GET path that is 200 when ready")
    parser.add_argument("--ready-timeout", type=float, default=30.0, help="seconds (default 30)")
    parser.add_argument("--python", default=sys.executable, help="interpreter for all children")
    parser.add_argument("--proxy-core", type=int, default=0)
    parser.add_argument("--aux-core", type=int, default=1, help="core of backends + loadgen")
    parser.add_argument("--no-pin", action="store_true", help="do not use taskset")
    parser.add_argument("--log-dir", default=None, help="child logs (default: a new temp dir)")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.warmup < 0:
        parser.error("--duration must be > 0 and --warmup >= 0")

    report = run_unwound(lambda: run_bench(args), (BenchError,))

    print()
    print(_fmt_table(report["results"]))
    if not report["meta"]["pinned"]:
        print(f"\nNOTE: {report['meta']['pinning']}")
    if args.json:
        write_json_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
