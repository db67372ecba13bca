"""Faults injected into a live fleet under load: every request still ends with exactly one
complete, well-formed answer, nothing outlives its deadline, nothing stays in flight."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from pdproxy.demo.fleet import LocalFleet, Worker, WorkerSpec
from pdproxy.demo.processes import http_json, wait_until
from pdproxy.fake_vllm.deterministic_text import generated_words
from tests.conftest import FleetFactory
from tests.integration.support import metric_value, set_behaviour

MODEL = "fake-model"
TOKENS = 6
REQUEST_TIMEOUT = 20.0
FAULT_FLAGS = [
    "--connect-timeout",
    "1",
    "--prefill-timeout",
    "3",
    "--decode-first-byte-timeout",
    "3",
    "--decode-timeout",
    "3",
    "--request-timeout",
    str(REQUEST_TIMEOUT),
    "--max-attempts",
    "6",
    "--outlier-consecutive-failures",
    "3",
    "--outlier-base-ejection-seconds",
    "2",
    "--outlier-max-ejection-percent",
    "75",
]


@dataclass
class Outcome:
    client_id: str
    stream: bool
    status: int
    body: bytes
    seconds: float


def parse_stream(body: bytes) -> tuple[list[dict[str, Any]], bool]:
    """The JSON events of an SSE body, and whether it ended with [DONE]."""
    events = [e for e in body.split(b"\n\n") if e.strip()]
    done = bool(events) and events[-1] == b"data: [DONE]"
    parsed = [json.loads(e[len(b"data: ") :]) for e in events if e != b"data: [DONE]"]
    return parsed, done


def complete_answer(outcome: Outcome) -> bool:
    if outcome.status != 200:
        return False
    if not outcome.stream:
        answer = json.loads(outcome.body)
        return bool(answer["usage"]["completion_tokens"] == TOKENS and answer["choices"])
    events, done = parse_stream(outcome.body)
    texts = [c for e in events for c in e.get("choices", []) if c.get("text")]
    return done and len(texts) == TOKENS and not any("error" in e for e in events)


def expected_text(outcome: Outcome) -> bool:
    """Whether a complete answer's text is the fake model's for its prompt (request i), whole:
    a migrated stream must read exactly as an uninterrupted one."""
    prompt = f"request {outcome.client_id.removeprefix('fault-')}"
    expected = "".join(f" {w}" for w in generated_words(prompt, TOKENS))
    if not outcome.stream:
        return bool(json.loads(outcome.body)["choices"][0]["text"] == expected)
    events, _ = parse_stream(outcome.body)
    ids = {(e["id"], e["created"]) for e in events}
    text = "".join(c["text"] for e in events for c in e.get("choices", []))
    return text == expected and len(ids) == 1


def cut_mid_stream(outcome: Outcome, droppers: set[str]) -> bool:
    """A stream that got chunks, then an OpenAI-shaped error naming a decode that lost its
    connection (one that drops connections, or one killed while it streamed), then [DONE]:
    the one failure a client may see, since what it already holds cannot be taken back."""
    if outcome.status != 200 or not outcome.stream:
        return False
    events, done = parse_stream(outcome.body)
    if not done or not events or "error" not in events[-1]:
        return False
    error = events[-1]["error"]
    named = any(name in error["message"] for name in droppers)
    chunks_before = sum(1 for e in events[:-1] if e.get("choices"))
    return error["code"] == "decode_reset" and named and 0 < chunks_before < TOKENS


async def run_load(
    url: str,
    total: int,
    concurrency: int,
    at_progress: dict[int, Callable[[], Awaitable[None]]],
) -> list[Outcome]:
    outcomes: list[Outcome] = []
    done = 0
    limit = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT + 10)

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal done
        stream = i % 2 == 0
        body = {"model": MODEL, "prompt": f"request {i}", "max_tokens": TOKENS, "stream": stream}
        client_id = f"fault-{i}"
        async with limit:
            started = time.monotonic()
            headers = {"X-Request-Id": client_id}
            async with session.post(url, json=body, headers=headers) as response:
                data = await response.read()
            seconds = time.monotonic() - started
            outcomes.append(Outcome(client_id, stream, response.status, data, seconds))
            done += 1
            fault = at_progress.pop(done, None)
            if fault is not None:
                await fault()

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.wait_for(
            asyncio.gather(*(one(session, i) for i in range(total))), timeout=600
        )
    return outcomes


def all_idle(fleet: LocalFleet) -> bool:
    url = fleet.proxy_url
    legs = metric_value(url, "pdproxy_inflight_legs")
    admitted = metric_value(url, "pdproxy_admitted_requests")
    queued = metric_value(url, "pdproxy_queued_requests")
    listed = http_json(url + "/v1/instances")["instances"]
    return (
        legs == 0
        and admitted == 0
        and queued == 0
        and all(i["legs_in_flight"] == 0 for i in listed)
    )


def proxy_log_about(fleet: LocalFleet, client_ids: list[str]) -> str:
    """The proxy's log lines naming these client request ids (its retries and failures)."""
    quoted = [f"'{client_id}'" for client_id in client_ids]
    lines = (fleet.log_dir / "pdproxy.log").read_text(errors="replace").splitlines()
    return "\n".join(line for line in lines if any(q in line for q in quoted))


async def in_thread(call: Callable[[], None]) -> None:
    await asyncio.to_thread(call)


@pytest.mark.parametrize("migration", ["on", "off"])
def test_faults_under_load_reach_no_client_that_could_be_served(
    fleet_factory: FleetFactory, migration: str
) -> None:
    fleet = fleet_factory(
        [WorkerSpec("P")] * 4 + [WorkerSpec("D")] * 4, [*FAULT_FLAGS, "--migration", migration]
    )
    p_dead, p_500, _, _ = fleet.role("P")
    d_dead, d_hang, d_drop, _ = fleet.role("D")

    def kill(worker: Worker) -> Callable[[], Awaitable[None]]:
        return lambda: in_thread(lambda: worker.process.signal(signal.SIGKILL))

    def behave(worker: Worker, **behaviour: Any) -> Callable[[], Awaitable[None]]:
        return lambda: in_thread(lambda: set_behaviour(worker.url, **behaviour))

    faults = {
        100: kill(p_dead),
        300: behave(p_500, status=500),
        500: kill(d_dead),
        700: behave(d_hang, delay_ms=60_000),
        # Cuts streams after two chunks; whole answers pass, so it keeps taking traffic
        # between cuts instead of being ejected by three whole answers cut in a row.
        900: behave(d_drop, drop_after_chunks=2),
    }
    outcomes = asyncio.run(run_load(fleet.proxy_url + "/v1/completions", 2000, 32, faults))

    assert len(outcomes) == 2000
    complete = [o for o in outcomes if complete_answer(o)]
    # Without migration, a stream the killed decode was sending when it died is cut too (its
    # client already has the first chunks); one it had not begun must be served elsewhere.
    # With migration, every stream is continued on another pair: every answer is complete.
    cutters = {d_drop.http_address, d_dead.http_address}
    cut = [o for o in outcomes if cut_mid_stream(o, cutters)]
    others = [o for o in outcomes if not complete_answer(o) and not cut_mid_stream(o, cutters)]
    summary = Counter((o.stream, o.status) for o in others)
    assert not others, (
        f"{len(others)} requests failed before their first byte: {summary}; "
        f"first: {others[0].body[-600:]!r}; what the proxy logged about the first three:\n"
        + proxy_log_about(fleet, [o.client_id for o in others[:3]])
    )
    assert all(expected_text(o) for o in complete)
    migrated = metric_value(fleet.proxy_url, "pdproxy_migrations_total", {"outcome": "completed"})
    if migration == "on":
        assert not cut, f"{len(cut)} streams cut: first {cut[0].body[-600:]!r}"
        assert migrated > 0
    else:
        dropped = sum(1 for o in cut if d_drop.http_address in o.body.decode())
        assert dropped > 0 and migrated == 0
    assert len(complete) + len(cut) == 2000
    # Nobody waited past the request's deadline (client-side timing, generous slack).
    slowest = max(o.seconds for o in outcomes)
    assert slowest <= REQUEST_TIMEOUT + 2, slowest
    retries = metric_value(fleet.proxy_url, "pdproxy_retries_total")
    assert retries > 0
    assert metric_value(fleet.proxy_url, "pdproxy_outlier_ejections_total") >= 2
    wait_until(lambda: all_idle(fleet), 15, "every in-flight gauge back at 0")
    print(
        f"\nfault injection (migration {migration}): 2000 requests, 5 faults, "
        f"{len(complete)} complete, {migrated:.0f} migrated mid-stream, {len(cut)} cut "
        f"mid-stream, 0 other failures, {retries:.0f} retries, slowest {slowest:.2f}s"
    )


def test_thousands_of_mixed_outcomes_leave_nothing_in_flight(fleet_factory: FleetFactory) -> None:
    """Success, client cancel in prefill and in decode, upstream 5xx and 4xx, timeouts,
    invalid requests and queue overflow, all at once; then every gauge is 0 again."""
    fleet = fleet_factory(
        [
            WorkerSpec("P", prefill_latency_ms=20),
            WorkerSpec("P", prefill_latency_ms=20),
            WorkerSpec("D", token_latency_ms=2),
            WorkerSpec("D", token_latency_ms=2),
        ],
        [
            "--decode-first-byte-timeout",
            "1.5",
            "--decode-timeout",
            "1.5",
            "--connect-timeout",
            "1",
            "--max-inflight-requests",
            "24",
            "--max-queued-requests",
            "8",
            "--queue-timeout",
            "0.5",
            "--outlier-max-ejection-percent",
            "0",
        ],
    )
    _, p_500 = fleet.role("P")
    _, d_slow = fleet.role("D")
    set_behaviour(p_500.url, status=500)
    url = fleet.proxy_url + "/v1/completions"
    tally: Counter[str] = Counter()

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        kind = i % 8
        body: Any = {"model": MODEL, "prompt": f"mixed {i}", "max_tokens": 4}
        if kind == 1:
            body.update(stream=True, max_tokens=300)
        if kind == 2:
            body["model"] = "nobody-serves-this"
        if kind == 3:
            body["max_tokens"] = -1  # the instance's own 400
        data = b"{broken" if kind == 4 else json.dumps(body).encode()
        try:
            async with asyncio.timeout(0.01 if kind == 5 else 0.5 if kind == 6 else 30):
                # kind 5: gone during prefill; kind 6: gone mid-decode (or while queued)
                async with session.post(url, data=data) as response:
                    if kind == 1:
                        await response.content.readany()
                        response.close()
                        tally["hung_up_mid_stream"] += 1
                        return
                    await response.read()
                    tally[str(response.status)] += 1
        except TimeoutError:
            tally["client_gave_up"] += 1

    async def run() -> None:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=64, force_close=True)
        ) as session:
            limit = asyncio.Semaphore(64)

            async def bounded(i: int) -> None:
                async with limit:
                    await one(session, i)

            await asyncio.wait_for(asyncio.gather(*(bounded(i) for i in range(3000))), 300)

    set_behaviour(d_slow.url, delay_ms=2000)  # decode legs there time out (1.5 s bound)
    asyncio.run(run())
    assert sum(tally.values()) == 3000
    for expected in ("200", "400", "404", "client_gave_up", "hung_up_mid_stream"):
        assert tally[expected] > 0, tally
    assert tally["429"] + tally["503"] > 0, tally
    wait_until(lambda: all_idle(fleet), 15, "every in-flight gauge back at 0")
    # The instances saw the abandoned legs go: their own requests were aborted too.
    aborted = sum(len(w.events()["aborted"]) for w in fleet.workers)
    assert aborted > 0
    print(f"\nmixed outcomes: {dict(tally)}; legs aborted on instances: {aborted}")
