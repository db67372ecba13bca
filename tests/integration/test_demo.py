"""`pdproxy demo --once` runs the whole demo on a fresh set of ports and exits 0."""

from __future__ import annotations

import subprocess
from pathlib import Path

from pdproxy.demo.processes import ManagedProcess, free_ports, pdproxy_command


def test_demo_once_exits_zero(tmp_path: Path) -> None:
    port, registry_port = free_ports(2)
    demo = ManagedProcess(
        "demo",
        pdproxy_command(
            "demo",
            "--once",
            "--port",
            str(port),
            "--registry-port",
            str(registry_port),
            "--token-latency-ms",
            "1",
            "--log-dir",
            str(tmp_path / "logs"),
        ),
        tmp_path / "demo.log",
    ).start()
    try:
        assert demo.process is not None
        code = demo.process.wait(timeout=90)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        demo.stop()
    output = (tmp_path / "demo.log").read_text()
    assert code == 0, output
    assert "--- non-streaming /v1/completions" in output
    assert "cmpl-___prefill_addr_127.0.0.1:" in output
    assert "usage: CompletionUsage(completion_tokens=12" in output
    assert f"curl -s http://127.0.0.1:{port}/v1/completions" in output
