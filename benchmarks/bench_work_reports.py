"""The proxy's cost of a prefill's work report (Load.prefill_tokens), as each one arrives.

A busy prefill with pdproxy's connector announces its work every PREFILL_WORK_REPORT_S (10 ms)
while it changes, to every replica. Each replica's registry server decodes the message (and
checks its MAC, with a registry secret), updates the table, and hands the work to the planner
(InFlight.announced_work), which rescores that instance in the score boards that hold it. This
times exactly that path, `RegistryServer.handle` on prepared frames, with the boards of a fleet
of N prefills built and followed, as in a serving process.

    .venv/bin/python benchmarks/bench_work_reports.py
    .venv/bin/python benchmarks/bench_work_reports.py --instances 16,256,1000 --reports 20000
"""

from __future__ import annotations

import argparse
import sys
import time

import msgpack

from pdproxy.base.roles import Role
from pdproxy.config import Settings
from pdproxy.metrics import Metrics
from pdproxy.pairing.features import RequestFeatures
from pdproxy.pairing.planner import Pair, Planner
from pdproxy.pairing.policies import make_policy
from pdproxy.registry.auth import new_nonce, signed
from pdproxy.registry.messages import Geometry, Load
from pdproxy.registry.server import RegistryServer
from pdproxy.registry.table import RegistryTable
from pdproxy.vllm_side.announcement import WorkerIdentity, announce_message
from pdproxy.vllm_side.announcer import PREFILL_WORK_REPORT_S

SECRET = "bench-registry-secret-0123456789"
GEOMETRY = Geometry(1, 16, 32, 8, 128, "bfloat16", False, "HND")


def identity(role: Role, n: int) -> WorkerIdentity:
    host = f"10.{1 if role is Role.PREFILL else 2}.{n // 250}.{n % 250 + 1}"
    return WorkerIdentity(role, f"{host}:8100", f"{host}:21001", "m", "pdproxy", GEOMETRY)


def measure(instances: int, reports: int, secret: bool) -> float:
    """Microseconds per report."""
    settings = Settings(
        ttl=3600.0, max_instances=instances + 1, registry_secret=SECRET if secret else None
    )
    table = RegistryTable(settings.ttl, settings.max_instances)
    server = RegistryServer(settings, table, Metrics())
    planner = Planner(make_policy("prefix_affinity"), make_policy("least_kv"))
    planner.inflight.follow_work()
    server.work_listener = planner.inflight.announced_work
    prefills = [identity(Role.PREFILL, n) for n in range(instances)]

    def frame(who: WorkerIdentity, load: Load) -> bytes:
        message = announce_message(who, load)
        if secret:
            message = signed(message, SECRET.encode(), time.time(), new_nonce())
        packed: bytes = msgpack.packb(message)
        return packed

    for who in (*prefills, identity(Role.DECODE, 0)):
        server.handle([b"w", frame(who, Load(running=0, prefill_tokens=0))])
    chosen = planner.plan(table.snapshot(0.0), RequestFeatures("m", 1000, 1100))
    assert isinstance(chosen, Pair)  # the index and its boards are built, and follow
    frames = [
        frame(prefills[k % instances], Load(running=1, prefill_tokens=1 + k))
        for k in range(reports)
    ]
    started = time.perf_counter()
    for item in frames:
        server.handle([b"w", item])
    elapsed = time.perf_counter() - started
    return elapsed / reports * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", default="16,256,1000", help="prefills, comma-separated")
    parser.add_argument("--reports", type=int, default=20_000)
    args = parser.parse_args(argv)
    # A busy prefill's figure changes at every engine step: at most one report per period.
    periods = (PREFILL_WORK_REPORT_S, 0.1)
    shares = " | ".join(f"CPU, all busy, {p * 1000:g} ms" for p in periods)
    print(f"| prefills | µs per report | signed | {shares} |")
    print("| ---: | ---: | ---: |" + " ---: |" * len(periods))
    for n in (int(x) for x in args.instances.split(",")):
        plain = measure(n, args.reports, secret=False)
        sealed = measure(n, args.reports, secret=True)
        cpu = " | ".join(f"{n / p * sealed / 1e6:.0%}" for p in periods)
        print(f"| {n:,} | {plain:.1f} | {sealed:.1f} | {cpu} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
