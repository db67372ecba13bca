"""`pip install "pdproxy[worker]"` into a real vLLM 0.32 environment disturbs nothing of vLLM's:
no installed package changes version, pip check finds nothing new, and the worker side imports
nothing of the proxy's serving stack."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.vllm_env import VllmEnv

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
INSTALL_TIMEOUT_S = 300
WORKER_MODULES = (
    "pdproxy.vllm_side.kv",
    "pdproxy.vllm_side.kv_worker",
    "pdproxy.vllm_side.kv_transport",
    "pdproxy.vllm_side.kv_tcp",
    "pdproxy.vllm_side.kv_pool",
    "pdproxy.vllm_side.kv_schedule",
    "pdproxy.vllm_side.stats_reporter",
    "pdproxy.vllm_side.announcer",
    "pdproxy.vllm_side.connector_settings",
)


def run(argv: list[str], timeout: float = INSTALL_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


def installed(python: Path) -> dict[str, str]:
    listing = run([str(python), "-m", "pip", "list", "--format=freeze"], 120)
    assert listing.returncode == 0, listing.stderr
    pairs = (line.split("==", 1) for line in listing.stdout.splitlines() if "==" in line)
    return {name.lower().replace("_", "-"): version for name, version in pairs}


def problems(python: Path) -> set[str]:
    return set(run([str(python), "-m", "pip", "check"], 120).stdout.splitlines())


def test_installing_the_worker_extra_changes_nothing_vllm_has(
    vllm_env: VllmEnv, tmp_path: Path
) -> None:
    # A venv layered on vLLM's: a .pth file puts vLLM's site-packages on its path, so pip sees
    # every package vLLM has, installs into the layer only, and vLLM's venv stays untouched.
    # (--system-site-packages would show the base interpreter's packages instead of vLLM's.)
    overlay = tmp_path / "overlay"
    made = run([str(vllm_env.python), "-m", "venv", str(overlay)], 120)
    assert made.returncode == 0, made.stderr
    python = overlay / "bin" / "python"
    paths = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    vllm_site = run([str(vllm_env.python), "-c", paths], 60).stdout.strip()
    layer_site = run([str(python), "-c", paths], 60).stdout.strip()
    (Path(layer_site) / "vllm-env.pth").write_text(vllm_site + "\n", encoding="utf-8")
    assert "torch" in installed(python), "the layer does not see vLLM's packages"
    before = installed(python)
    problems_before = problems(python)
    done = run([str(python), "-m", "pip", "install", "--quiet", f"{REPO}[worker]"])
    assert done.returncode == 0, done.stderr[-2000:]
    after = installed(python)
    changed = {name for name in before if after.get(name) != before[name]}
    assert changed == set(), {name: (before[name], after.get(name)) for name in changed}
    added = set(after) - set(before)
    assert "pdproxy" in added
    # Anything else added is a dependency vLLM does not have; none of vLLM's is replaced.
    print(f"\nadded beside vLLM: {sorted(added)}", file=sys.stderr)
    assert problems(python) <= problems_before

    modules = ", ".join(WORKER_MODULES)
    probe = (
        f"import sys, {modules}; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('fastapi', 'uvicorn') "
        "or m.startswith('pdproxy.proxy')); print(bad); sys.exit(1 if bad else 0)"
    )
    imported = run([str(python), "-c", probe], 120)
    assert imported.returncode == 0, imported.stdout + imported.stderr
