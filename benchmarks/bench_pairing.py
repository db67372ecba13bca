"""Pairing benchmark: pdproxy's planner and policies in a simulated fleet, and their cost.

1. Fleet simulation (fleet_sim.py, workload.py): the same seeded shared-prefix workload, with
   Poisson arrivals at 50%, 80% and 95% of the fleet's capacity (the saturation throughput of
   round robin, measured by simulation), routed by each policy pair. Reports TTFT p50/p99,
   throughput and the prefix-cache hit rate, and checks the goal: at 80% load, the default
   policies' p99 TTFT at most half of round robin's.
2. Decision time: ``Planner.plan`` plus the two ``release`` calls of a request, timed with
   ``time.perf_counter_ns`` at 1,000 registered instances (500 P + 500 D, homogeneous and
   mixed-geometry), with thousands of legs in flight; the first plan after a new snapshot
   (the index rebuild) is timed separately. Goal: under 50 microseconds per decision.

    .venv/bin/python benchmarks/bench_pairing.py            # full run (about 1.5 minutes)
    .venv/bin/python benchmarks/bench_pairing.py --quick    # smoke run (a few seconds)
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import datetime as dt
import gc
import io
import json
import os
import platform
import pstats
import random
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fleet_sim import FleetSim, FleetSpec, RunResult
from loadgen import percentile
from workload import Workload, WorkloadSpec, build_workload

from pdproxy.base.roles import Role
from pdproxy.config import Settings
from pdproxy.ids import Address
from pdproxy.pairing.features import RequestFeatures
from pdproxy.pairing.planner import Pair, Planner, class_key
from pdproxy.pairing.policies import make_policy
from pdproxy.proxy.state import planner_from
from pdproxy.registry.messages import Connector, Geometry, Load
from pdproxy.registry.table import Instance, Snapshot, Source

DEFAULT_POLICIES = (
    "round_robin:round_robin,prefix_affinity:least_kv,least_loaded:least_loaded,"
    "power_of_two:power_of_two"
)
REFERENCE = ("round_robin", "round_robin")
DEFAULTS = ("prefix_affinity", "least_kv")  # pdproxy's configured defaults (config.py)
DECISION_BUDGET_US = 50.0
TTFT_GOAL_RATIO = 0.5
GOAL_LOAD = 0.8
BASELINE = "baseline"
WARMUP_LOAD = 0.5  # the warm-up requests arrive at this fraction of capacity
BASE = FleetSpec()


@dataclass(frozen=True, slots=True)
class PolicyPair:
    prefill: str
    decode: str
    load_factor: float = 1.25  # prefix_affinity's bounded-load factor

    @property
    def label(self) -> str:
        text = f"{self.prefill} / {self.decode}"
        if self.prefill == "prefix_affinity" and self.load_factor != 1.25:
            text += f" (load_factor {self.load_factor:g})"
        return text

    def planner(self, kv_capacity_tokens: int) -> Planner:
        """The planner the proxy builds from this configuration."""
        settings = Settings.model_validate(
            {
                "prefill_policy": self.prefill,
                "decode_policy": self.decode,
                "prefix_affinity_load_factor": self.load_factor,
                "decode_kv_capacity_tokens": kv_capacity_tokens,
            }
        )
        return planner_from(settings)


def parse_policies(text: str, load_factor: float) -> list[PolicyPair]:
    """`P:D,P:D`; `prefix_affinity@2:least_kv` sets that row's load factor. ValueError if bad."""
    pairs = []
    for item in text.split(","):
        prefill, sep, decode = item.strip().partition(":")
        if not sep:
            raise ValueError(f"policy pair {item!r} is not PREFILL:DECODE")
        factor = load_factor
        if "@" in prefill:
            prefill, _, value = prefill.partition("@")
            factor = float(value)
        make_policy(prefill, load_factor=factor)  # unknown names and bad factors raise here
        make_policy(decode)
        pairs.append(PolicyPair(prefill, decode, factor))
    return pairs


# -- 1. fleet simulation ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    variant: str  # what differs from the baseline fleet and workload
    policy: str
    load: float  # fraction of round robin's saturation throughput
    offered_rps: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    throughput_rps: float
    hit_rate: float  # prompt tokens served from a prefix cache / all prompt tokens
    prefill_wait_p99_ms: float  # arrival -> prefill start
    decode_wait_p99_ms: float  # KV ready -> joins a decode batch
    prefill_busy_max: float  # busiest prefill's busy fraction
    prefill_busy_min: float
    decode_kv_peak: float  # the fullest decode's peak KV use (worst seed)
    snapshots: int


def summarize(
    variant: str, policy: str, load: float, rate: float, results: Sequence[RunResult]
) -> Row:
    """One row from the runs of every seed: percentiles over their requests pooled."""
    jobs = [job for result in results for job in result.jobs]
    ttft = sorted(job.first_token - job.arrival for job in jobs)
    prefill_wait = sorted(job.prefill_start - job.arrival for job in jobs)
    decode_wait = sorted(job.decode_join - job.kv_ready for job in jobs)
    prompt = sum(job.request.prompt_tokens for job in jobs)
    cached = sum(job.cached_tokens for job in jobs)
    runs = len(results)
    return Row(
        variant=variant,
        policy=policy,
        load=load,
        offered_rps=rate,
        ttft_p50_ms=percentile(ttft, 0.50) * 1e3,
        ttft_p99_ms=percentile(ttft, 0.99) * 1e3,
        throughput_rps=sum(r.throughput_rps for r in results) / runs,
        hit_rate=cached / prompt,
        prefill_wait_p99_ms=percentile(prefill_wait, 0.99) * 1e3,
        decode_wait_p99_ms=percentile(decode_wait, 0.99) * 1e3,
        prefill_busy_max=sum(max(r.prefill_busy) for r in results) / runs,
        prefill_busy_min=sum(min(r.prefill_busy) for r in results) / runs,
        decode_kv_peak=max(r.decode_kv_peak for r in results),
        snapshots=sum(r.snapshots for r in results) // runs,
    )


@dataclass(frozen=True, slots=True)
class Scenario:
    spec: FleetSpec
    workloads: tuple[Workload, ...]  # one per seed
    warmup: int  # requests, not measured, at WARMUP_LOAD of capacity

    def simulate(
        self, policy: PolicyPair, rate: float, warmup_rate: float, seed_index: int
    ) -> RunResult:
        workload = self.workloads[seed_index]
        sim = FleetSim(
            self.spec,
            policy.planner(self.spec.decode_kv_tokens),
            workload.requests,
            rate,
            seed=seed_index,
            model=workload.spec.model,
            warmup=self.warmup,
            warmup_rate=warmup_rate,
        )
        return sim.run()


def ideal_prefill_rate(spec: FleetSpec, workload: Workload) -> float:
    """Requests/s the prefills could serve if every shared block were always cached."""
    block = spec.block_tokens
    service = [
        spec.prefill_overhead_s
        + (r.prompt_tokens - r.shared_tokens // block * block) * spec.prefill_s_per_token
        for r in workload.requests
    ]
    return spec.prefills * len(service) / sum(service)


def saturation_rps(scenario: Scenario) -> float:
    """Round robin's throughput when offered 1.5 x the ideal prefill bound (after a warm-up
    at half that bound), averaged over the seeds."""
    values = []
    for k, workload in enumerate(scenario.workloads):
        bound = ideal_prefill_rate(scenario.spec, workload)
        result = scenario.simulate(PolicyPair(*REFERENCE), 1.5 * bound, 0.5 * bound, k)
        values.append(result.throughput_rps)
    return sum(values) / len(values)


def run_fleet(
    scenario: Scenario,
    policies: Sequence[PolicyPair],
    loads: Sequence[float],
    variant: str = BASELINE,
    capacity: float | None = None,
) -> tuple[float, list[Row]]:
    """Every policy at every load; capacity is round robin's saturation unless given."""
    if capacity is None:
        capacity = saturation_rps(scenario)
        ideal = ideal_prefill_rate(scenario.spec, scenario.workloads[0])
        print(
            f"{variant}: fleet capacity (round robin saturation throughput) {capacity:.1f} "
            f"req/s (prefill bound with every shared block cached: {ideal:.1f} req/s)",
            flush=True,
        )
    rows = []
    for load in loads:
        rate = load * capacity
        for policy in policies:
            t0 = time.perf_counter()
            results = [
                scenario.simulate(policy, rate, WARMUP_LOAD * capacity, k)
                for k in range(len(scenario.workloads))
            ]
            row = summarize(variant, policy.label, load, rate, results)
            rows.append(row)
            print(
                f"  {load:4.0%} {policy.label:<45s} TTFT p99 {row.ttft_p99_ms:8.1f} ms "
                f"({time.perf_counter() - t0:.1f} s)",
                flush=True,
            )
    return capacity, rows


def run_sensitivity(
    scenario: Scenario, policies: Sequence[PolicyPair], capacity: float, seeds: Sequence[int]
) -> list[Row]:
    """80% load with one thing changed at a time: what the defaults' result depends on.
    Variants that change what round robin can serve are recalibrated; the others run at the
    baseline's rate (round robin reads no load, so its rows repeat the baseline's)."""
    load = [GOAL_LOAD]
    spec = scenario.spec
    rows = []
    cache = 32_768
    tight = replace(scenario, spec=replace(spec, prefix_cache_tokens=cache))
    rows += run_fleet(tight, policies, load, f"P prefix cache {cache:,} tokens")[1]
    many = WorkloadSpec(system_prompts=200)
    wide = replace(
        scenario,
        workloads=tuple(
            build_workload(many, len(scenario.workloads[0].requests), seed) for seed in seeds
        ),
    )
    rows += run_fleet(wide, policies, load, f"{many.system_prompts} system prompts")[1]
    fresh = replace(scenario, spec=replace(spec, report_period_s=(0.1, 0.1)))
    rows += run_fleet(fresh, policies, load, "load reports every 0.1 s", capacity)[1]
    silent = replace(scenario, spec=replace(spec, report_load=False))
    rows += run_fleet(silent, policies, load, "announcements carry no load", capacity)[1]
    factors = [PolicyPair(*REFERENCE)] + [
        PolicyPair(*DEFAULTS, load_factor=f) for f in (1.0, 1.1, 1.5, 2.0)
    ]
    rows += run_fleet(scenario, factors, load, "prefix_affinity load_factor", capacity)[1]
    return rows


def fleet_table(rows: Sequence[Row], variants: bool = False) -> str:
    reference = {
        (r.variant, r.load): r.ttft_p99_ms for r in rows if r.policy == PolicyPair(*REFERENCE).label
    }
    lines = [
        ("| variant " if variants else "")
        + "| policy (P / D) | load | offered req/s | TTFT p50 ms | TTFT p99 ms | p99 / RR "
        "| throughput req/s | prefix hit | P wait p99 ms | P busy max / min | D wait p99 ms "
        "| D KV peak |",
        ("| --- " if variants else "")
        + "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        ref = reference.get((r.variant, r.load))
        ratio = f"{r.ttft_p99_ms / ref:.2f}" if ref else "-"
        lines.append(
            (f"| {r.variant} " if variants else "")
            + f"| {r.policy} | {r.load:.0%} | {r.offered_rps:.1f} | {r.ttft_p50_ms:,.0f} "
            f"| {r.ttft_p99_ms:,.0f} | {ratio} | {r.throughput_rps:.1f} "
            f"| {r.hit_rate:.1%} | {r.prefill_wait_p99_ms:,.0f} "
            f"| {r.prefill_busy_max:.0%} / {r.prefill_busy_min:.0%} "
            f"| {r.decode_wait_p99_ms:,.0f} | {r.decode_kv_peak:.0%} |"
        )
    return "\n".join(lines)


# -- 2. decision time ------------------------------------------------------------------------

NIXL_GEOMETRIES = {
    "tp1-bf16": Geometry(1, 16, 32, 8, 128, "bfloat16", False, "HND"),
    "tp2-bf16": Geometry(2, 16, 32, 8, 128, "bfloat16", False, "HND"),
    "tp4-bf16": Geometry(4, 16, 32, 8, 128, "bfloat16", False, "HND"),
    "tp1-fp8": Geometry(1, 16, 32, 8, 128, "fp8", False, "HND"),
}
# (geometry name, share of the role's instances)
MIXED_PREFILLS = (("tp1-bf16", 0.5), ("tp2-bf16", 0.3), ("tp1-fp8", 0.2))
MIXED_DECODES = (("tp1-bf16", 0.4), ("tp2-bf16", 0.3), ("tp4-bf16", 0.2), ("tp1-fp8", 0.1))


def _address(role: Role, i: int, port: int) -> Address:
    return Address(f"10.{1 if role is Role.PREFILL else 2}.{i // 250}.{i % 250 + 1}", port)


def make_instances(
    role: Role, count: int, mixed: bool, model: str, rng: random.Random
) -> tuple[Instance, ...]:
    shares = (MIXED_PREFILLS if role is Role.PREFILL else MIXED_DECODES) if mixed else ()
    kinds: list[tuple[Connector, Geometry]] = []
    for name, share in shares:
        kinds += [(Connector.NIXL, NIXL_GEOMETRIES[name])] * round(share * count)
    kinds += [(Connector.P2P_NCCL, BASE.geometry)] * (count - len(kinds))
    return tuple(
        Instance(
            role,
            _address(role, i, 8100 if role is Role.PREFILL else 8200),
            _address(role, i, 21001),
            Source.V1,
            model=model,
            connector=connector,
            geometry=geometry,
            load=random_load(role, rng),
        )
        for i, (connector, geometry) in enumerate(kinds[:count])
    )


def random_load(role: Role, rng: random.Random) -> Load:
    """An announced load of the order the in-flight levels below imply."""
    if role is Role.PREFILL:
        return Load(running=rng.randint(0, 1), waiting=rng.randint(0, 3), kv_usage=0.01)
    return Load(running=rng.randint(16, 48), waiting=0, kv_usage=rng.uniform(0.2, 0.8))


def reload(snapshot: Snapshot, version: int, rng: random.Random) -> Snapshot:
    """The same fleet with fresh load reports: what the registry publishes every 0.5 s."""
    return Snapshot(
        version,
        tuple(replace(i, load=random_load(i.role, rng)) for i in snapshot.prefills),
        tuple(replace(i, load=random_load(i.role, rng)) for i in snapshot.decodes),
    )


@dataclass(frozen=True, slots=True)
class DecisionStats:
    fleet: str
    policy: str
    classes: str
    decisions: int
    decision_mean_us: float  # plan + both releases, every timed decision
    decision_best_block_us: float  # the lowest mean of BLOCKS equal blocks (noise-robust)
    decision_p50_us: float
    decision_p99_us: float
    over_1ms: int  # decisions slower than 1 ms (preemption, a GC pass)
    plan_mean_us: float
    plan_p99_us: float
    release_mean_us: float  # both releases together
    rebuild_load_ms: float  # first plan after a load-only snapshot (mean)
    rebuild_load_max_ms: float
    rebuild_member_ms: float  # first plan after one prefill was replaced (mean)
    rebuild_member_max_ms: float


BLOCKS = 5


class DecisionBench:
    """Steady in-flight levels: every decision adds a prefill leg and a decode leg, and the
    oldest leg of each role beyond its target is released (a leg ends in arrival order)."""

    def __init__(
        self,
        planner: Planner,
        snapshot: Snapshot,
        features: Sequence[RequestFeatures],
        prefill_legs: int,
        decode_legs: int,
    ) -> None:
        self.planner = planner
        self.snapshot = snapshot
        self.features = features
        self.prefill_target = prefill_legs
        self.decode_target = decode_legs
        self.p_legs: deque[tuple[Address, int]] = deque()
        self.d_legs: deque[tuple[Address, int]] = deque()
        self.count = 0

    def step(self) -> tuple[int, int]:
        """One decision: (ns in plan, ns in plan + releases)."""
        clock = time.perf_counter_ns
        features = self.features[self.count % len(self.features)]
        self.count += 1
        t0 = clock()
        choice = self.planner.plan(self.snapshot, features)
        t1 = clock()
        if not isinstance(choice, Pair):
            raise RuntimeError(f"no pair at 1,000 instances: {choice}")
        self.p_legs.append((choice.prefill.http_address, choice.prefill_tokens))
        self.d_legs.append((choice.decode.http_address, choice.decode_tokens))
        released = 0
        if len(self.p_legs) > self.prefill_target:
            address, tokens = self.p_legs.popleft()
            t2 = clock()
            self.planner.release(address, tokens)
            released += clock() - t2
        if len(self.d_legs) > self.decode_target:
            address, tokens = self.d_legs.popleft()
            t2 = clock()
            self.planner.release(address, tokens)
            released += clock() - t2
        return t1 - t0, t1 - t0 + released

    def run(self, count: int) -> tuple[list[int], list[int]]:
        plans, totals = [], []
        for _ in range(count):
            plan_ns, total_ns = self.step()
            plans.append(plan_ns)
            totals.append(total_ns)
        return plans, totals

    def first_plan_ms(self, snapshot: Snapshot) -> float:
        """Switch to `snapshot`; the next decision's plan rebuilds the index."""
        self.snapshot = snapshot
        plan_ns, _ = self.step()
        return plan_ns / 1e6


def fleet_snapshot(instances: int, mixed: bool, model: str, rng: random.Random) -> Snapshot:
    n_p = instances // 2
    return Snapshot(
        1,
        make_instances(Role.PREFILL, n_p, mixed, model, rng),
        make_instances(Role.DECODE, instances - n_p, mixed, model, rng),
    )


def warm_bench(
    policy: PolicyPair,
    snapshot: Snapshot,
    features: Sequence[RequestFeatures],
) -> DecisionBench:
    """A bench with its index built and its legs in flight at their steady levels:
    2 per prefill (a short queue) and 32 per decode (a running batch)."""
    n_p, n_d = len(snapshot.prefills), len(snapshot.decodes)
    bench = DecisionBench(
        policy.planner(BASE.decode_kv_tokens), snapshot, features, 2 * n_p, 32 * n_d
    )
    bench.first_plan_ms(snapshot)  # builds the index and the hash ring
    bench.run(max(2 * n_p, 32 * n_d) + 5_000)
    return bench


def measure_decisions(
    policy: PolicyPair,
    mixed: bool,
    instances: int,
    features: Sequence[RequestFeatures],
    decisions: int,
    rebuilds: int,
    model: str,
    seed: int,
) -> DecisionStats:
    rng = random.Random(seed)
    snapshot = fleet_snapshot(instances, mixed, model, rng)
    bench = warm_bench(policy, snapshot, features)
    # Setup objects (the workload, the fleet) go to the permanent generation: GC stays on
    # for what the decisions allocate, without rescanning the benchmark's own heap.
    gc.collect()
    gc.freeze()
    try:
        block = max(1, decisions // BLOCKS)
        plans: list[int] = []
        totals: list[int] = []
        block_means = []
        for _ in range(BLOCKS):
            block_plans, block_totals = bench.run(block)
            plans += block_plans
            totals += block_totals
            block_means.append(sum(block_totals) / len(block_totals) / 1e3)
        load_only = []
        for k in range(rebuilds):
            load_only.append(bench.first_plan_ms(reload(bench.snapshot, 2 + k, rng)))
            bench.run(200)
        member = []
        for k in range(rebuilds):
            old = bench.snapshot
            # One prefill leaves and a new one joins: a new membership, so a new hash ring.
            host = f"10.3.{k // 250}.{k % 250 + 1}"
            newcomer = replace(
                old.prefills[0],
                http_address=Address(host, 8100),
                zmq_address=Address(host, 21001),
            )
            fleet = Snapshot(100 + k, (newcomer, *old.prefills[1:]), old.decodes)
            member.append(bench.first_plan_ms(fleet))
            bench.run(200)
    finally:
        gc.unfreeze()
    n = len(totals)
    releases = sum(totals) - sum(plans)
    plans.sort()
    totals.sort()
    p_classes = len({class_key(i) for i in snapshot.prefills})
    d_classes = len({class_key(i) for i in snapshot.decodes})
    return DecisionStats(
        fleet=f"{len(snapshot.prefills)} P + {len(snapshot.decodes)} D, "
        + ("mixed geometry" if mixed else "homogeneous"),
        policy=policy.label,
        classes=f"{p_classes} P / {d_classes} D",
        decisions=n,
        decision_mean_us=sum(totals) / n / 1e3,
        decision_best_block_us=min(block_means),
        decision_p50_us=percentile([float(v) for v in totals], 0.50) / 1e3,
        decision_p99_us=percentile([float(v) for v in totals], 0.99) / 1e3,
        over_1ms=sum(1 for v in totals if v > 1_000_000),
        plan_mean_us=sum(plans) / n / 1e3,
        plan_p99_us=percentile([float(v) for v in plans], 0.99) / 1e3,
        release_mean_us=releases / n / 1e3,
        rebuild_load_ms=sum(load_only) / len(load_only),
        rebuild_load_max_ms=max(load_only),
        rebuild_member_ms=sum(member) / len(member),
        rebuild_member_max_ms=max(member),
    )


def profile_decisions(
    policy: PolicyPair,
    mixed: bool,
    instances: int,
    features: Sequence[RequestFeatures],
    decisions: int,
    model: str,
    seed: int,
) -> str:
    """cProfile of `decisions` steady-state decisions: the top functions by own time."""
    snapshot = fleet_snapshot(instances, mixed, model, random.Random(seed))
    bench = warm_bench(policy, snapshot, features)
    profiler = cProfile.Profile()
    profiler.enable()
    bench.run(decisions)
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.strip_dirs().sort_stats("tottime").print_stats(12)
    # Keep the table: from the column header on.
    text = out.getvalue()
    return text[text.index("   ncalls") :].rstrip()


def decision_table(stats: Sequence[DecisionStats]) -> str:
    lines = [
        "| fleet | classes | policy (P / D) | decision mean µs | best-block mean µs | p50 µs "
        "| p99 µs | > 1 ms | plan mean µs | plan p99 µs | releases mean µs "
        "| rebuild, load-only ms (mean / max) | rebuild, membership ms (mean / max) |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in stats:
        lines.append(
            f"| {s.fleet} | {s.classes} | {s.policy} | {s.decision_mean_us:.1f} "
            f"| {s.decision_best_block_us:.1f} | {s.decision_p50_us:.1f} "
            f"| {s.decision_p99_us:.1f} | {s.over_1ms} | {s.plan_mean_us:.1f} "
            f"| {s.plan_p99_us:.1f} | {s.release_mean_us:.1f} "
            f"| {s.rebuild_load_ms:.1f} / {s.rebuild_load_max_ms:.1f} "
            f"| {s.rebuild_member_ms:.0f} / {s.rebuild_member_max_ms:.0f} |"
        )
    return "\n".join(lines)


# -- the run ---------------------------------------------------------------------------------


def describe(scenario: Scenario) -> str:
    spec = scenario.spec
    workload = scenario.workloads[0]
    w = workload.spec
    requests = workload.requests
    measured = [r for w in scenario.workloads for r in w.requests[scenario.warmup :]]
    prompt = sum(r.prompt_tokens for r in measured)
    block = spec.block_tokens
    shareable = sum(r.shared_tokens // block * block for r in measured)
    g = spec.geometry
    return "\n".join(
        [
            f"* fleet: {spec.prefills} P + {spec.decodes} D, {w.model} "
            f"(TP {g.tp_size}, {g.num_layers} layers, {g.num_kv_heads} KV heads x {g.head_dim}, "
            f"{g.kv_dtype}), connector {spec.connector.value}",
            f"* prefill: FIFO, one at a time; {spec.prefill_overhead_s * 1e3:g} ms + "
            f"{spec.prefill_s_per_token * 1e3:g} ms per uncached token; LRU prefix cache of "
            f"{spec.prefix_cache_tokens:,} tokens per P in {spec.block_tokens}-token blocks",
            f"* decode: step {spec.decode_step_s * 1e3:g} ms + "
            f"{spec.decode_step_s_per_seq * 1e3:g} ms x batch; at most {spec.decode_max_seqs} "
            f"sequences and {spec.decode_kv_tokens:,} KV tokens per D (full KV: requests wait)",
            f"* KV transfer: whole prompt at {spec.kv_bytes_per_s / 1e9:g} GB/s; "
            + (
                f"load reports every {spec.report_period_s[0]:g}-{spec.report_period_s[1]:g} s "
                "per worker, through pdproxy's RegistryTable (snapshot refresh <= 0.5 s)"
                if spec.report_load
                else "NO load reports (the planner sees only its own legs in flight)"
            ),
            f"* workload: {len(scenario.workloads)} seed(s) x {len(requests):,} requests; the "
            f"first {scenario.warmup:,} arrive at {WARMUP_LOAD:.0%} of capacity and are not "
            "measured (caches warm up without a backlog), the rest at the load of the row; "
            f"{w.system_prompts} system prompts of {w.system_tokens[0]:,}-"
            f"{w.system_tokens[1]:,} tokens, Zipf s={w.zipf_s:g} (top one "
            f"{workload.popularity[0]:.0%} of shared traffic), user turns {w.user_tokens[0]}-"
            f"{w.user_tokens[1]} tokens; {w.unshared_fraction:.0%} share nothing "
            f"({w.unshared_tokens[0]:,}-{w.unshared_tokens[1]:,} tokens); outputs "
            f"{w.output_tokens[0]}-{w.output_tokens[1]} tokens, max_tokens {w.max_tokens}; "
            f"shared prompt tokens in whole blocks {shareable / prompt:.1%} (the ceiling of "
            "the prefix hit rate)",
            "* prefix_key: pdproxy.proxy.prompt.request_features on a synthetic chat body "
            f"(blake2b of the conversation's first {w.prefix_tokens} x 4 characters: the "
            "system prompt's, or the unique turn's)",
        ]
    )


def check_goals(rows: Sequence[Row], stats: Sequence[DecisionStats]) -> list[str]:
    out = []
    ref_label = PolicyPair(*REFERENCE).label
    for r in rows:
        if r.load == GOAL_LOAD and r.policy == PolicyPair(*DEFAULTS).label:
            ref = next(x for x in rows if x.load == GOAL_LOAD and x.policy == ref_label)
            ratio = r.ttft_p99_ms / ref.ttft_p99_ms
            verdict = "MET" if ratio <= TTFT_GOAL_RATIO else "NOT MET"
            out.append(
                f"* TTFT at 80% load: {r.policy} p99 {r.ttft_p99_ms:,.0f} ms vs round robin "
                f"{ref.ttft_p99_ms:,.0f} ms = {ratio:.2f} (goal <= {TTFT_GOAL_RATIO}): {verdict}"
            )
    if rows and not out:
        out.append(
            f"* TTFT goal not checked: it needs the rows {ref_label} and "
            f"{PolicyPair(*DEFAULTS).label} at {GOAL_LOAD:.0%} load"
        )
    for s in stats:
        verdict = "MET" if s.decision_mean_us < DECISION_BUDGET_US else "NOT MET"
        tail = "p99 also under" if s.decision_p99_us < DECISION_BUDGET_US else "p99 over"
        out.append(
            f"* decision time, {s.fleet}, {s.policy}: mean {s.decision_mean_us:.1f} µs, "
            f"p99 {s.decision_p99_us:.1f} µs (goal < {DECISION_BUDGET_US:g} µs): {verdict} "
            f"({tail} budget)"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="short run (under 30 s)")
    parser.add_argument(
        "--requests", type=int, default=None, help="requests per simulation, warm-up included"
    )
    parser.add_argument("--warmup", type=int, default=None, help="unmeasured requests per run")
    parser.add_argument("--seed", type=int, default=1, help="first seed")
    parser.add_argument("--seeds", type=int, default=None, help="runs per row, pooled")
    parser.add_argument("--loads", default="0.5,0.8,0.95", help="fractions of fleet capacity")
    parser.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        help="comma-separated PREFILL:DECODE pairs; prefix_affinity@F sets a load factor",
    )
    parser.add_argument("--load-factor", type=float, default=1.25, help="prefix_affinity's")
    parser.add_argument("--prefills", type=int, default=BASE.prefills)
    parser.add_argument("--decodes", type=int, default=BASE.decodes)
    parser.add_argument(
        "--cache-tokens", type=int, default=BASE.prefix_cache_tokens, help="per prefill"
    )
    parser.add_argument(
        "--report-period",
        default="1,3",
        help="MIN,MAX seconds between a worker's load reports (uniform)",
    )
    parser.add_argument(
        "--no-load-reports",
        action="store_true",
        help="workers announce no load: the planner sees only its own legs in flight",
    )
    parser.add_argument("--instances", type=int, default=1000, help="decision-time fleet size")
    parser.add_argument("--decisions", type=int, default=None, help="timed decisions per case")
    parser.add_argument("--skip-sim", action="store_true")
    parser.add_argument(
        "--no-sensitivity", action="store_true", help="skip the 80%% variants (full run)"
    )
    parser.add_argument("--skip-decisions", action="store_true")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile the default policies' decisions (done anyway when over budget)",
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also write results here")
    args = parser.parse_args(argv)

    requests = args.requests or (3_000 if args.quick else 10_000)
    warmup = args.warmup if args.warmup is not None else (500 if args.quick else 1_000)
    seeds = [args.seed + k for k in range(args.seeds or (1 if args.quick else 3))]
    if not 0 <= warmup < requests:
        parser.error("--warmup must be below --requests")
    decisions = args.decisions or (10_000 if args.quick else 50_000)
    try:
        loads = [float(x) for x in args.loads.split(",")]
        lo, hi = (float(x) for x in args.report_period.split(","))
        policies = parse_policies(args.policies, args.load_factor)
    except ValueError as exc:
        parser.error(str(exc))
    if not args.skip_sim and REFERENCE not in [(p.prefill, p.decode) for p in policies]:
        parser.error("--policies must include round_robin:round_robin (the reference)")
    if not all(x > 0 for x in loads) or not 0 < lo <= hi:
        parser.error("--loads must be positive and --report-period 0 < MIN <= MAX")
    spec = FleetSpec(
        prefills=args.prefills,
        decodes=args.decodes,
        prefix_cache_tokens=args.cache_tokens,
        report_period_s=(lo, hi),
        report_load=not args.no_load_reports,
    )
    scenario = Scenario(
        spec, tuple(build_workload(WorkloadSpec(), requests, seed) for seed in seeds), warmup
    )
    workload = scenario.workloads[0]
    started = time.perf_counter()

    capacity = 0.0
    rows: list[Row] = []
    sensitivity: list[Row] = []
    if not args.skip_sim:
        print("## Fleet simulation\n")
        print(describe(scenario) + "\n", flush=True)
        capacity, rows = run_fleet(scenario, policies, loads)
        print()
        print(fleet_table(rows))
        print()
        if not args.quick and not args.no_sensitivity:
            print(f"### Sensitivity at {GOAL_LOAD:.0%} load (one change at a time)\n")
            sensitivity = run_sensitivity(scenario, policies, capacity, seeds)
            print()
            print(fleet_table(sensitivity, variants=True))
            print()

    stats: list[DecisionStats] = []
    if not args.skip_decisions:
        print(f"## Decision time at {args.instances:,} instances\n", flush=True)
        features = [r.features for r in workload.requests]
        cases = [PolicyPair(*DEFAULTS), PolicyPair(*REFERENCE)]
        for mixed in (False, True):
            for policy in cases:
                stats.append(
                    measure_decisions(
                        policy,
                        mixed,
                        args.instances,
                        features,
                        decisions,
                        rebuilds=3 if args.quick else 10,
                        model=workload.spec.model,
                        seed=seeds[0],
                    )
                )
        load1, load5, _ = os.getloadavg()
        print(
            f"{decisions:,} timed decisions per row in {BLOCKS} blocks, after a warm-up "
            "(time.perf_counter_ns around plan and around each release); legs in flight: "
            "2 per P, 32 per D; announced load random around those levels; GC on, setup "
            f"objects frozen. Machine load average {load1:.1f} / {load5:.1f} (1 / 5 min) on "
            f"{os.cpu_count()} CPUs: other processes inflate the mean and the > 1 ms count, "
            "the best-block mean and p50 much less.\n"
        )
        print(decision_table(stats))
        print()
        for s in stats:
            over = max(s.decision_mean_us, s.decision_p99_us) >= DECISION_BUDGET_US
            if (args.profile or over) and s.policy == PolicyPair(*DEFAULTS).label:
                mixed = "mixed" in s.fleet
                print(f"cProfile of {decisions:,} decisions, {s.policy}, {s.fleet}:\n")
                print("```")
                print(
                    profile_decisions(
                        PolicyPair(*DEFAULTS),
                        mixed,
                        args.instances,
                        features,
                        decisions,
                        workload.spec.model,
                        seeds[0],
                    )
                )
                print("```\n")

    print("## Goals\n")
    for line in check_goals(rows, stats):
        print(line)
    print(f"\n(total {time.perf_counter() - started:.0f} s)")

    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        report: dict[str, Any] = {
            "meta": {
                "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                "python": platform.python_version(),
                "fleet": dataclasses.asdict(spec),
                "workload": dataclasses.asdict(workload.spec),
                "requests": requests,
                "warmup": warmup,
                "seeds": seeds,
                "capacity_rps": capacity,
            },
            "fleet": [dataclasses.asdict(r) for r in rows],
            "sensitivity": [dataclasses.asdict(r) for r in sensitivity],
            "decisions": [dataclasses.asdict(s) for s in stats],
        }
        out.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
