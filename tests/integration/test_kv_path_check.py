"""benchmarks/kv_path_check.py, the check of pdproxy's own KV connector path that must run as it
is on a GPU machine with torch but no vLLM: run here on CPU with --quick, between two real
processes over loopback, and its bit-for-bit check shown to catch what it must."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from pdproxy.demo.processes import ManagedProcess, wait_until

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
SCRIPT = BENCHMARKS / "kv_path_check.py"
# The proxy's own dependencies the GPU machine does not have (its image has torch and msgpack):
# the check must not import any of them, nor vLLM.
ABSENT_THERE = ("vllm", "zmq", "pydantic", "fastapi", "uvicorn", "httptools", "orjson")
PARTS = ("path", "gather", "stage", "save_layer", "transport", "scatter")
BASELINES = ("copy_via_host", "d2h", "h2d")


def poisoned_packages(where: Path) -> Path:
    """Packages named as the absent ones that fail on import, to be found before the real ones."""
    for name in ABSENT_THERE:
        package = where / name
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(
            f"raise ImportError('kv_path_check must not import {name}')\n"
        )
    return where


def test_quick_run_on_cpu_is_bit_exact_and_reports_every_figure(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    process = ManagedProcess(
        "kv_path_check",
        [sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--json", str(report_path)],
        log_path=tmp_path / "kv_path_check.log",
        # Only the poisoned packages on the path: the script finds its checkout by itself.
        env={"PYTHONPATH": str(poisoned_packages(tmp_path / "absent"))},
    )
    try:
        process.start()
        wait_until(lambda: not process.alive(), 90, "the check to finish")
        assert process.stop() == 0, process.log_tail()
    finally:
        process.stop()
    output = process.log_tail(lines=200)
    report = json.loads(report_path.read_text())
    assert report["bit_exact"] is True
    assert report["meta"]["device"] == "cpu"
    assert report["meta"]["model"]["cache_format"] == "BHNC_CPU"  # what the connector uses on CPU
    assert report["skipped"] == []
    assert [(r["dtype"], r["blocks"]) for r in report["results"]] == [
        ("float16", 1),
        ("float16", 3),
        ("bfloat16", 1),
        ("bfloat16", 3),
    ]
    for row in report["results"]:
        # Both warm-up requests and the last measured one were compared byte for byte.
        assert (row["bit_exact"], row["checks"], row["mismatches"]) == (True, 3, [])
        assert row["bytes"] == row["blocks"] * report["meta"]["bytes_per_block"][row["dtype"]]
        assert row["repeats"] == 2
        assert set(row["gb_s_median"]) == {*PARTS, *BASELINES}
        assert all(rate > 0 for rate in row["gb_s_median"].values())
        assert row["path_to_copy"] > 0
    assert "| bfloat16 | 3 | 12.0 KiB |" in output
    assert "bit-exact: yes" in output


@pytest.fixture
def kv_path_check() -> Iterator[ModuleType]:
    """The script as a module (benchmarks/ is no package: its directory goes on the path)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location("kv_path_check", SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["kv_path_check"] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("kv_path_check", None)
        sys.path.remove(str(BENCHMARKS))


def test_the_check_catches_one_flipped_bit_and_a_block_it_must_not_touch(
    kv_path_check: ModuleType,
) -> None:
    check = kv_path_check
    model = check.Model(
        layers=2,
        heads=2,
        head_dim=8,
        block_size=4,
        cache_blocks=6,
        cache_format="BHNC_CPU",
        device="cpu",
    )
    side = check.DecodeSide(model, buffer_bytes=1 << 20, wait_s=5.0)
    try:
        side.setup("bfloat16")
        targets = side.block_ids[:3]
        assert len(side.mismatches(3)) == 6  # nothing arrived yet: every target block differs
        sources = check.shuffled_blocks(6, check.PREFILL_ORDER_SEED)[:3]
        for layer, cache in enumerate(side.caches):
            for target, source in zip(targets, sources, strict=True):
                right = check.block_bytes(check.PREFILL_SEED, layer, source, model, "bfloat16")
                cache[target].copy_(right)
        assert side.mismatches(3) == []

        flipped = side.caches[1][targets[2]].view(torch.uint8)
        flipped.view(-1)[5] ^= 1
        wrong = f"layer 1 block {targets[2]} (from prefill block {sources[2]})"
        assert side.mismatches(3) == [wrong]
        flipped.view(-1)[5] ^= 1

        outside = next(b for b in range(6) if b not in targets)
        side.caches[0][outside].view(torch.uint8).view(-1)[0] ^= 0x80
        assert side.mismatches(3) == ["layer 0: a block outside the request changed"]
    finally:
        side.receiver.close()


def test_a_bad_option_is_a_clear_error_not_a_traceback(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--dtypes", "float17"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert "--dtypes: 'float17' is not a torch dtype" in done.stderr
    assert "Traceback" not in done.stderr
