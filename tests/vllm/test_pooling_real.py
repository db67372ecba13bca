"""vLLM's embeddings endpoint passed through the proxy to a real pooling instance: the tiny
model with real random weights served as an embedding model (`--runner pooling --convert
embed`, no KV connector), declared to the proxy as a decode. The vectors through the proxy are
the instance's own, and two inputs give two different vectors."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pdproxy.demo.fleet import LocalFleet
from pdproxy.demo.processes import free_ports
from tests.harness.vllm_cpu import MODEL_NAME, VllmServer, running_servers
from tests.harness.vllm_env import VllmEnv

pytestmark = pytest.mark.vllm

INPUTS = ["The quick brown fox jumps over the lazy dog", "Colourless green ideas sleep"]
TIMEOUT_S = 60.0


@dataclass
class PoolingStack:
    proxy: LocalFleet
    server: VllmServer


@pytest.fixture(scope="module")
def pooling(
    vllm_env: VllmEnv, vllm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PoolingStack]:
    work = tmp_path_factory.mktemp("pooling")
    http_port, unused_kv_port = free_ports(2)
    server = VllmServer(
        "vllm-embed",
        "kv_both",
        http_port,
        unused_kv_port,
        work,
        kv_connector=None,
        extra_args=("--runner", "pooling", "--convert", "embed"),
    )
    # A pooling instance moves no KV: its zmq address is only what a static spec must carry.
    spec = f"http={server.http_address},zmq={server.zmq_address},model={MODEL_NAME}"
    proxy = LocalFleet(work / "proxy", [], ["--decode", spec])
    proxy.start()
    try:
        with running_servers(vllm_env, vllm_model, [server]):
            yield PoolingStack(proxy, server)
    finally:
        proxy.stop()


def post(base: str, path: str, payload: Any) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        base + path, json.dumps(payload).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_embeddings_through_the_proxy_are_the_instances_own(pooling: PoolingStack) -> None:
    payload = {"model": MODEL_NAME, "input": INPUTS}
    status, through = post(pooling.proxy.proxy_url, "/v1/embeddings", payload)
    assert status == 200, through
    status, direct = post(pooling.server.url, "/v1/embeddings", payload)
    assert status == 200, direct
    vectors = [item["embedding"] for item in through["data"]]
    assert vectors == [item["embedding"] for item in direct["data"]]
    assert through["usage"] == direct["usage"] and through["model"] == MODEL_NAME
    assert len(vectors) == 2 and len(vectors[0]) > 1
    assert vectors[0] != vectors[1]  # real weights: different inputs, different vectors


def test_a_pooling_instances_own_error_comes_back_verbatim(pooling: PoolingStack) -> None:
    payload = {"model": MODEL_NAME}  # no input
    through = post(pooling.proxy.proxy_url, "/v1/embeddings", payload)
    direct = post(pooling.server.url, "/v1/embeddings", payload)
    assert 400 <= through[0] < 500
    assert through == direct
