"""`pdproxy demo --once` runs the whole demo on a fresh set of ports and exits 0, leaving
nothing behind."""

from __future__ import annotations

import subprocess
from pathlib import Path

from pdproxy.demo.processes import ManagedProcess, free_ports, pdproxy_command


def run_demo(tmp_path: Path, *args: str) -> tuple[int | None, str]:
    """The demo's exit code and output; its temporary files go under tmp_path/tmp."""
    (tmp_path / "tmp").mkdir()
    demo = ManagedProcess(
        "demo",
        pdproxy_command("demo", "--once", "--token-latency-ms", "1", *args),
        tmp_path / "demo.log",
        env={"TMPDIR": str(tmp_path / "tmp")},
    ).start()
    try:
        assert demo.process is not None
        code = demo.process.wait(timeout=90)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        demo.stop()
    return code, (tmp_path / "demo.log").read_text()


def test_demo_once_exits_zero_and_removes_its_logs(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    # No --registry-port: the demo picks a free one (a fixed default would clash with a
    # registry already running on the machine).
    code, output = run_demo(tmp_path, "--port", str(port))
    assert code == 0, output
    assert "--- non-streaming /v1/completions" in output
    assert "cmpl-___prefill_addr_127.0.0.1:" in output
    assert "usage: CompletionUsage(completion_tokens=12" in output
    assert "registry on 127.0.0.1:" in output
    # A fleet that is stopping is not one to try by hand, and its temporary logs are gone.
    assert "Try it yourself" not in output
    assert list((tmp_path / "tmp").iterdir()) == []


def test_demo_keeps_the_logs_it_was_told_to_write(tmp_path: Path) -> None:
    port, registry_port = free_ports(2)
    logs = tmp_path / "logs"
    code, output = run_demo(
        tmp_path, "--port", str(port), "--registry-port", str(registry_port), "--log-dir", str(logs)
    )
    assert code == 0, output
    assert f"registry on 127.0.0.1:{registry_port}" in output
    assert (logs / "pdproxy.log").stat().st_size > 0
