"""benchmarks/bare_relay.py, the floor docs/performance.md compares the pure build with, does the
wire work pdproxy does: a prefill of one token, then the client's request to the decode, whose
answer it relays. Real processes on loopback: two fast benchmark backends and the relay."""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdproxy.demo.processes import ManagedProcess, free_ports, http_json, wait_http_ok
from tests.harness.benchmark_scripts import BENCHMARKS

READY_S = 30.0


@pytest.fixture()
def relay(tmp_path: Path) -> Iterator[tuple[str, str, str]]:
    """(relay URL, prefill backend URL, decode backend URL), all serving."""
    relay_port, prefill_port, decode_port = free_ports(3)
    backend = str(BENCHMARKS / "fast_backend.py")
    processes = [
        ManagedProcess(
            "prefill",
            [sys.executable, backend, "--port", str(prefill_port), "--prefill"],
            tmp_path / "prefill.log",
        ),
        ManagedProcess(
            "decode", [sys.executable, backend, "--port", str(decode_port)], tmp_path / "decode.log"
        ),
        ManagedProcess(
            "relay",
            [
                sys.executable,
                str(BENCHMARKS / "bare_relay.py"),
                "--port",
                str(relay_port),
                "--prefill-port",
                str(prefill_port),
                "--decode-port",
                str(decode_port),
            ],
            tmp_path / "relay.log",
        ),
    ]
    try:
        for process in processes:
            process.start()
        urls = [f"http://127.0.0.1:{port}" for port in (relay_port, prefill_port, decode_port)]
        wait_http_ok(f"{urls[1]}/health", READY_S, processes)
        wait_http_ok(f"{urls[2]}/health", READY_S, processes)
        wait_http_ok(f"{urls[0]}/ready", READY_S, processes)
        yield urls[0], urls[1], urls[2]
    finally:
        for process in processes:
            process.stop()


def test_the_bare_relay_sends_a_prefill_then_relays_the_decode(
    relay: tuple[str, str, str],
) -> None:
    relay_url, prefill_url, decode_url = relay
    body = {"model": "bench", "prompt": "hello world", "max_tokens": 16}
    request = urllib.request.Request(
        f"{relay_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10.0) as response:
        assert response.status == 200
        answer = json.loads(response.read())
    # The decode backend's answer (16 tokens asked), not the prefill's one token.
    assert answer["object"] == "text_completion"
    assert answer["usage"]["completion_tokens"] == 16
    assert http_json(f"{prefill_url}/bench/stats")["completions"] == 1
    assert http_json(f"{decode_url}/bench/stats")["completions"] == 1
