"""A prefill's announced work steers prompts: from the worker's announcement through the
registry to the pairing, in real processes (a live `pdproxy serve`, fake workers announcing
over ZMQ).

A fake prefill announces the prompt tokens it holds (as pdproxy's connector announces the
tokens a vLLM prefill has still to compute), within PREFILL_WORK_REPORT_S; a test can force the
figure (POST /_fake/load). Prefix affinity reads it as the work other proxy replicas and
clients put there: an instance announcing a large backlog takes none of the prompts whose ring
position it owns, and takes them again once the backlog is gone; under `--workers` too, where
the registry process forwards each report to every HTTP worker.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from pdproxy.demo.fleet import LocalFleet, Worker, WorkerSpec
from pdproxy.demo.processes import wait_until
from pdproxy.fake_vllm.deterministic_text import tokenize
from tests.conftest import FleetFactory
from tests.integration.support import post_json

MODEL = "fake-model"
BACKLOG = 1_000_000  # prompt tokens: far beyond what any prompt here adds
WORDS = (
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
)


def announced(fleet: LocalFleet, worker: Worker) -> dict[str, Any] | None:
    for item in fleet.instances():
        if item["http_address"] == worker.http_address:
            load: dict[str, Any] | None = item["load"]
            return load
    return None


def wait_announced_work(fleet: LocalFleet, worker: Worker, tokens: int, what: str) -> None:
    def arrived() -> bool:
        load = announced(fleet, worker)
        return load is not None and load.get("prefill_tokens") == tokens

    wait_until(arrived, 10, f"{what} (last: {announced(fleet, worker)})", fleet.processes())


def prefills_taken(fleet: LocalFleet, prompts: list[str]) -> dict[str, int]:
    """Send each prompt once; how many prefill legs each prefill got."""
    before = {w.http_address: len(w.requests()) for w in fleet.role("P")}
    for prompt in prompts:
        answer = post_json(
            fleet.proxy_url + "/v1/completions",
            {"model": MODEL, "prompt": prompt, "max_tokens": 2},
        )
        assert answer.status == 200, answer.body
    return {
        w.http_address: sum(
            1 for r in w.requests()[before[w.http_address] :] if r["path"] == "/v1/completions"
        )
        for w in fleet.role("P")
    }


@pytest.mark.parametrize("workers", [1, 2])
def test_a_prefill_announcing_a_backlog_gets_no_prompts_until_it_clears(
    fleet_factory: FleetFactory, workers: int
) -> None:
    """With several HTTP workers the registry process forwards each report to all of them at
    once, and each places prompts by it as a single process does (each prompt here comes on a
    connection of its own, which the kernel hands to either worker)."""
    fleet = fleet_factory(
        [WorkerSpec("P"), WorkerSpec("P"), WorkerSpec("D")], ["--workers", str(workers)]
    )
    busy, free = fleet.role("P")
    for worker in (busy, free):
        wait_announced_work(fleet, worker, 0, "an idle prefill's work")
    # Prompts that start differently: their ring positions spread over both prefills.
    prompts = [f"{word} is where this prompt begins, number {i}" for i, word in enumerate(WORDS)]
    spread = prefills_taken(fleet, prompts)
    assert spread[busy.http_address] > 0 and spread[free.http_address] > 0, spread

    assert post_json(busy.url + "/_fake/load", {"prefill_tokens": BACKLOG}).status == 200
    wait_announced_work(fleet, busy, BACKLOG, "the forced backlog")
    during = prefills_taken(fleet, prompts)
    assert during == {busy.http_address: 0, free.http_address: len(prompts)}, during

    assert post_json(busy.url + "/_fake/load", {}).status == 200
    wait_announced_work(fleet, busy, 0, "the backlog cleared")
    # The same prompts go where they went first: the ring is the same, the work is gone.
    assert prefills_taken(fleet, prompts) == spread


def test_a_prefill_announces_the_prompts_it_is_working_on(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory([WorkerSpec("P", prefill_latency_ms=3000), WorkerSpec("D")])
    prefill = fleet.role("P")[0]
    wait_announced_work(fleet, prefill, 0, "an idle prefill's work")
    prompt = "count the tokens of this prompt while it is being prefilled"
    answers: list[int] = []

    def send() -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        answers.append(post_json(fleet.proxy_url + "/v1/completions", body).status)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        # The fake's tokens are the prompt's words.
        wait_announced_work(fleet, prefill, len(tokenize(prompt)), "the prompt in prefill")
    finally:
        sender.join(30)
    assert answers == [200]
    wait_announced_work(fleet, prefill, 0, "the prefill done")
