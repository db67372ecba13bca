"""pdproxy in front of real vLLM NixlConnector instances (NIXL's UCX backend on host memory).

Two real servers (a prefill and a decode, NixlConnector with `kv_buffer_device: cpu`) serve
three proxies: one that learns them from `pdproxy announce --connector nixl` sidecars, one that
is told them statically (`--prefill/--decode ...,connector=nixl,<geometry>`), and, last, one
whose prefill is reached through a relay that kills the prefill once it has answered.

Every answer through a proxy is the decode's own answer to the same prompt asked directly
(fresh: each request has a `cache_salt` of its own, so no prefix cache answers for a
transfer), and vLLM's own counters on the decode show exactly one NIXL transfer per
disaggregated request and none failed.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from pdproxy.demo.fleet import LocalFleet
from pdproxy.demo.processes import (
    LOOPBACK,
    ManagedProcess,
    free_ports,
    http_json,
    pdproxy_command,
    wait_until,
)
from tests.harness.vllm_cpu import MODEL_NAME, VllmServer, running_servers
from tests.harness.vllm_env import VllmEnv
from tests.integration.support import LoopbackServer, metric_value
from tests.vllm.test_kv_transfer_real import PROMPTS, TOKENS
from tests.vllm.test_registry_real import REAL_GEOMETRY

pytestmark = pytest.mark.vllm

# The tiny model's KV cache as vLLM builds it on CPU; NIXL asks for a head-major layout.
GEOMETRY = REAL_GEOMETRY
SIDECAR_GEOMETRY_FLAGS = ("--tp-size", "1", "--block-size", "128", "--kv-layout", "HND")
BLOCK = 128
REGISTRATION_TIMEOUT_S = 30.0
COUNTER_TIMEOUT_S = 15.0  # vLLM publishes connector stats with its next engine step
CLIENT_TIMEOUT_S = 120.0
CONCURRENT = 4
# A failed request must end within this: the proxy's retries and vLLM's failure path, with
# room for a loaded 2-core machine; the proxy's own bounds are far below it.
FAILURE_BOUND_S = 90.0

TRANSFERS = "vllm:nixl_bytes_transferred_count"  # one sample per NIXL transfer
FAILED = "vllm:nixl_num_failed_transfers_total"
EXTERNAL = "external_kv_transfer"  # vllm:prompt_tokens_by_source_total{source=...}


@dataclass
class NixlFleet:
    prefill: VllmServer
    decode: VllmServer
    proxies: dict[str, LocalFleet]  # "announced" and "static"
    env: VllmEnv
    model: Path
    work: Path


def spec_value(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def static_spec(server: VllmServer) -> str:
    """What a sidecar would announce, as a static spec: the connector and the geometry."""
    geometry = ",".join(f"{key}={spec_value(value)}" for key, value in GEOMETRY.items())
    return f"http={server.http_address},zmq={server.zmq_address},connector=nixl,{geometry}"


def sidecar(
    server: VllmServer,
    role: str,
    registry: str,
    model: Path,
    log: Path,
    connector: str = "nixl",
    extra: Sequence[str] = (),
) -> ManagedProcess:
    """`pdproxy announce` beside a stock vLLM server; NIXL's side channel stands for the KV
    endpoint (the request id names it)."""
    return ManagedProcess(
        f"announce-{server.name}",
        pdproxy_command(
            "announce",
            *("--role", role, "--http-address", server.http_address),
            *("--zmq-address", server.zmq_address, "--registry", registry),
            *("--model", MODEL_NAME, "--connector", connector),
            *("--model-config", str(model / "config.json"), *SIDECAR_GEOMETRY_FLAGS),
            *extra,
            *("--interval", "0.5"),
        ),
        log,
    )


@pytest.fixture(scope="module")
def nixl_fleet(
    vllm_env: VllmEnv, vllm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NixlFleet]:
    work = tmp_path_factory.mktemp("nixl")
    p_http, p_side, d_http, d_side = free_ports(4)
    prefill = VllmServer(
        "nixl-P", "kv_producer", p_http, p_side, work, cpu="0", kv_connector="NixlConnector"
    )
    decode = VllmServer(
        "nixl-D", "kv_consumer", d_http, d_side, work, cpu="1", kv_connector="NixlConnector"
    )
    static_args = ["--prefill", static_spec(prefill), "--decode", static_spec(decode)]
    with ExitStack() as stack:
        proxies = start_both_setups(
            stack, work, vllm_env, vllm_model, (prefill, decode), static_args, sidecar
        )
        yield NixlFleet(prefill, decode, proxies, vllm_env, vllm_model, work)


def start_both_setups(
    stack: ExitStack,
    work: Path,
    vllm_env: VllmEnv,
    vllm_model: Path,
    pair: tuple[VllmServer, VllmServer],
    static_args: list[str],
    announce: Callable[[VllmServer, str, str, Path, Path], ManagedProcess],
) -> dict[str, LocalFleet]:
    """A proxy that learns the pair from `announce` sidecars and one it is declared to, both
    stopped by `stack`; the real vLLM pair started under them."""
    announced = LocalFleet(work / "announced", [], ["--ttl", "10"])
    stack.callback(announced.stop)
    announced.start()
    static = LocalFleet(work / "static", [], ["--ttl", "10", *static_args])
    stack.callback(static.stop)
    static.start()
    started = time.monotonic()
    stack.enter_context(running_servers(vllm_env, vllm_model, list(pair)))
    print(
        f"\nreal vLLM {pair[0].name} and {pair[1].name} serving after "
        f"{time.monotonic() - started:.1f} s"
    )
    for server, role in zip(pair, ("P", "D"), strict=True):
        process = announce(
            server, role, announced.registry_address, vllm_model, work / f"{server.name}-ann.log"
        )
        stack.callback(process.stop)
        process.start()
    wait_until(
        lambda: {server.http_address for server in pair} <= announced.registered(),
        REGISTRATION_TIMEOUT_S,
        "the sidecars' announcements",
    )
    return {"announced": announced, "static": static}


def client(url: str, timeout_s: float = CLIENT_TIMEOUT_S) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout_s)


def fresh() -> dict[str, Any]:
    """Greedy, a fixed length, and a salt of its own: no prefix cache serves this request."""
    return {"temperature": 0.0, "extra_body": {"ignore_eos": True, "cache_salt": uuid.uuid4().hex}}


@dataclass(frozen=True)
class Answer:
    text: str
    prompt_tokens: int
    logprobs: tuple[float, ...]


def complete(api: openai.OpenAI, prompt: str) -> Answer:
    answer = api.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=TOKENS, logprobs=1, **fresh()
    )
    choice = answer.choices[0]
    assert answer.usage is not None and choice.logprobs is not None
    values = tuple(v for v in choice.logprobs.token_logprobs or [] if v is not None)
    return Answer(choice.text, answer.usage.prompt_tokens, values)


def chat(api: openai.OpenAI, prompt: str) -> Answer:
    answer = api.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=TOKENS,
        logprobs=True,
        **fresh(),
    )
    choice = answer.choices[0]
    assert answer.usage is not None and choice.logprobs is not None
    values = tuple(item.logprob for item in choice.logprobs.content or [])
    return Answer(choice.message.content or "", answer.usage.prompt_tokens, values)


def streamed_chat(api: openai.OpenAI, prompt: str) -> Answer:
    stream = api.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=TOKENS,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
        **fresh(),
    )
    text: list[str] = []
    values: list[float] = []
    prompt_tokens = 0
    for chunk in stream:
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            if choice.logprobs is not None:
                values += [item.logprob for item in choice.logprobs.content or []]
    return Answer("".join(text), prompt_tokens, tuple(values))


# How each endpoint is asked through the proxy, and how the decode is asked for its own answer.
ENDPOINTS: dict[str, tuple[Callable[[openai.OpenAI, str], Answer], ...]] = {
    "completions": (complete, complete),
    "streamed_chat": (streamed_chat, chat),
}


def sample_sum(server: VllmServer, name: str, source: str | None = None) -> float:
    """One sample of a real vLLM server's /metrics, summed over its label sets (0 if absent:
    vLLM exports the NIXL series once the connector reported its first stats)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(server.metrics_text()):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("source") == source:
                total += sample.value
    return total


@dataclass(frozen=True)
class Counters:
    transfers: float
    failed: float
    external_tokens: float

    @classmethod
    def of(cls, decode: VllmServer) -> Counters:
        return cls(
            sample_sum(decode, TRANSFERS),
            sample_sum(decode, FAILED),
            sample_sum(decode, "vllm:prompt_tokens_by_source_total", EXTERNAL),
        )

    def minus(self, before: Counters) -> Counters:
        return Counters(
            self.transfers - before.transfers,
            self.failed - before.failed,
            self.external_tokens - before.external_tokens,
        )


def moved_since(decode: VllmServer, before: Counters, transfers: int) -> Counters:
    """The decode's counters once `transfers` more transfers are counted (bounded wait)."""
    wait_until(
        lambda: Counters.of(decode).minus(before).transfers >= transfers,
        COUNTER_TIMEOUT_S,
        f"the decode to count {transfers} NIXL transfer(s)",
    )
    time.sleep(0.3)  # a stray extra transfer would be counted by now
    return Counters.of(decode).minus(before)


def check_counters(moved: Counters, answers: list[Answer], label: str) -> None:
    print(
        f"\n{label}: {TRANSFERS} +{moved.transfers:g}, {FAILED} +{moved.failed:g}, "
        f'prompt_tokens_by_source{{source="{EXTERNAL}"}} +{moved.external_tokens:g}'
    )
    assert moved.transfers == len(answers)
    assert moved.failed == 0
    # NIXL's decode takes every prompt token's KV from the prefill (the last one included).
    assert moved.external_tokens == sum(a.prompt_tokens for a in answers)


def assert_same(through: Answer, own: Answer, what: str) -> None:
    assert through.prompt_tokens == own.prompt_tokens, what
    assert through.text == own.text, what
    # Float32 on CPU; the decode computed the last prompt token alone here, the whole prompt
    # when asked directly: the kernels may round differently in the last bits.
    assert len(through.logprobs) == len(own.logprobs) == TOKENS, what
    close = all(abs(x - y) <= 1e-3 for x, y in zip(through.logprobs, own.logprobs, strict=True))
    assert close, (what, through.logprobs, own.logprobs)


@pytest.mark.parametrize("setup", ["announced", "static"])
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
@pytest.mark.parametrize("name", list(PROMPTS))
def test_answer_through_nixl_is_the_decodes_own(
    nixl_fleet: NixlFleet, setup: str, endpoint: str, name: str
) -> None:
    proxy, decode = nixl_fleet.proxies[setup], nixl_fleet.decode
    through_proxy, directly = ENDPOINTS[endpoint]
    before = Counters.of(decode)
    through = through_proxy(client(proxy.proxy_url), PROMPTS[name])
    moved = moved_since(decode, before, 1)
    own = directly(client(decode.url), PROMPTS[name])
    blocks = -(-through.prompt_tokens // BLOCK)
    print(f"\n{setup} {endpoint} {name}: {through.prompt_tokens} prompt tokens, {blocks} block(s)")
    assert_same(through, own, f"{setup} {endpoint} {name}")
    check_counters(moved, [through], f"{setup} {endpoint} {name}")


@pytest.mark.parametrize("setup", ["announced", "static"])
def test_concurrent_requests_each_get_their_own_answer(nixl_fleet: NixlFleet, setup: str) -> None:
    proxy, decode = nixl_fleet.proxies[setup], nixl_fleet.decode
    words = PROMPTS["multi_block"].split()
    # Different first words: prompts of the same length whose answers must differ.
    prompts = [" ".join([f"w{i}", *words[1:]]) for i in range(CONCURRENT)]
    before = Counters.of(decode)
    with ThreadPoolExecutor(CONCURRENT) as pool:
        through = list(pool.map(lambda p: complete(client(proxy.proxy_url), p), prompts))
    moved = moved_since(decode, before, CONCURRENT)
    own = [complete(client(decode.url), prompt) for prompt in prompts]
    for index, (mine, theirs) in enumerate(zip(through, own, strict=True)):
        assert_same(mine, theirs, f"{setup} concurrent #{index}")
    # The equality means something: different prompts give different answers.
    assert len({answer.logprobs for answer in own}) == CONCURRENT
    check_counters(moved, through, f"{setup} {CONCURRENT} concurrent")


def test_both_setups_list_the_same_nixl_pair(nixl_fleet: NixlFleet) -> None:
    """Announced or declared, the proxy holds the same connector and geometry, and pairs them."""
    for setup, proxy in nixl_fleet.proxies.items():
        listed = {item["http_address"]: item for item in proxy.instances()}
        for server in (nixl_fleet.prefill, nixl_fleet.decode):
            item = listed[server.http_address]
            assert item["connector"] == "nixl", setup
            assert item["geometry"] == GEOMETRY, setup
        pairs = proxy_pairs(proxy)
        assert pairs == {nixl_fleet.prefill.http_address: [nixl_fleet.decode.http_address]}, setup


def proxy_pairs(proxy: LocalFleet) -> dict[str, list[str]]:
    report = http_json(f"{proxy.proxy_url}/v1/instances/pairs")["prefills"]
    return {
        item["prefill"]: [d for group in item["compatible"] for d in group["decodes"]]
        for item in report
    }


class KillAfterAnswer(LoopbackServer):
    """Stands for the prefill instance: relays the first request to the real prefill and,
    once it has answered, kills it (SIGKILL to its process group) before passing the answer
    on, so the decode is sent to pull KV from a prefill that is gone. Later connections are
    closed unanswered, as a dead instance's would be."""

    def __init__(self, target: VllmServer) -> None:
        super().__init__()
        self._target = target
        self.killed_at: float | None = None

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            path = lines[0].split(" ")[1]
            headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
            length = int({k.lower(): v for k, v in headers.items()}.get("content-length", "0"))
            body = await reader.readexactly(length)
            if self.killed_at is not None:
                return
            status, answer = await asyncio.to_thread(self._relay, path, body)
            await asyncio.to_thread(self._kill)
            writer.write(
                f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(answer)}\r\nConnection: close\r\n\r\n".encode()
                + answer
            )
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    def _relay(self, path: str, body: bytes) -> tuple[int, bytes]:
        request = urllib.request.Request(
            self._target.url + path, body, {"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=CLIENT_TIMEOUT_S) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def _kill(self) -> None:
        process = self._target.process
        assert process is not None and process.process is not None
        process.signal(signal.SIGKILL)
        process.process.wait(30)
        self.killed_at = time.monotonic()


def test_a_prefill_killed_before_the_decode_pulls_ends_in_a_clear_error(
    nixl_fleet: NixlFleet,
) -> None:
    """Runs last: it kills the module's prefill. The decode's pull fails (vLLM's default
    kv_load_failure_policy "fail", vllm/v1/core/sched/scheduler.py: the request finishes with
    an error and the decode answers 500; nothing is recomputed), the proxy retries that with a
    new attempt, finds no prefill left, and the client hears a clear error within the bounds:
    no hang, and no answer computed without the KV counted as a success."""
    prefill, decode = nixl_fleet.prefill, nixl_fleet.decode
    # The decode has met this prefill (NIXL handshake done), as in a fleet that was serving.
    complete(client(nixl_fleet.proxies["static"].proxy_url), PROMPTS["short"])
    with ExitStack() as stack:
        relay = stack.enter_context(KillAfterAnswer(prefill))
        relayed = f"{LOOPBACK}:{relay.port}"
        spec = static_spec(prefill).replace(f"http={prefill.http_address}", f"http={relayed}")
        proxy = LocalFleet(
            nixl_fleet.work / "killed",
            [],
            ["--ttl", "10", "--prefill", spec, "--decode", static_spec(decode)],
        )
        stack.callback(proxy.stop)
        proxy.start()
        before = Counters.of(decode)
        sent = time.monotonic()
        status, body = post(proxy.proxy_url, PROMPTS["multi_block"])
        took = time.monotonic() - sent
        assert relay.killed_at is not None and not prefill.alive()
        moved = Counters.of(decode).minus(before)
        print(
            f"\nprefill killed after answering: the client got HTTP {status} after {took:.1f} s; "
            f"decode: {TRANSFERS} +{moved.transfers:g}, {FAILED} +{moved.failed:g}, "
            f"external tokens +{moved.external_tokens:g}; {body[:300]!r}"
        )
        assert took < FAILURE_BOUND_S
        assert status >= 500, body
        error = json.loads(body)["error"]
        assert error["message"] and error["code"], error
        # vLLM counted the failed pull and loaded nothing; the proxy saw the decode's 500 and
        # retried it (the prefill, re-run with the next attempt, was gone).
        assert moved.failed >= 1 and moved.transfers == 0 and moved.external_tokens == 0
        retried = {"role": "decode", "reason": "status_5xx"}
        assert metric_value(proxy.proxy_url, "pdproxy_retries_total", retried) == 1


def post(proxy_url: str, prompt: str) -> tuple[int, bytes]:
    payload = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": TOKENS,
        "temperature": 0.0,
        **fresh()["extra_body"],
    }
    request = urllib.request.Request(
        f"{proxy_url}/v1/completions",
        json.dumps(payload).encode(),
        {"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=FAILURE_BOUND_S + 30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()
