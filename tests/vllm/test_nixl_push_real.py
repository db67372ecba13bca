"""pdproxy's nixl_push flow in front of real vLLM 0.32 NixlPushConnector instances (NIXL's UCX
backend on host memory, `kv_buffer_device: cpu`).

One prefill (its NIXL engine id fixed with kv_transfer_config's `engine_id`, so it can be
declared up front) and one decode serve two proxies: one told them statically
(`connector=nixl_push,engine_id=...,side_channel=HOST:PORT`), one that learns them from
`pdproxy announce --connector nixl_push --engine-id --side-channel` sidecars. Both legs go at
once; the decode leg names the prefill, registers its blocks there, and the prefill writes the
KV into them once computed.

Every answer through a proxy is the decode's own answer to the same prompt asked directly
(fresh: a `cache_salt` of its own per request). In push mode the prefill does the transfer, so
vLLM counts it there (`vllm:nixl_bytes_transferred_count`, one sample per WRITE), while the
decode counts the prompt tokens it took from outside; neither counts a failed transfer.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import openai
import pytest

from pdproxy.demo.fleet import LocalFleet
from pdproxy.demo.processes import ManagedProcess, free_ports, wait_until
from tests.harness.vllm_cpu import VllmServer
from tests.harness.vllm_env import VllmEnv
from tests.integration.support import metric_value
from tests.vllm.test_kv_transfer_real import PROMPTS
from tests.vllm.test_nixl_real import (
    ENDPOINTS,
    EXTERNAL,
    FAILED,
    GEOMETRY,
    TRANSFERS,
    Answer,
    assert_same,
    client,
    complete,
    proxy_pairs,
    sample_sum,
    sidecar,
    spec_value,
    start_both_setups,
    streamed_chat,
)

# Each test's bound: the first one's setup may start the whole fleet FLEET_ATTEMPTS times.
FLEET_BUDGET_S = 1500
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(FLEET_BUDGET_S)]

ENGINE_ID = "pdproxy-push-prefill"
REGISTRATION_TIMEOUT_S = 30.0
COUNTER_TIMEOUT_S = 120.0  # vLLM publishes connector stats with its next step; a stall delays it
CONCURRENT = 4
PUSH: Final = "NixlPushConnector"
# A fresh pair's first NIXL push transfer took 30-75 s on a 2-core VM, its later ones well under
# a second: both engines spin while it is under way, and the machine starved every process for
# seconds at a time. vLLM's prefill gives the prefill->decode NIXL handshake 5 s to answer; when
# it does not, vLLM drops the push for good and its decode waits forever. The fixture makes that
# first transfer, streamed, with a bound of its own: a dropped push is then the proxy's to
# recover (the decode's first-byte bound, counted from the prefill's answer, fails the leg and
# the request is retried, with a new handshake), and each test's client bound is not spent on
# NIXL's warm-up, nor does a late transfer land in the next test's counters.
WARM_UP_TIMEOUT_S = 300.0
# A fresh pair can also wedge for good on a starved machine, past what the proxy can recover:
# the prefill's handshake timed out, the proxy's retry after its first-byte bound made a new one,
# and then the decode's worker took no more work (vLLM's "No available shared memory broadcast
# block found in 60 seconds"), so no later attempt on that pair could finish. The fixture then
# prints what the logs said and starts a fresh pair; a flow that never works still fails.
FLEET_ATTEMPTS = 2
# While a push is under way, both engines' worker threads and NIXL's progress threads spin; on
# CPU, vLLM's NIXL worker also moves its model thread onto the last core, which the decode's
# threads are bound to. There, the test machine's kernel left threads unscheduled for 10-195 s
# at a time (its own RCU-stall warnings said so). vLLM's prefill frees a request's KV once its
# lease (vLLM's default: 30 s, renewed by the decode's heartbeats) ran out, and the decode then
# waits for good: with a 30 s stall, two of the concurrent test's requests were lost that way.
# The lease and the client's bound are made longer than any stall seen, so a stall delays an
# answer instead of losing it; the module's tests kill nothing, so no KV is held for a decode
# that is gone. The proxy's own bounds stay at their defaults: a lost push of a streamed request
# is retried after its first-byte bound (120 s from the prefill's answer), within the client's.
KV_LEASE_S = 300
CLIENT_TIMEOUT_S = 300.0
LEASE: Final = {"kv_lease_duration": KV_LEASE_S}


@dataclass
class PushFleet:
    prefill: VllmServer
    decode: VllmServer
    proxies: dict[str, LocalFleet]  # "static" and "announced"


def static_spec(server: VllmServer, prefill: bool) -> str:
    geometry = ",".join(f"{key}={spec_value(value)}" for key, value in GEOMETRY.items())
    spec = f"http={server.http_address},zmq={server.zmq_address},connector=nixl_push,{geometry}"
    # zmq= and side_channel= are both NIXL's side channel: the request id names it too.
    return spec + (f",engine_id={ENGINE_ID},side_channel={server.zmq_address}" if prefill else "")


def push_sidecar(
    server: VllmServer, role: str, registry: str, model: Path, log: Path
) -> ManagedProcess:
    coordinates = ("--engine-id", ENGINE_ID, "--side-channel", server.zmq_address)
    extra = coordinates if role == "P" else ()
    return sidecar(server, role, registry, model, log, connector="nixl_push", extra=extra)


def start_push_fleet(
    stack: ExitStack, work: Path, vllm_env: VllmEnv, vllm_model: Path
) -> PushFleet:
    """A fresh prefill and decode, and the two proxies in front of them, stopped by `stack`."""
    p_http, p_side, d_http, d_side = free_ports(4)
    prefill = VllmServer(
        "push-P",
        "kv_producer",
        p_http,
        p_side,
        work,
        cpu="0",
        kv_connector=PUSH,
        engine_id=ENGINE_ID,
        connector_extra=LEASE,
    )
    decode = VllmServer(
        "push-D",
        "kv_consumer",
        d_http,
        d_side,
        work,
        cpu="1",
        kv_connector=PUSH,
        connector_extra=LEASE,
    )
    specs = ["--prefill", static_spec(prefill, True), "--decode", static_spec(decode, False)]
    proxies = start_both_setups(
        stack, work, vllm_env, vllm_model, (prefill, decode), specs, push_sidecar
    )
    return PushFleet(prefill, decode, proxies)


@pytest.fixture(scope="module")
def push_fleet(
    vllm_env: VllmEnv, vllm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PushFleet]:
    trouble = ""
    for attempt in range(1, FLEET_ATTEMPTS + 1):
        with ExitStack() as stack:
            work = tmp_path_factory.mktemp("nixl-push")
            fleet = start_push_fleet(stack, work, vllm_env, vllm_model)
            trouble = warm_up(fleet)
            if not trouble:
                yield fleet
                return
            print(f"\nfresh pair {attempt} of {FLEET_ATTEMPTS} wedged on its first push")
            print(trouble)
    pytest.fail(f"no fresh NIXL push pair made its first transfer; the last:\n{trouble}")


def warm_up(fleet: PushFleet) -> str:
    """The pair's first push transfer, through the static proxy, counted before any test.
    Returns "" once it is, or what the pair's and the proxy's logs said if it did not finish."""
    before = PushCounters.of(fleet)
    started = time.monotonic()
    proxy_url = fleet.proxies["static"].proxy_url
    try:
        answer = streamed_chat(client(proxy_url, WARM_UP_TIMEOUT_S), PROMPTS["multi_block"])
    except openai.APIError as exc:
        return f"{exc!r} after {time.monotonic() - started:.0f} s\n{notable_lines(fleet)}"
    moved_since(fleet, before, [answer])
    retries = metric_value(proxy_url, "pdproxy_retries_total")
    took = time.monotonic() - started
    print(f"\nthe pair's first NIXL push transfer: {took:.1f} s, {retries:g} retries")
    return ""


# What shows a wedged pair in vLLM's log (not a traceback's frames), and the proxy's outcome.
NOTABLE = re.compile(r"NIXL transfer failure|handshake|No available shared memory|zmq\.error")
FRAME = re.compile(r'\] {2}|File "|\^\^\^')  # indented after vLLM's [file:line]: a frame
SHOWN_LINES = 8


def notable_lines(fleet: PushFleet) -> str:
    shown: list[str] = []
    logs = [(server.name, server.log_path) for server in (fleet.prefill, fleet.decode)]
    logs.append(("proxy", fleet.proxies["static"].log_dir / "pdproxy.log"))
    for name, path in logs:
        text = path.read_text(encoding="utf-8", errors="replace")
        lines = [
            line
            for line in text.splitlines()
            if (NOTABLE.search(line) or "pdproxy.access" in line) and not FRAME.search(line)
        ]
        shown += [f"{name}: {line[:300]}" for line in lines[-SHOWN_LINES:]]
    return "\n".join(shown)


@dataclass(frozen=True)
class PushCounters:
    written: float  # on the prefill: one sample per NIXL WRITE
    failed: float  # both sides
    external_tokens: float  # on the decode

    @classmethod
    def of(cls, fleet: PushFleet) -> PushCounters:
        return cls(
            sample_sum(fleet.prefill, TRANSFERS),
            sample_sum(fleet.prefill, FAILED) + sample_sum(fleet.decode, FAILED),
            sample_sum(fleet.decode, "vllm:prompt_tokens_by_source_total", EXTERNAL),
        )

    def minus(self, before: PushCounters) -> PushCounters:
        return PushCounters(
            self.written - before.written,
            self.failed - before.failed,
            self.external_tokens - before.external_tokens,
        )


def moved_since(fleet: PushFleet, before: PushCounters, answers: list[Answer]) -> PushCounters:
    """The counters once the decode counted every answer's prompt tokens (bounded wait)."""
    tokens = sum(answer.prompt_tokens for answer in answers)
    wait_until(
        lambda: (
            PushCounters.of(fleet).minus(before).external_tokens >= tokens
            and PushCounters.of(fleet).minus(before).written >= len(answers)
        ),
        COUNTER_TIMEOUT_S,
        f"the pair to count {len(answers)} NIXL push transfer(s)",
    )
    time.sleep(0.3)  # a stray extra transfer would be counted by now
    return PushCounters.of(fleet).minus(before)


def check_counters(moved: PushCounters, answers: list[Answer], label: str) -> None:
    print(
        f"\n{label}: prefill {TRANSFERS} +{moved.written:g}, {FAILED} (P+D) +{moved.failed:g}, "
        f'decode prompt_tokens_by_source{{source="{EXTERNAL}"}} +{moved.external_tokens:g}'
    )
    assert moved.written == len(answers)
    assert moved.failed == 0
    assert moved.external_tokens == sum(a.prompt_tokens for a in answers)


@pytest.mark.parametrize("setup", ["static", "announced"])
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_answer_through_nixl_push_is_the_decodes_own(
    push_fleet: PushFleet, setup: str, endpoint: str
) -> None:
    proxy = push_fleet.proxies[setup]
    through_proxy, directly = ENDPOINTS[endpoint]
    prompt = PROMPTS["multi_block"]
    before = PushCounters.of(push_fleet)
    through = through_proxy(client(proxy.proxy_url, CLIENT_TIMEOUT_S), prompt)
    moved = moved_since(push_fleet, before, [through])
    own = directly(client(push_fleet.decode.url, CLIENT_TIMEOUT_S), prompt)
    assert_same(through, own, f"{setup} {endpoint}")
    check_counters(moved, [through], f"{setup} {endpoint}, {through.prompt_tokens} prompt tokens")


def test_concurrent_requests_each_get_their_own_answer(push_fleet: PushFleet) -> None:
    proxy = push_fleet.proxies["static"]
    words = PROMPTS["multi_block"].split()
    # Different first words: prompts of the same length whose answers must differ.
    prompts = [" ".join([f"w{i}", *words[1:]]) for i in range(CONCURRENT)]
    before = PushCounters.of(push_fleet)
    with ThreadPoolExecutor(CONCURRENT) as pool:
        through = list(
            pool.map(lambda p: complete(client(proxy.proxy_url, CLIENT_TIMEOUT_S), p), prompts)
        )
    moved = moved_since(push_fleet, before, through)
    own = [complete(client(push_fleet.decode.url, CLIENT_TIMEOUT_S), prompt) for prompt in prompts]
    for index, (mine, theirs) in enumerate(zip(through, own, strict=True)):
        assert_same(mine, theirs, f"concurrent #{index}")
    # The equality means something: different prompts give different answers.
    assert len({answer.logprobs for answer in own}) == CONCURRENT
    check_counters(moved, through, f"{CONCURRENT} concurrent")


def test_both_setups_pair_the_push_prefill_with_its_coordinates(push_fleet: PushFleet) -> None:
    prefill, decode = push_fleet.prefill, push_fleet.decode
    for setup, proxy in push_fleet.proxies.items():
        assert proxy_pairs(proxy) == {prefill.http_address: [decode.http_address]}, setup
        listed = {item["http_address"]: item for item in proxy.instances()}
        assert listed[prefill.http_address]["connector"] == "nixl_push", setup
