"""Instructions per proxied request: pdproxy's cost, counted instead of timed.

Throughput on a shared 2-vCPU VM drifts by 10-20% between runs of the same code, more than
most single changes to the hot path are worth. This benchmark runs the proxy under valgrind's
callgrind, sends it a fixed number of non-streaming P/D requests (the same request as
``bench_proxy.py``, against the same fast backends) and counts the instructions the proxy
executed while it served them: the same code gives the same count to within about 0.2%.

Start-up, the registry and a warm-up are not counted (callgrind starts with counting off, and
it is switched on for the measured window only). Counting makes the proxy about 50 times
slower, so the requests come from a small concurrency (the batching per event-loop turn differs
from a full-speed run): compare counts with each other, not with timings.

    .venv/bin/python benchmarks/bench_instructions.py [--requests 2000] [--concurrency 16] \
        [--proxy-src PATH]     # a checkout whose pdproxy is measured (default: this one)

Needs ``valgrind`` (``apt-get install valgrind``). Every process it starts is stopped by its
process group in a ``finally`` block.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_proxy import (
    BENCH_DIR,
    BODY,
    HOST,
    PATH,
    REPO_ROOT,
    BenchError,
    ProcessGroup,
    loadgen_result,
)
from bench_proxy import _free_ports as free_ports
from bench_proxy import _wait_http_ok as wait_http_ok

START_TIMEOUT_S = 300.0  # start-up under callgrind: seconds here, far more on a loaded box
CONTROL_TIMEOUT_S = 60.0


def _callgrind_control(pid: int, *options: str) -> None:
    subprocess.run(
        ["callgrind_control", *options, str(pid)],
        check=True,
        capture_output=True,
        timeout=CONTROL_TIMEOUT_S,
    )


def _load(group: ProcessGroup, python: str, port: int, concurrency: int, count: int) -> int:
    """Send `count` requests (a few more finish: those in flight at the count); returns how
    many were answered 200."""
    argv = [
        python, str(BENCH_DIR / "loadgen.py"),
        "--host", HOST, "--port", str(port), "--path", PATH, "--body", json.dumps(BODY),
        "--concurrency", str(concurrency), "--warmup", "0", "--duration", "3600",
        "--max-requests", str(count), "--json", "-",
    ]  # fmt: skip
    item = group.spawn(f"loadgen-{count}", argv)  # its summary is the log's last line
    try:
        returncode = item.proc.wait(timeout=CONTROL_TIMEOUT_S + count)
    except subprocess.TimeoutExpired as exc:
        raise BenchError(f"the load generator did not finish {count} requests") from exc
    finally:
        group.stop(item)
    assert item.log_path is not None
    log = item.log_path.read_bytes()
    result = loadgen_result(returncode, log, log, f"{count} requests")
    ok: int = result["total_ok"]
    return ok


def _dumped_instructions(out_dir: Path) -> int:
    """The instruction total of the dump callgrind_control asked for (not the one at exit)."""
    for path in sorted(out_dir.glob("callgrind.out*")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if "Trigger: dump" not in text:
            continue
        for line in text.splitlines():
            if line.startswith("totals:"):
                return int(line.split()[1])
    raise BenchError(f"no callgrind dump with totals in {out_dir}")


def measure(args: argparse.Namespace) -> dict[str, object]:
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            raise BenchError(f"{tool} not found (apt-get install valgrind)")
    log_dir = Path(tempfile.mkdtemp(prefix="pdproxy-instructions-"))
    port, registry, prefill, prefill_zmq, decode, decode_zmq = free_ports(6)
    group = ProcessGroup(log_dir)
    try:
        backends = {
            "prefill": (prefill, group.spawn("backend-prefill", [
                args.python, str(BENCH_DIR / "fast_backend.py"), "--host", HOST,
                "--port", str(prefill), "--prefill",
            ])),
            "decode": (decode, group.spawn("backend-decode", [
                args.python, str(BENCH_DIR / "fast_backend.py"), "--host", HOST,
                "--port", str(decode),
            ])),
        }  # fmt: skip
        for backend_port, item in backends.values():
            wait_http_ok(item, backend_port, "/health", 10.0)
        proxy = group.spawn(
            "proxy",
            [
                "env", f"PYTHONPATH={Path(args.proxy_src).resolve()}",
                "valgrind", "--tool=callgrind", "--instr-atstart=no",
                f"--callgrind-out-file={log_dir}/callgrind.out",
                # -P: the children run in the repository, and the current directory would
                # otherwise come before PYTHONPATH (always measuring this checkout).
                args.python, "-P", "-m", "pdproxy", "serve", "--host", HOST, "--port", str(port),
                "--registry-bind", f"tcp://{HOST}:{registry}",
                "--prefill", f"http={HOST}:{prefill},zmq={HOST}:{prefill_zmq}",
                "--decode", f"http={HOST}:{decode},zmq={HOST}:{decode_zmq}",
                "--log-level", "warning",
            ],
        )  # fmt: skip
        wait_http_ok(proxy, port, "/ready", START_TIMEOUT_S)
        _load(group, args.python, port, args.concurrency, args.warmup_requests)
        _callgrind_control(proxy.proc.pid, "--zero")
        _callgrind_control(proxy.proc.pid, "--instr=on")
        ok = _load(group, args.python, port, args.concurrency, args.requests)
        _callgrind_control(proxy.proc.pid, "--instr=off")
        _callgrind_control(proxy.proc.pid, "--dump")
        if ok < args.requests:  # more: requests in flight when the count was reached
            raise BenchError(f"only {ok} of {args.requests} requests were answered 200")
        instructions = _dumped_instructions(log_dir)
    finally:
        group.stop_all()
    return {
        "proxy_src": str(Path(args.proxy_src).resolve()),
        "requests": ok,
        "concurrency": args.concurrency,
        "instructions": instructions,
        "instructions_per_request": round(instructions / ok),
        "logs": str(log_dir),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=2000, help="measured requests")
    parser.add_argument("--warmup-requests", type=int, default=300, help="not counted")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--proxy-src", default=str(REPO_ROOT), help="checkout to measure")
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args(argv)
    try:
        result = measure(args)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"{result['instructions_per_request']:,} instructions per request "
        f"({result['requests']} requests at c={result['concurrency']}, {result['proxy_src']})"
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
