"""Replicas route alike: 3 proxy replicas sharing the traffic against 1, same fleet, same load.

The fleet simulator (fleet_sim.py) with pdproxy's default policies (prefix_affinity / least_kv):
one planner gets every request, or three planners (replicas, each with its own table and only
its own legs in flight) get every third, as an L4 balancer deals them; every worker samples its
load every LOAD_REPORT_S (pdproxy.vllm_side.announcer: a changed load is announced at most that
long after) and each replica's table gets it after its own delivery delay; every prefill also
samples its work (Load.prefill_tokens, as pdproxy's connector counts it) every
PREFILL_WORK_REPORT_S and announces it when it changed, which each replica's planner takes as it
arrives (as the registry server hands it to InFlight.announced_work). Load: 80% of the fleet's
capacity (round robin's saturation throughput, as bench_pairing.py measures it). Goal: TTFT p99
of 3 replicas within 1.2x of one replica's, prefix-hit rate within 5 points.

    .venv/bin/python benchmarks/bench_replicas.py            # 3 seeds x 10,000 requests (~25 s)
    .venv/bin/python benchmarks/bench_replicas.py --quick    # 1 seed x 3,000 requests
    .venv/bin/python benchmarks/bench_replicas.py --no-work-reports   # prefills announce no work
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from bench_pairing import (
    DEFAULTS,
    GOAL_LOAD,
    WARMUP_LOAD,
    PolicyPair,
    Row,
    Scenario,
    saturation_rps,
    summarize,
)
from fleet_sim import FleetSim, FleetSpec, RunResult
from workload import WorkloadSpec, build_workload

from pdproxy.vllm_side.announcer import LOAD_REPORT_S, PREFILL_WORK_REPORT_S

TTFT_RATIO_GOAL = 1.2
HIT_RATE_POINTS_GOAL = 0.05
# The announcer samples the load every LOAD_REPORT_S and announces it when it changed.
REPORT_PERIOD_S = (LOAD_REPORT_S, LOAD_REPORT_S)


def simulate(scenario: Scenario, replicas: int, rate: float, capacity: float, k: int) -> RunResult:
    policy = PolicyPair(*DEFAULTS)
    workload = scenario.workloads[k]
    planners = [policy.planner(scenario.spec.decode_kv_tokens) for _ in range(replicas)]
    sim = FleetSim(
        scenario.spec,
        planners,
        workload.requests,
        rate,
        seed=k,
        model=workload.spec.model,
        warmup=scenario.warmup,
        warmup_rate=WARMUP_LOAD * capacity,
    )
    return sim.run()


def compare(scenario: Scenario, load: float) -> tuple[float, list[Row]]:
    capacity = saturation_rps(scenario)
    rate = load * capacity
    rows = []
    for replicas in (1, 3):
        results = [
            simulate(scenario, replicas, rate, capacity, k) for k in range(len(scenario.workloads))
        ]
        label = f"{replicas} replica{'s' if replicas > 1 else ''}"
        rows.append(summarize(label, " / ".join(DEFAULTS), load, rate, results))
    return capacity, rows


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| proxies | TTFT p50 (ms) | TTFT p99 (ms) | throughput (req/s) | prefix-hit rate "
        "| prefill wait p99 (ms) | busiest prefill |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.variant} | {r.ttft_p50_ms:,.0f} | {r.ttft_p99_ms:,.0f} "
            f"| {r.throughput_rps:.1f} | {r.hit_rate:.1%} | {r.prefill_wait_p99_ms:,.0f} "
            f"| {r.prefill_busy_max:.0%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 seed x 3,000 requests")
    parser.add_argument("--seed", type=int, default=1, help="first seed")
    parser.add_argument("--load", type=float, default=GOAL_LOAD, help="fraction of capacity")
    parser.add_argument(
        "--work-report-ms",
        type=float,
        default=PREFILL_WORK_REPORT_S * 1000,
        help="how often a prefill's work is sampled and announced when it changed "
        "(default: the connector's, %(default)g)",
    )
    parser.add_argument(
        "--no-work-reports",
        action="store_true",
        help="prefills announce no work (as `pdproxy announce` for a stock vLLM)",
    )
    args = parser.parse_args(argv)
    requests, warmup, seeds = (3_000, 500, 1) if args.quick else (10_000, 1_000, 3)
    spec = FleetSpec(
        report_period_s=REPORT_PERIOD_S,
        work_report_s=None if args.no_work_reports else args.work_report_ms / 1000,
    )
    workloads = tuple(build_workload(WorkloadSpec(), requests, args.seed + k) for k in range(seeds))
    scenario = Scenario(spec, workloads, warmup)
    capacity, (one, three) = compare(scenario, args.load)
    work = (
        "not announced" if spec.work_report_s is None else f"every {spec.work_report_s * 1000:g} ms"
    )
    print(
        f"{spec.prefills} P + {spec.decodes} D, capacity {capacity:.1f} req/s, load "
        f"{args.load:.0%} ({args.load * capacity:.1f} req/s), {seeds} seed(s) x {requests:,} "
        f"requests ({warmup:,} warm-up), load reports {REPORT_PERIOD_S[0]}-{REPORT_PERIOD_S[1]} s "
        f"apart, prefill work {work}\n"
    )
    print(table([one, three]))
    ratio = three.ttft_p99_ms / one.ttft_p99_ms
    points = abs(three.hit_rate - one.hit_rate)
    ttft_ok = ratio <= TTFT_RATIO_GOAL
    hit_ok = points <= HIT_RATE_POINTS_GOAL
    print(
        f"\nTTFT p99 3 replicas / 1: {ratio:.2f}x (goal <= {TTFT_RATIO_GOAL}x: "
        f"{'met' if ttft_ok else 'MISSED'}); prefix-hit rate difference {points * 100:.1f} points "
        f"(goal <= {HIT_RATE_POINTS_GOAL * 100:.0f}: {'met' if hit_ok else 'MISSED'})"
    )
    return 0 if ttft_ok and hit_ok else 1


if __name__ == "__main__":
    sys.exit(main())
