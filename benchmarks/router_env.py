"""A cached venv holding the Rust P/D routers that ``bench_routers.py`` compares pdproxy with.

vllm-router and sglang-router are installed from PyPI (pinned) into their own venv outside the
repo, by default ``~/.cache/pdproxy/bench-routers-venv`` (``PDPROXY_BENCH_ROUTERS_VENV``
overrides it). They are never a dependency of pdproxy. Both wheels ship the router as a
compiled extension with a small Python launcher; neither needs torch. The install refuses to
pull torch or anything CUDA: pip's dry-run report is read first, and if it lists such a
package, the routers are installed with ``--no-deps`` plus only the small runtime dependencies
the launchers import. Either way the install ends by running each router's ``--help``.

    .venv/bin/python benchmarks/router_env.py install     # create or update, print versions
    .venv/bin/python benchmarks/router_env.py python      # print the venv's interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import checkout_root  # noqa: F401  (puts the checkout on sys.path, for tests.harness)

from tests.harness.install_step import run_install_step
from tests.harness.vllm_env import _exclusive, cache_root

# The versions compared; both install on Python 3.11 from PyPI as prebuilt abi3 wheels.
ROUTER_PINS: dict[str, str] = {"vllm-router": "0.1.17", "sglang-router": "0.3.2"}
# What the routers' Python launchers import at run time (their wheels' Requires-Dist); only
# used when the normal install would pull a forbidden package.
RUNTIME_DEPS = ("setproctitle", "aiohttp", "orjson", "uvicorn", "fastapi", "requests")
# Never installed into this venv: multi-GB, and nothing a router needs.
FORBIDDEN_PREFIXES = ("torch", "nvidia-", "triton", "cuda-", "jax")
VENV_ENV_VAR = "PDPROXY_BENCH_ROUTERS_VENV"
STAMP_NAME = ".pdproxy-bench-routers"
INSTALL_TIMEOUT_S = 900.0
LOCK_TIMEOUT_S = 1000.0
CHECK_TIMEOUT_S = 60.0


class RouterEnvError(RuntimeError):
    pass


def _forbidden(name: str) -> bool:
    lowered = name.lower().replace("_", "-")
    return any(lowered.startswith(prefix) for prefix in FORBIDDEN_PREFIXES)


@dataclass(frozen=True)
class RouterEnv:
    root: Path  # the venv directory
    pins: dict[str, str] = field(default_factory=lambda: dict(ROUTER_PINS))

    @classmethod
    def default(cls, pins: dict[str, str] | None = None) -> RouterEnv:
        configured = os.environ.get(VENV_ENV_VAR)
        root = Path(configured) if configured else cache_root() / "bench-routers-venv"
        return cls(root, dict(pins or ROUTER_PINS))

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    def bin(self, name: str) -> Path:
        return self.root / "bin" / name

    @property
    def stamp(self) -> Path:
        return self.root / STAMP_NAME

    @property
    def log_path(self) -> Path:
        return self.root.parent / f"{self.root.name}-install.log"

    def requirements(self) -> list[str]:
        return [f"{name}=={version}" for name, version in sorted(self.pins.items())]

    def _stamp_text(self) -> str:
        return " ".join(self.requirements()) + "\n"

    def current(self) -> bool:
        """Installed, with exactly the pinned versions."""
        return (
            self.python.exists()
            and self.stamp.exists()
            and self.stamp.read_text(encoding="utf-8") == self._stamp_text()
        )

    def ensure(self) -> float:
        """Create or update the venv; returns the seconds spent (0 when all was cached)."""
        if self.current():
            return 0.0
        self.root.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive(self.root.parent / f".{self.root.name}.lock", LOCK_TIMEOUT_S):
            if self.current():  # another run finished it while we waited
                return 0.0
            started = time.monotonic()
            deadline = started + INSTALL_TIMEOUT_S
            with self.log_path.open("ab") as out:
                self._install(out, deadline)
            self.stamp.write_text(self._stamp_text(), encoding="utf-8")
            return time.monotonic() - started

    def _install(self, out: IO[bytes], deadline: float) -> None:
        if self.stamp.exists():
            self.stamp.unlink()
        if not self.python.exists():
            if self.root.exists():
                shutil.rmtree(self.root)  # a half-built venv from an interrupted install
            _run([sys.executable, "-m", "venv", str(self.root)], out, deadline)
        pip = [str(self.python), "-m", "pip"]
        wanted = self.requirements()
        planned = self._planned(pip, wanted, out, deadline)
        bad = sorted(name for name in planned if _forbidden(name))
        if bad:
            out.write(f"\n# would pull {bad}: installing with --no-deps\n".encode())
            _run([*pip, "install", "--only-binary=:all:", "--no-deps", *wanted], out, deadline)
            _run([*pip, "install", *RUNTIME_DEPS], out, deadline)
        else:
            _run([*pip, "install", "--only-binary=:all:", *wanted], out, deadline)
        self._check(out, deadline)

    def _planned(
        self, pip: list[str], wanted: list[str], out: IO[bytes], deadline: float
    ) -> set[str]:
        """Names of everything `pip install wanted` would install (pip's dry-run report)."""
        with tempfile.TemporaryDirectory(prefix="router-env-") as tmp:
            report = Path(tmp) / "report.json"
            argv = [*pip, "install", "--dry-run", "--only-binary=:all:", "--report", str(report)]
            _run([*argv, *wanted], out, deadline)
            data = json.loads(report.read_text(encoding="utf-8"))
        return {str(item["metadata"]["name"]) for item in data.get("install", [])}

    def _check(self, out: IO[bytes], deadline: float) -> None:
        """Every router starts (its --help), and no torch found its way in."""
        no_torch = "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)"
        checks = [
            [str(self.bin("vllm-router")), "--help"],
            [str(self.python), "-m", "sglang_router.launch_router", "--help"],
            [str(self.python), "-c", no_torch],
        ]
        for argv in checks:
            _run(argv, out, min(deadline, time.monotonic() + CHECK_TIMEOUT_S))

    def versions(self) -> dict[str, str]:
        """The installed version of each pinned router (read in the venv itself)."""
        code = (
            "import importlib.metadata as m, json, sys;"
            "print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))"
        )
        try:
            done = subprocess.run(
                [str(self.python), "-c", code, *sorted(self.pins)],
                capture_output=True,
                text=True,
                timeout=CHECK_TIMEOUT_S,
                check=True,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise RouterEnvError(f"cannot read router versions: {exc}") from None
        result: dict[str, str] = json.loads(done.stdout)
        return result


def _run(argv: list[str], out: IO[bytes], deadline: float) -> None:
    run_install_step(argv, out, deadline, RouterEnvError, "router install")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Manage the cached venv of the Rust routers.")
    parser.add_argument("action", choices=["install", "python"])
    parser.add_argument(
        "--venv",
        default=None,
        help=f"venv directory (default: ${VENV_ENV_VAR} or ~/.cache/pdproxy/bench-routers-venv)",
    )
    args = parser.parse_args(argv)
    env = RouterEnv.default() if args.venv is None else RouterEnv(Path(args.venv))
    if args.action == "python":
        print(env.python)
        return 0
    try:
        seconds = env.ensure()
        versions = env.versions()
    except RouterEnvError as exc:
        print(f"router install failed: {exc} (log: {env.log_path})", file=sys.stderr)
        return 1
    state = f"installed in {seconds:.0f} s" if seconds else "already installed"
    listed = ", ".join(f"{name} {version}" for name, version in sorted(versions.items()))
    print(f"{listed}: {state} at {env.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
