"""Benchmark: time to first token with the decode leg sent after the prefill leg (sequential)
and together with it (concurrent), through pdproxy, on real vLLM (CPU) with pdproxy's connector.

One prefill (core 0) and one decode (core 1) real vLLM server, TP 1, the tiny random-weight
model of the tests (`tests.harness.vllm_cpu`), announcing to a registry port that a pdproxy
process binds. The proxy is restarted on the same ports with `--concurrent-decode-connectors
pdproxy` or `""`, alternately, `--rounds` times; in each round `--requests` streaming
completions go through it one at a time (prompts of `--prompt-words` words, `max_tokens`
`--max-tokens`, each prompt new so no prefix cache helps) and the client notes the time to the
first SSE event that carries text, and to the end. Every process is stopped by PID in a
`finally`, also on Ctrl-C, SIGTERM and SIGHUP. Everything binds 127.0.0.1.

    .venv/bin/python benchmarks/bench_concurrent_legs.py [--rounds 4] [--requests 20]
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import checkout_root  # noqa: F401  (puts the checkout on sys.path, for tests.harness)
from unwind import run_unwound

from pdproxy.demo.fleet import LocalFleet
from pdproxy.demo.processes import LOOPBACK, free_ports, wait_until
from tests.harness.vllm_cpu import MODEL_NAME, VllmServer, running_servers, tiny_model_dir
from tests.harness.vllm_env import VllmEnv

REGISTRATION_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 120.0
MODES = {"sequential": "", "concurrent": "pdproxy"}


def one_request(port: int, words: int, max_tokens: int) -> tuple[float, float]:
    """(seconds to the first text event, seconds to the end) of one streamed completion."""
    prompt = " ".join(f"{uuid.uuid4().hex[:6]}" for _ in range(words))
    body = json.dumps(
        {
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
        }
    )
    connection = http.client.HTTPConnection(LOOPBACK, port, timeout=REQUEST_TIMEOUT_S)
    try:
        began = time.perf_counter()
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        first = None
        for raw in response:
            line = raw.decode().strip()
            text_event = line.startswith("data: {") and json.loads(line[6:])["choices"][0].get(
                "text"
            )
            if first is None and text_event:
                first = time.perf_counter() - began
        if first is None:
            raise RuntimeError("no text event in the answer")
        return first, time.perf_counter() - began
    finally:
        connection.close()


def measure(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    env = VllmEnv.default()
    env.ensure()
    work = Path(tempfile.mkdtemp(prefix="pdproxy-bench-legs-"))
    model = tiny_model_dir(env)
    proxy_port, registry_port, p_http, p_kv, d_http, d_kv = free_ports(6)
    registry = f"{LOOPBACK}:{registry_port}"
    prefill = VllmServer("vllm-P", "kv_producer", p_http, p_kv, work, registry, cpu="0")
    decode = VllmServer("vllm-D", "kv_consumer", d_http, d_kv, work, registry, cpu="1")
    wanted = {prefill.http_address, decode.http_address}
    samples: dict[str, dict[str, list[float]]] = {mode: {"ttft": [], "whole": []} for mode in MODES}
    with running_servers(env, model, [prefill, decode]):
        for round_number in range(args.rounds):
            for mode, connectors in MODES.items():
                proxy = LocalFleet(
                    work / f"proxy-{round_number}-{mode}",
                    [],
                    ["--ttl", "10", "--concurrent-decode-connectors", connectors],
                    proxy_port=proxy_port,
                    registry_port=registry_port,
                )
                proxy.start()
                try:
                    wait_until(
                        lambda proxy=proxy: wanted <= proxy.registered(),  # type: ignore[misc]
                        REGISTRATION_TIMEOUT_S,
                        "both vLLM servers registered",
                    )
                    one_request(proxy_port, args.prompt_words, args.max_tokens)  # warm-up
                    for _ in range(args.requests):
                        ttft, whole = one_request(proxy_port, args.prompt_words, args.max_tokens)
                        samples[mode]["ttft"].append(ttft)
                        samples[mode]["whole"].append(whole)
                finally:
                    proxy.stop()
                print(
                    f"round {round_number + 1}/{args.rounds} {mode}: TTFT median "
                    f"{statistics.median(samples[mode]['ttft'][-args.requests :]) * 1e3:.1f} ms",
                    file=sys.stderr,
                )
    return samples


def report(samples: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> None:
    def ms(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3

    print(
        f"\n{args.rounds} rounds x {args.requests} streamed requests per mode, prompts of "
        f"{args.prompt_words} words, max_tokens {args.max_tokens}\n"
    )
    print("| legs | TTFT p50 ms | TTFT p90 ms | whole p50 ms |")
    print("| --- | ---: | ---: | ---: |")
    for mode, values in samples.items():
        print(
            f"| {mode} | {ms(values['ttft'], 0.5):.1f} | {ms(values['ttft'], 0.9):.1f} "
            f"| {ms(values['whole'], 0.5):.1f} |"
        )
    gain = ms(samples["sequential"]["ttft"], 0.5) - ms(samples["concurrent"]["ttft"], 0.5)
    print(f"\nTTFT p50 saved by concurrent legs: {gain:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--prompt-words", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    samples = run_unwound(lambda: measure(args), (RuntimeError, TimeoutError, OSError))
    report(samples, args)


if __name__ == "__main__":
    main()
