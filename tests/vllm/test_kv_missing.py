"""A prefill that dies after answering but before its KV left: the decode instance fails the
request within its timeout (or recomputes it, with on_missing_kv "recompute"), the proxy
reports it, and nothing hangs. Real vLLM on both sides."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from pdproxy.demo.processes import wait_until
from pdproxy.ids import parse_request_id
from tests.harness.vllm_cpu import MODEL_NAME
from tests.harness.vllm_env import VllmEnv
from tests.integration.support import metric_value
from tests.vllm.conftest import PairStack, pair_stack

pytestmark = pytest.mark.vllm

SEND_DELAY_S = 6.0  # the prefill holds its KV back this long: the window to kill it in
KV_TIMEOUT_S = 4.0  # how long the decode waits for it
PROMPT = "Seven silver swans swam silently southward past the old stone mill"
TOKENS = 8


@dataclass
class Stack(PairStack):
    mode: str = "fail"


@pytest.fixture(scope="module", params=["fail", "recompute"])
def stack(
    request: pytest.FixtureRequest,
    vllm_env: VllmEnv,
    vllm_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    mode: str = request.param
    with pair_stack(
        vllm_env,
        vllm_model,
        tmp_path_factory.mktemp(f"kv-missing-{mode}"),
        ("vllm-P-slow", f"vllm-D-{mode}"),
        proxy_args=["--max-attempts", "1"],
        prefill={"connector_extra": {"kv_send_delay": SEND_DELAY_S}},
        decode={"connector_extra": {"kv_timeout": KV_TIMEOUT_S, "on_missing_kv": mode}},
    ) as made:
        yield Stack(made.proxy, made.prefill, made.decode, mode)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_prefill_dying_before_its_kv_left(stack: Stack) -> None:
    reference = client(stack.decode.url).completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=TOKENS, temperature=0.0
    )
    outcome: dict[str, Any] = {}

    def through_the_proxy() -> None:
        started = time.monotonic()
        try:
            outcome["answer"] = client(stack.proxy.proxy_url).completions.create(
                model=MODEL_NAME, prompt=PROMPT, max_tokens=TOKENS, temperature=0.0
            )
        except openai.APIStatusError as exc:
            outcome["error"] = exc
        outcome["seconds"] = time.monotonic() - started

    prefills_before = metric_value(stack.proxy.proxy_url, "pdproxy_prefill_duration_seconds_count")
    caller = threading.Thread(target=through_the_proxy)
    caller.start()
    # The prefill's answer reached the proxy (counted once read whole) and the decode leg
    # reached the decode instance (the legs run concurrently for this connector), while the
    # prefill still sits on the KV: kill it.
    wait_until(
        lambda: (
            metric_value(stack.proxy.proxy_url, "pdproxy_prefill_duration_seconds_count")
            > prefills_before
            and any(r["event"] == "new" and r.get("transfer") for r in stack.decode.records())
        ),
        60,
        "the prefill's answer at the proxy and the decode leg at the decode instance",
    )
    assert stack.prefill.process is not None
    stack.prefill.process.signal(signal.SIGKILL)
    caller.join(90)
    assert not caller.is_alive(), "the request hung"
    assert outcome["seconds"] < KV_TIMEOUT_S + 30

    received = [r for r in stack.decode.records("transfer") if r["side"] == "decode"]
    assert [r["outcome"] for r in received] == ["timeout"]
    # The proxy reports it: the decode's side of the transfer counted as a timeout.
    wait_until(
        lambda: (
            metric_value(
                stack.proxy.proxy_url, "pdproxy_kv_transfers_total", {"outcome": "timeout"}
            )
            == 1
        ),
        15,
        "the proxy to count the failed transfer",
    )
    if stack.mode == "recompute":
        answer = outcome.get("answer")
        assert answer is not None, outcome.get("error")
        assert answer.choices[0].text == reference.choices[0].text
        assert parse_request_id(answer.id) is not None
    else:
        error = outcome.get("error")
        assert error is not None, outcome.get("answer")
        assert error.status_code in (502, 504), error
        body = error.body if isinstance(error.body, dict) else {}
        assert "decode" in str(body.get("message", error.message))
        failed_decodes = metric_value(
            stack.proxy.proxy_url, "pdproxy_upstream_errors_total", {"role": "decode"}
        )
        assert failed_decodes >= 1
