"""Real vLLM servers running vLLM's own MooncakeConnector (TCP protocol, on CPU).

vLLM 0.32's MooncakeConnector fails at start on a host without an accelerator, at
`torch.accelerator.current_device_index()` ("Cannot access accelerator device when none is
available"). The TEST-ONLY shim below answers 0 for that one call when no accelerator exists
and changes nothing else; it is a `sitecustomize` module in a directory this harness puts on
the vLLM processes' PYTHONPATH only (never on pdproxy's, never installed). Nothing else of vLLM
is patched.
"""

from __future__ import annotations

import ctypes.util
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.harness.vllm_cpu import VllmServer

SHIM = '''"""TEST-ONLY shim (pdproxy tests/harness/mooncake.py): vLLM's MooncakeConnector asks
torch.accelerator.current_device_index(), which raises on a CPU-only host; answer 0 there."""
import torch

_current_device_index = torch.accelerator.current_device_index


def _index_or_zero(*args, **kwargs):
    if not torch.accelerator.is_available():
        return 0
    return _current_device_index(*args, **kwargs)


torch.accelerator.current_device_index = _index_or_zero
'''


APT_TIMEOUT_S = 300.0


def ensure_libibverbs() -> str | None:
    """Install Debian's libibverbs1 (the transfer engine does not import without it) when it
    is missing; None when it is there, else why it cannot be (apt-get unavailable). An apt-get
    that runs and fails raises: that is a broken machine, not a reason to skip."""
    if ctypes.util.find_library("ibverbs"):
        return None
    apt = shutil.which("apt-get")
    if apt is None:
        return "libibverbs1 is missing and apt-get is unavailable to install it"
    install = [apt, "install", "--yes", "--no-install-recommends", "libibverbs1"]
    if _apt(install, check=False).returncode != 0:  # the package lists may be stale
        _apt([apt, "update"], check=True)
        _apt(install, check=True)
    return None


def _apt(argv: list[str], check: bool) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        argv, check=check, capture_output=True, timeout=APT_TIMEOUT_S, stdin=subprocess.DEVNULL
    )


def shim_dir(work: Path) -> Path:
    directory = work / "mooncake-cpu-shim"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(SHIM, encoding="utf-8")
    return directory


@dataclass
class MooncakeServer(VllmServer):
    """A vLLM server with MooncakeConnector; a producer also serves the bootstrap server on
    `bootstrap_port` (vLLM binds it on 0.0.0.0 itself: not configurable)."""

    bootstrap_port: int = 0

    def kv_transfer_config(self) -> dict[str, Any]:
        return {
            "kv_connector": "MooncakeConnector",
            "kv_role": self.kv_role,
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
        }

    def environment(self) -> dict[str, str]:
        env = super().environment()
        env["PYTHONPATH"] = f"{shim_dir(self.work)}:{env['PYTHONPATH']}"
        env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(self.bootstrap_port)
        return env
