"""Real vLLM instances of different TP sizes through the proxy with pdproxy's connector: the
proxy tells the prefill the decode's TP size, each prefill rank sends each decode rank the KV
heads it needs (merging two ranks' heads into one, or slicing one rank's heads in two), and the
answer is exactly one vLLM's. The tiny model has 2 KV heads, so TP 2 holds one head per rank."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pdproxy.demo.processes import http_json, wait_until
from pdproxy.ids import parse_request_id
from tests.harness.vllm_cpu import MODEL_NAME
from tests.harness.vllm_env import VllmEnv
from tests.integration.support import metric_value
from tests.vllm.conftest import PairStack, pair_stack

pytestmark = pytest.mark.vllm

PROMPT = " ".join(["quartz", "obsidian", "jasper", "topaz", "beryl", "garnet", "onyx"] * 24)
TOKENS = 10
LAYERS, KV_HEADS, HEAD_DIM, FLOAT32 = 2, 2, 32, 4  # the tiny model's geometry


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=["p_tp2-d_tp1", "p_tp1-d_tp2"])
def stack(
    request: pytest.FixtureRequest,
    vllm_env: VllmEnv,
    vllm_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[PairStack, int, int]]:
    p_tp, d_tp = request.param
    cores = {1: "0", 2: "0|1"}  # two cores here: a TP-2 instance's ranks get one each
    with pair_stack(
        vllm_env,
        vllm_model,
        tmp_path_factory.mktemp(f"kv-tp-{p_tp}-{d_tp}"),
        (f"vllm-P-tp{p_tp}", f"vllm-D-tp{d_tp}"),
        # Legs in sequence: the TP 2 instance spans both of this machine's cores, and a decode
        # instance that already holds a request waiting for KV steps its engine without pause
        # (vLLM's busy loop), which starved the prefill's cross-rank all-reduce for minutes.
        proxy_args=["--concurrent-decode-connectors", ""],
        prefill={"tp_size": p_tp, "cpu": cores[p_tp]},
        decode={"tp_size": d_tp, "cpu": "1" if d_tp == 1 else cores[d_tp]},
    ) as made:
        yield made, p_tp, d_tp


def complete(url: str) -> openai.types.Completion:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=TOKENS, temperature=0.0, logprobs=1
    )


def external_tokens(pair: PairStack) -> float:
    """Prompt tokens the decode took from a KV transfer (vLLM's own counter)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        sample.value
        for family in text_string_to_metric_families(pair.decode.metrics_text())
        for sample in family.samples
        if sample.name == "vllm:prompt_tokens_by_source_total"
        and sample.labels.get("source") == "external_kv_transfer"
    )


def test_the_pair_is_listed_with_its_tp_ratio(stack: tuple[PairStack, int, int]) -> None:
    pair, p_tp, d_tp = stack
    listing = http_json(f"{pair.proxy.proxy_url}/v1/instances/pairs")["prefills"]
    [prefill] = listing
    [compatible] = prefill["compatible"]
    assert compatible["decodes"] == [pair.decode.http_address]
    assert compatible["tp_ratio"] == (d_tp // p_tp if d_tp >= p_tp else -(p_tp // d_tp))


def test_different_tp_sizes_give_one_vllms_answer_from_loaded_kv(
    stack: tuple[PairStack, int, int],
) -> None:
    pair, p_tp, d_tp = stack
    proxy = pair.proxy.proxy_url
    ok_before = metric_value(proxy, "pdproxy_kv_transfers_total", {"outcome": "ok"})
    external_before = external_tokens(pair)
    through = complete(proxy)
    for alone in (complete(pair.decode.url), complete(pair.prefill.url)):
        assert through.choices[0].text == alone.choices[0].text
        got, want = through.choices[0].logprobs, alone.choices[0].logprobs
        assert got is not None and want is not None
        pairs = zip(got.token_logprobs or [], want.token_logprobs or [], strict=True)
        assert all(abs((a or 0.0) - (b or 0.0)) <= 1e-3 for a, b in pairs)

    tagged = parse_request_id(through.id)
    assert tagged is not None
    prefill_leg = [r for r in pair.prefill.records("new") if tagged.uid in r["request_id"]]
    assert [r["kv_transfer_params"] for r in prefill_leg] == [{"pdproxy": {"decode_tp_size": d_tp}}]

    def mine(side: str) -> list[dict[str, object]]:
        server = pair.decode if side == "D" else pair.prefill
        return [r for r in server.records("transfer") if str(r["transfer"]).startswith(tagged.uid)]

    wait_until(lambda: len(mine("D")) == d_tp, 10, "every decode rank's transfer record")
    assert through.usage is not None
    loaded = through.usage.prompt_tokens - 1
    per_decode_rank = 2 * LAYERS * (KV_HEADS // d_tp) * HEAD_DIM * FLOAT32 * loaded
    received = mine("D")
    assert sorted(r["rank"] for r in received) == list(range(d_tp))  # type: ignore[type-var]
    assert all(r["outcome"] == "ok" and r["bytes"] == per_decode_rank for r in received)
    wait_until(lambda: len(mine("P")) == p_tp, 10, "every prefill rank's transfer record")
    sent = mine("P")
    assert all(r["outcome"] == "ok" for r in sent)
    assert sum(int(r["bytes"]) for r in sent) == d_tp * per_decode_rank  # type: ignore[call-overload]

    # The proxy counts the transfer once, when every decode rank has reported it.
    wait_until(
        lambda: metric_value(proxy, "pdproxy_kv_transfers_total", {"outcome": "ok"}) > ok_before,
        10,
        "the proxy to count the transfer",
    )
    assert metric_value(proxy, "pdproxy_kv_transfers_total", {"outcome": "ok"}) == ok_before + 1
    # vLLM's own counters: the decode took the prompt's KV from outside, computed one token.
    assert external_tokens(pair) - external_before == loaded
