"""A deterministic discrete-event simulation of a P/D-disaggregated fleet, routed by pdproxy's
real planner and policies (pdproxy/pairing) over pdproxy's real registry table.

Only the GPUs are modelled; every routing decision is the code under test:

* each arrival asks its replica's ``RegistryTable.snapshot(now)`` for the fleet (load-only
  changes show up at most every ``LOAD_REFRESH_SECONDS``, as in the proxy) and
  ``Planner.plan`` for a pair; the prefill leg is released when the prefill ends, the decode
  leg when the last token is out;
* every worker samples its ``Load(running, waiting, kv_usage)`` every ``report_period_s``
  (drawn each time; the first at a random phase) and announces it to every replica, each of
  which gets it ``delivery_s`` later (drawn per replica and message: the network and the
  registry's loop) through its own ``RegistryTable.announce``. Between reports a planner sees
  only its own legs in flight on top of the last report it got; no replica sees another's
  legs any sooner.

The model (times in simulated seconds, one simulated clock, one seeded RNG):

* prefill: one request at a time, FIFO (prefill is compute-bound: batching prompts together
  does not raise a GPU's token rate). Service time = overhead + (prompt tokens not in this
  instance's prefix cache) x per-token cost. The prefix cache is an LRU of full 16-token
  blocks keyed by (prefix identity, block index), like vLLM's chained block hashes: a hit is
  the run of leading system-prompt blocks present; every full block of the prompt (shared or
  not) is inserted when the prefill ends, so unique turns churn the cache.
* KV transfer: the prompt's KV bytes (``PairPlan.bytes_per_request``, whole blocks) over a
  fixed bandwidth, as a pure delay (no link contention).
* decode: continuous batching. A step takes base + per-sequence x batch; each running request
  produces one token per step. A request joins at the next step boundary if fewer than
  ``max_seqs`` run and its prompt fits in the free KV (KV in use = prompt + generated tokens
  of the running requests); otherwise it waits (FIFO). No preemption: a batch may overshoot
  the KV capacity by the tokens it generates.
* replicas: with several planners (``FleetSim(planner=[...])``), each one a proxy replica with
  its own table, legs in flight, prefix-cache estimate and rings, arrivals are dealt to them in
  turn (an L4 balancer's round robin); each worker announces to every one of them
  (pdproxy.vllm_side.fanout), each table getting the announcement at its own time.
* TTFT = arrival -> prefill queue + prefill -> KV transfer -> decode queue -> end of the first
  decode step the request takes part in.
"""

from __future__ import annotations

import functools
import heapq
import math
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from workload import Request

from pdproxy.base.roles import Role
from pdproxy.ids import Address
from pdproxy.pairing.geometry import PairPlan, plan_pair, side_of
from pdproxy.pairing.planner import NoPair, Pair, Planner
from pdproxy.registry.messages import Announcement, Connector, Geometry, Load
from pdproxy.registry.table import Change, RegistryTable

# Llama 3.1 8B, TP 1, bf16 KV, vLLM's default 16-token blocks: 128 KiB of KV per token.
LLAMA_8B = Geometry(
    tp_size=1,
    block_size=16,
    num_layers=32,
    num_kv_heads=8,
    head_dim=128,
    kv_dtype="bfloat16",
    is_mla=False,
    kv_layout="HND",
)


@dataclass(frozen=True, slots=True)
class FleetSpec:
    prefills: int = 8
    decodes: int = 8
    prefill_s_per_token: float = 0.1e-3  # uncached prompt tokens: 10k tokens/s per GPU
    prefill_overhead_s: float = 5e-3  # per prefill (scheduling, sampling, the HTTP leg)
    prefix_cache_tokens: int = 262_144  # per prefill instance (about 32 GiB of KV)
    block_tokens: int = 16
    decode_step_s: float = 8e-3  # a decode step with an empty batch ...
    decode_step_s_per_seq: float = 0.06e-3  # ... plus this per running sequence
    decode_max_seqs: int = 256  # vLLM's max_num_seqs
    decode_kv_tokens: int = 262_144  # per decode instance; also the planner's kv capacity
    kv_bytes_per_s: float = 25e9  # P -> D KV bandwidth (RDMA / NVLink class)
    report_period_s: tuple[float, float] = (1.0, 3.0)  # each report's gap, uniform
    # A prefill's work (Load.prefill_tokens), sampled this often and announced when it changed
    # (pdproxy's connector: PREFILL_WORK_REPORT_S); None: prefills announce no work.
    work_report_s: float | None = None
    delivery_s: tuple[float, float] = (0.2e-3, 2e-3)  # a report's trip to a replica, uniform
    report_load: bool = True  # False: announcements carry no load (in-flight counts only)
    geometry: Geometry = LLAMA_8B
    connector: Connector = Connector.P2P_NCCL


class SimError(RuntimeError):
    pass


@dataclass(slots=True)
class Job:
    request: Request
    arrival: float
    pair: Pair | None = None
    prefill_start: float = math.nan
    prefill_end: float = math.nan
    kv_ready: float = math.nan  # KV landed on the decode instance
    decode_join: float = math.nan  # admitted into the decode batch
    first_token: float = math.nan
    done: float = math.nan
    cached_tokens: int = 0
    join_step: int = 0
    replica: int = 0  # the planner (proxy replica) that placed it


class PrefixCache:
    """An LRU of full KV blocks keyed by (prefix identity, block index), stored as runs.

    The blocks of one prefix are always used together, from block 0 on (vLLM's block hashes
    are chained: block i hits only if blocks 0..i-1 do), so they share one recency and are
    kept as one run: prefix identity -> how many leading blocks are cached. Eviction takes
    blocks from the tail of the least recently used run first, as vLLM frees a request's
    blocks tail first. Same hits as a per-block LRU, in O(1) per request.
    """

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.size = 0  # blocks cached
        self._runs: OrderedDict[int, int] = OrderedDict()

    def leading_hits(self, prefix: int, blocks: int) -> int:
        """How many of the first `blocks` blocks of `prefix` are cached; touches them."""
        cached = self._runs.get(prefix, 0)
        if cached:
            self._runs.move_to_end(prefix)
        return min(cached, blocks)

    def insert(self, prefix: int, blocks: int) -> None:
        """The first `blocks` blocks of `prefix` were just computed (or reused)."""
        if blocks <= 0:
            return
        cached = self._runs.pop(prefix, 0)
        self._runs[prefix] = max(cached, blocks)
        self.size += max(cached, blocks) - cached
        while self.size > self.capacity:
            oldest, count = next(iter(self._runs.items()))
            excess = self.size - self.capacity
            if count <= excess:
                del self._runs[oldest]
                self.size -= count
            else:
                self._runs[oldest] = count - excess  # keeps its place in the LRU order
                self.size -= excess


@dataclass
class PrefillWorker:
    index: int
    http_address: Address
    zmq_address: Address
    cache: PrefixCache
    queue: deque[Job] = field(default_factory=deque)
    running: Job | None = None


@dataclass
class DecodeWorker:
    index: int
    http_address: Address
    zmq_address: Address
    waiting: deque[Job] = field(default_factory=deque)
    running: list[tuple[int, int, Job]] = field(default_factory=list)  # heap: (finish step, ...)
    joined: list[Job] = field(default_factory=list)  # first token at the end of this step
    steps: int = 0
    stepping: bool = False
    sum_prompt: int = 0
    sum_join: int = 0
    peak_kv: int = 0  # most KV tokens held at once

    @property
    def kv_tokens(self) -> int:
        # Each running request holds its prompt plus the tokens generated since it joined.
        return self.sum_prompt + len(self.running) * self.steps - self.sum_join


@dataclass(frozen=True, slots=True)
class RunResult:
    jobs: tuple[Job, ...]  # the measured ones (after the warm-up), in arrival order
    throughput_rps: float  # completions between the first and the last measured arrival
    prefill_busy: tuple[float, ...]  # each prefill's busy fraction with the measured requests
    snapshots: int  # distinct snapshots the planner saw (index rebuilds)
    decode_kv_peak: float  # the fullest decode instance's peak KV use, as a fraction


def prefill_address(i: int) -> tuple[Address, Address]:
    return Address(f"10.0.0.{i + 1}", 8100), Address(f"10.0.0.{i + 1}", 21001)


def decode_address(i: int) -> tuple[Address, Address]:
    return Address(f"10.0.1.{i + 1}", 8200), Address(f"10.0.1.{i + 1}", 22001)


class FleetSim:
    def __init__(
        self,
        spec: FleetSpec,
        planner: Planner | Sequence[Planner],
        requests: tuple[Request, ...],
        rate: float,
        *,
        seed: int,
        model: str,
        warmup: int,
        warmup_rate: float,
    ) -> None:
        self.spec = spec
        self.planners = (planner,) if isinstance(planner, Planner) else tuple(planner)
        self.planner = self.planners[0]
        self.requests = requests
        self.rate = rate
        self.model = model
        self.warmup = warmup
        self.warmup_rate = warmup_rate
        self.rng = random.Random(seed)
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.tables = [
            RegistryTable(ttl=3600.0, max_instances=spec.prefills + spec.decodes)
            for _ in self.planners
        ]
        capacity_blocks = spec.prefix_cache_tokens // spec.block_tokens
        self.prefills = [
            PrefillWorker(i, *prefill_address(i), PrefixCache(capacity_blocks))
            for i in range(spec.prefills)
        ]
        self.decodes = [DecodeWorker(i, *decode_address(i)) for i in range(spec.decodes)]
        self._prefill_at = {w.http_address: w for w in self.prefills}
        self._decode_at = {w.http_address: w for w in self.decodes}
        self.jobs: list[Job] = []
        self.completed = 0
        self._snapshot_ids: set[int] = set()

    # -- the event queue -------------------------------------------------------------------

    def at(self, when: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (when, self._seq, action))

    def run(self) -> RunResult:
        # Registered everywhere before the first arrival; load reports start at random phases.
        if self.spec.work_report_s is not None:
            for planner in self.planners:
                planner.inflight.follow_work()
        for worker in self.prefills:
            self._announce_now(Role.PREFILL, worker.http_address, worker.zmq_address, Load())
            self.at(self._first_report(), functools.partial(self._report_prefill, worker))
            if self.spec.work_report_s is not None:
                first = self.rng.uniform(0, self.spec.work_report_s)
                self.at(first, functools.partial(self._report_work, worker, None))
        for dworker in self.decodes:
            self._announce_now(Role.DECODE, dworker.http_address, dworker.zmq_address, Load())
            self.at(self._first_report(), functools.partial(self._report_decode, dworker))
        t = 0.0
        for request in self.requests:
            # The warm-up requests arrive at warmup_rate: caches fill without the backlog
            # that cold misses would otherwise leave behind at a high load.
            t += request.gap / (self.warmup_rate if request.index < self.warmup else self.rate)
            job = Job(request, t)
            self.jobs.append(job)
            self.at(t, functools.partial(self._arrive, job))
        total = len(self.requests)
        while self.completed < total:
            if not self._events:
                raise SimError("event queue ran dry with requests unfinished")
            self.now, _, action = heapq.heappop(self._events)
            action()
        if any(planner.inflight.total_requests() for planner in self.planners):
            raise SimError("legs still in flight after every request finished")
        measured = tuple(self.jobs[self.warmup :])
        start, end = measured[0].arrival, measured[-1].arrival
        # Completions inside the arrival window: the offered rate below capacity, the
        # service rate above it (a drain after the last arrival would bias either).
        done = sum(1 for job in self.jobs if start <= job.done <= end)
        busy = dict.fromkeys(self._prefill_at, 0.0)
        for job in measured:
            assert job.pair is not None
            busy[job.pair.prefill.http_address] += job.prefill_end - job.prefill_start
        fractions = tuple(b / (end - start) for b in busy.values())
        peak = max(w.peak_kv for w in self.decodes) / self.spec.decode_kv_tokens
        return RunResult(measured, done / (end - start), fractions, len(self._snapshot_ids), peak)

    # -- announcements ---------------------------------------------------------------------

    def _announce_now(self, role: Role, http: Address, zmq: Address, load: Load) -> None:
        for table in self.tables:
            table.announce(self._announcement(role, http, zmq, load), self.now)

    def _announce(self, role: Role, http: Address, zmq: Address, load: Load) -> None:
        """To every replica, each getting it after its own delivery delay."""
        if not self.spec.report_load:
            return  # registered once; heartbeats without load change nothing
        announcement = self._announcement(role, http, zmq, load)
        for table in self.tables:
            delay = self.rng.uniform(*self.spec.delivery_s)
            self.at(
                self.now + delay,
                functools.partial(self._deliver, table, announcement),
            )

    def _deliver(self, table: RegistryTable, announcement: Announcement) -> None:
        change, instance = table.announce(announcement, self.now)
        load = instance.load
        # What the registry server hands the planner as each report arrives.
        if change is not Change.REFRESHED and load is not None and load.prefill_tokens is not None:
            planner = self.planners[self.tables.index(table)]
            planner.inflight.announced_work(instance.http_address, load.prefill_tokens)

    def _announcement(self, role: Role, http: Address, zmq: Address, load: Load) -> Announcement:
        spec = self.spec
        return Announcement(
            version=1,
            role=role,
            http_address=http,
            zmq_address=zmq,
            model=self.model,
            connector=spec.connector,
            geometry=spec.geometry,
            load=load,
        )

    def _first_report(self) -> float:
        """Workers start at random phases of their report period."""
        return self.rng.uniform(*self.spec.report_period_s) * self.rng.random()

    def _next_report(self) -> float:
        return self.now + self.rng.uniform(*self.spec.report_period_s)

    def _prefill_load(self, worker: PrefillWorker) -> Load:
        running = worker.running
        used = 0 if running is None else running.request.prompt_tokens
        work = None
        if self.spec.work_report_s is not None:
            # As the connector counts it (vllm_side/load_tracker.py): a queued prompt in full
            # (its cache hits are known when it is scheduled), the running one's rest.
            work = sum(job.request.prompt_tokens for job in worker.queue)
            if running is not None:
                end = running.prefill_start + self._prefill_s(running)
                work += max(0, round((end - self.now) / self.spec.prefill_s_per_token))
        return Load(
            running=0 if running is None else 1,
            waiting=len(worker.queue),
            kv_usage=min(1.0, used / self.spec.prefix_cache_tokens),
            prefill_tokens=work,
        )

    def _report_prefill(self, worker: PrefillWorker) -> None:
        load = self._prefill_load(worker)
        self._announce(Role.PREFILL, worker.http_address, worker.zmq_address, load)
        self.at(self._next_report(), lambda: self._report_prefill(worker))

    def _report_work(self, worker: PrefillWorker, last: Load | None) -> None:
        """Between the load reports: the work, announced when it changed."""
        load = self._prefill_load(worker)
        if last is None or load.prefill_tokens != last.prefill_tokens:
            self._announce(Role.PREFILL, worker.http_address, worker.zmq_address, load)
        period = self.spec.work_report_s
        assert period is not None
        self.at(self.now + period, lambda: self._report_work(worker, load))

    def _report_decode(self, worker: DecodeWorker) -> None:
        load = Load(
            running=len(worker.running),
            waiting=len(worker.waiting),
            kv_usage=min(1.0, worker.kv_tokens / self.spec.decode_kv_tokens),
        )
        self._announce(Role.DECODE, worker.http_address, worker.zmq_address, load)
        self.at(self._next_report(), lambda: self._report_decode(worker))

    # -- requests --------------------------------------------------------------------------

    def _arrive(self, job: Job) -> None:
        job.replica = job.request.index % len(self.planners)
        snapshot = self.tables[job.replica].snapshot(self.now)
        self._snapshot_ids.add(id(snapshot))
        choice = self.planners[job.replica].plan(snapshot, job.request.features)
        if isinstance(choice, NoPair):
            raise SimError(f"no pair: {choice.reason}")
        job.pair = choice
        worker = self._prefill_at[choice.prefill.http_address]
        worker.queue.append(job)
        if worker.running is None:
            self._start_prefill(worker)

    def _start_prefill(self, worker: PrefillWorker) -> None:
        job = worker.queue.popleft()
        worker.running = job
        request = job.request
        block = self.spec.block_tokens
        shared_blocks = request.shared_tokens // block
        if request.system is not None:
            hits = worker.cache.leading_hits(request.system, shared_blocks)
            # vLLM always computes at least the prompt's last token.
            job.cached_tokens = min(hits * block, request.prompt_tokens - 1)
        job.prefill_start = self.now
        self.at(self.now + self._prefill_s(job), lambda: self._end_prefill(worker))

    def _prefill_s(self, job: Job) -> float:
        uncached = job.request.prompt_tokens - job.cached_tokens
        return self.spec.prefill_overhead_s + uncached * self.spec.prefill_s_per_token

    def _end_prefill(self, worker: PrefillWorker) -> None:
        job = worker.running
        assert job is not None and job.pair is not None
        worker.running = None
        job.prefill_end = self.now
        request = job.request
        block = self.spec.block_tokens
        blocks = request.prompt_tokens // block
        shared_blocks = request.shared_tokens // block
        if request.system is not None:
            worker.cache.insert(request.system, shared_blocks)
        # The request's own blocks (after the shared ones) follow a prefix nobody else has:
        # they are keyed by the request's (negative, unique) identity and only churn the cache.
        worker.cache.insert(-1 - request.index, blocks - shared_blocks)
        self.planners[job.replica].release(job.pair.prefill.http_address, job.pair.prefill_tokens)
        self.at(self.now + self._transfer_s(job.pair, request), lambda: self._kv_ready(job))
        if worker.queue:
            self._start_prefill(worker)

    def _transfer_s(self, pair: Pair, request: Request) -> float:
        plan = plan_pair(side_of(pair.prefill), side_of(pair.decode))
        if not isinstance(plan, PairPlan):
            return 0.0
        size = plan.bytes_per_request(request.prompt_tokens, whole_blocks=True)
        return 0.0 if size is None else size / self.spec.kv_bytes_per_s

    def _kv_ready(self, job: Job) -> None:
        assert job.pair is not None
        job.kv_ready = self.now
        worker = self._decode_at[job.pair.decode.http_address]
        worker.waiting.append(job)
        if not worker.stepping:
            self._admit(worker)
            self._start_step(worker)

    def _admit(self, worker: DecodeWorker) -> None:
        spec = self.spec
        while worker.waiting and len(worker.running) < spec.decode_max_seqs:
            job = worker.waiting[0]
            fits = worker.kv_tokens + job.request.prompt_tokens <= spec.decode_kv_tokens
            if not fits and worker.running:
                break
            worker.waiting.popleft()
            job.decode_join = self.now
            job.join_step = worker.steps
            finish = worker.steps + job.request.output_tokens
            heapq.heappush(worker.running, (finish, job.request.index, job))
            worker.sum_prompt += job.request.prompt_tokens
            worker.sum_join += worker.steps
            worker.joined.append(job)

    def _start_step(self, worker: DecodeWorker) -> None:
        if not worker.running:
            worker.stepping = False
            return
        worker.stepping = True
        spec = self.spec
        step = spec.decode_step_s + spec.decode_step_s_per_seq * len(worker.running)
        self.at(self.now + step, lambda: self._end_step(worker))

    def _end_step(self, worker: DecodeWorker) -> None:
        worker.steps += 1
        worker.peak_kv = max(worker.peak_kv, worker.kv_tokens)
        for job in worker.joined:
            job.first_token = self.now
        worker.joined.clear()
        while worker.running and worker.running[0][0] <= worker.steps:
            _, _, job = heapq.heappop(worker.running)
            assert job.pair is not None
            worker.sum_prompt -= job.request.prompt_tokens
            worker.sum_join -= job.join_step
            job.done = self.now
            self.completed += 1
            self.planners[job.replica].release(job.pair.decode.http_address, job.pair.decode_tokens)
        self._admit(worker)
        self._start_step(worker)
