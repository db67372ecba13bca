"""promtool, Prometheus' own checker of the exposition format, set up once per machine.

It comes from Debian's `prometheus` package: `apt-get download` fetches the .deb without root
into a scratch directory, `dpkg-deb -x` unpacks it, and only `usr/bin/promtool` is kept, in a
cache that later runs reuse. A machine that cannot fetch it fails the tests that need it (never
skips them): the message says what went wrong.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

PACKAGE = "prometheus"
SETUP_TIMEOUT_S = 300.0


class PromtoolUnavailable(Exception):
    pass


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdproxy" / "promtool"


def promtool() -> Path:
    """The path of a working promtool, fetched and unpacked on first use."""
    cache = cache_dir()
    binary = cache / "promtool"
    cache.mkdir(parents=True, exist_ok=True)
    # Test processes running side by side fetch it once: the second waits, then finds it.
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _works(binary):
            _fetch(binary)
    return binary


def check_metrics(text: bytes) -> tuple[int, str]:
    """`promtool check metrics` of an exposition: its exit code and what it said."""
    done = subprocess.run(
        [str(promtool()), "check", "metrics"],
        input=text,
        capture_output=True,
        timeout=60,
        check=False,
    )
    return done.returncode, (done.stdout + done.stderr).decode(errors="replace")


def _works(binary: Path) -> bool:
    if not binary.is_file():
        return False
    done = subprocess.run([str(binary), "--version"], capture_output=True, timeout=30, check=False)
    return done.returncode == 0


def _fetch(binary: Path) -> None:
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise PromtoolUnavailable(f"promtool setup needs {tool} (Debian's apt and dpkg)")
    with tempfile.TemporaryDirectory(dir=binary.parent) as scratch:
        _run(["apt-get", "download", PACKAGE], Path(scratch))
        debs = sorted(Path(scratch).glob(f"{PACKAGE}_*.deb"))
        if not debs:
            raise PromtoolUnavailable(f"apt-get download {PACKAGE} left no .deb in {scratch}")
        unpacked = Path(scratch) / "root"
        _run(["dpkg-deb", "-x", str(debs[0]), str(unpacked)], Path(scratch))
        found = unpacked / "usr" / "bin" / "promtool"
        if not found.is_file():
            raise PromtoolUnavailable(f"{debs[0].name} holds no usr/bin/promtool")
        os.replace(found, binary)  # same file system: the cache never holds half a file
    if not _works(binary):
        raise PromtoolUnavailable(f"{binary} --version fails after unpacking")


def _run(argv: list[str], cwd: Path) -> None:
    try:
        subprocess.run(
            argv, cwd=cwd, capture_output=True, timeout=SETUP_TIMEOUT_S, check=True, text=True
        )
    except subprocess.CalledProcessError as exc:
        output = (exc.stdout + exc.stderr).strip()[-1500:]
        raise PromtoolUnavailable(
            f"setting up promtool: {' '.join(argv)} failed ({exc.returncode}): {output}"
        ) from None
    except subprocess.TimeoutExpired:
        raise PromtoolUnavailable(
            f"setting up promtool: {' '.join(argv)} took over {SETUP_TIMEOUT_S:g}s"
        ) from None
