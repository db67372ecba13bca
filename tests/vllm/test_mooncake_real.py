"""pdproxy's mooncake flow in front of vLLM 0.32's own MooncakeConnector (TCP protocol, on CPU).

The prefill and decode are real vLLM servers with `"kv_connector": "MooncakeConnector"`; the
proxy knows them from static declarations (`connector=mooncake,bootstrap=...` on the prefill),
sends both legs at once with a fresh transfer id, and asks the prefill's bootstrap server for
its engine id. Answers through the pair must equal what the decode computes alone (asked
directly, with a unique cache_salt so its prefix cache cannot help), greedy, for completions
and streamed chat, one at a time and a few at once; different prompts must answer differently.

TEST-ONLY SHIM: vLLM's MooncakeConnector fails at start on a CPU-only host at
`torch.accelerator.current_device_index()`. tests/harness/mooncake.py puts a `sitecustomize`
on the vLLM processes' PYTHONPATH (only theirs) that answers 0 for that one call when no
accelerator exists; nothing else of vLLM is patched. vLLM binds its bootstrap server on
0.0.0.0 itself (not configurable).
"""

from __future__ import annotations

import concurrent.futures
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from pdproxy.demo.fleet import LocalFleet
from pdproxy.demo.processes import free_ports, http_get, wait_until
from tests.harness.mooncake import MooncakeServer, ensure_libibverbs
from tests.harness.vllm_cpu import MODEL_NAME, running_servers
from tests.harness.vllm_env import VllmEnv
from tests.integration.support import metric_value

pytestmark = pytest.mark.vllm

TOKENS = 12
CONCURRENT = 4
CLIENT_TIMEOUT_S = 120.0
REGISTRATION_TIMEOUT_S = 30.0
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india"]
PROMPTS = [
    "The quick brown fox jumps over",
    " ".join(WORDS[i % len(WORDS)] for i in range(60)),  # a few KV blocks (128 tokens each)
    " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(200)),
]


@dataclass
class MooncakeStack:
    proxy: LocalFleet
    prefill: MooncakeServer
    decode: MooncakeServer

    def client(self, url: str | None = None) -> openai.OpenAI:
        base = url or self.proxy.proxy_url
        return openai.OpenAI(
            base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S
        )


@pytest.fixture(scope="module")
def mooncake_stack(
    vllm_env: VllmEnv, vllm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MooncakeStack]:
    missing = ensure_libibverbs()
    if missing is not None:
        pytest.skip(missing)
    work = tmp_path_factory.mktemp("mooncake")
    p_http, p_kv, p_boot, d_http, d_kv = free_ports(5)
    prefill = MooncakeServer("mc-P0", "kv_producer", p_http, p_kv, work, bootstrap_port=p_boot)
    decode = MooncakeServer("mc-D0", "kv_consumer", d_http, d_kv, work, cpu="1")
    # zmq= is only an identity here: MooncakeConnector ignores the request-id tag.
    specs = [
        "--prefill",
        f"http={prefill.http_address},zmq={prefill.zmq_address},model={MODEL_NAME},"
        f"connector=mooncake,bootstrap=127.0.0.1:{p_boot}",
        "--decode",
        f"http={decode.http_address},zmq={decode.zmq_address},model={MODEL_NAME},"
        "connector=mooncake",
    ]
    proxy = LocalFleet(work / "proxy", [], ["--ttl", "10", *specs])
    proxy.start()
    try:
        started = time.monotonic()
        with running_servers(vllm_env, vllm_model, [prefill, decode]):
            print(f"\nmooncake P and D serving after {time.monotonic() - started:.1f} s")
            stack = MooncakeStack(proxy, prefill, decode)
            wait_until(
                lambda: http_get(f"{proxy.proxy_url}/ready", 1.0)[0] == 200,
                REGISTRATION_TIMEOUT_S,
                "the proxy to be ready",
            )
            yield stack
    finally:
        proxy.stop()


def greedy(salt: str | None) -> dict[str, Any]:
    extra: dict[str, Any] = {"ignore_eos": True}
    if salt is not None:
        extra["cache_salt"] = salt
    return {"temperature": 0.0, "max_tokens": TOKENS, "extra_body": extra}


def complete(client: openai.OpenAI, prompt: str, salt: str | None = None) -> str:
    answer = client.completions.create(model=MODEL_NAME, prompt=prompt, **greedy(salt))
    return str(answer.choices[0].text)


def chat_streamed(client: openai.OpenAI, prompt: str, salt: str | None = None) -> str:
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": prompt}],
        stream=True,
        **greedy(salt),
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def decode_alone(stack: MooncakeStack, ask: Any, prompt: str) -> str:
    """The decode's own answer, computed fresh: a unique cache_salt keeps its prefix cache out."""
    return str(ask(stack.client(stack.decode.url), prompt, f"fresh-{uuid.uuid4().hex}"))


def vllm_counter(server: MooncakeServer, name: str, labels: dict[str, str]) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(server.metrics_text()):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


def external_tokens(stack: MooncakeStack) -> float:
    return vllm_counter(
        stack.decode, "vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"}
    )


@pytest.mark.parametrize("ask", [complete, chat_streamed], ids=["completions", "streamed_chat"])
def test_answers_through_mooncake_equal_the_decodes_own(
    mooncake_stack: MooncakeStack, ask: Any
) -> None:
    external_before = external_tokens(mooncake_stack)
    answers = []
    for prompt in PROMPTS:
        through = ask(mooncake_stack.client(), prompt)
        assert through == decode_alone(mooncake_stack, ask, prompt), prompt
        answers.append(through)
    # Different prompts, different answers: the equality above is not one constant text.
    assert len(set(answers)) == len(PROMPTS), answers
    loaded = external_tokens(mooncake_stack) - external_before
    print(
        f"\n{ask.__name__}: decode vllm:prompt_tokens_by_source_total"
        f'{{source="external_kv_transfer"}} +{loaded:.0f} for {len(PROMPTS)} requests'
    )
    # Every request's KV came over Mooncake: the decode loaded prompt tokens from the prefill.
    assert loaded >= len(PROMPTS)


def test_a_few_at_once_each_equal_the_decodes_own(mooncake_stack: MooncakeStack) -> None:
    prompts = [f"{PROMPTS[1]} number {i}" for i in range(CONCURRENT)]
    external_before = external_tokens(mooncake_stack)
    with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
        through = list(pool.map(lambda p: complete(mooncake_stack.client(), p), prompts))
    for prompt, answer in zip(prompts, through, strict=True):
        assert answer == decode_alone(mooncake_stack, complete, prompt), prompt
    loaded = external_tokens(mooncake_stack) - external_before
    print(f"\n{CONCURRENT} at once: external_kv_transfer tokens +{loaded:.0f}")
    assert loaded >= CONCURRENT
    failed = metric_value(
        mooncake_stack.proxy.proxy_url, "pdproxy_upstream_errors_total", {"role": "decode"}
    )
    assert failed == 0
