"""nginx from Debian's packages, unpacked into a cache directory: ``bench_routers.py``'s C
reference, a P/D proxy written as an nginx configuration.

Nothing is installed on the system and nothing needs root: ``apt-get download nginx`` fetches
the package (from the apt sources and package lists the machine already has) into
``~/.cache/pdproxy/bench-nginx`` (``PDPROXY_BENCH_NGINX_DIR`` overrides it), together with every
shared-library package it depends on that dpkg does not list as installed, and ``dpkg-deb -x``
unpacks them there. The unpacked libraries, if any, are found through ``LD_LIBRARY_PATH``. The
install ends by checking that the binary has the auth_request module (Debian builds it in) and
that ``ldd`` finds every library it needs. The nginx-common package (the system's config files,
service units) is not needed: the benchmark runs the binary with a prefix and a configuration of
its own.

    .venv/bin/python benchmarks/nginx_env.py install     # fetch and unpack, print the version
    .venv/bin/python benchmarks/nginx_env.py binary      # print the binary's path
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import checkout_root  # noqa: F401  (puts the checkout on sys.path, for tests.harness)

from tests.harness.install_step import run_install_step
from tests.harness.vllm_env import _exclusive, cache_root

PACKAGE = "nginx"
DIR_ENV_VAR = "PDPROXY_BENCH_NGINX_DIR"
STAMP_NAME = ".pdproxy-bench-nginx"
# The configuration bench_routers.py writes needs it (the prefill leg is an auth subrequest).
REQUIRED_MODULE = "--with-http_auth_request_module"
INSTALL_TIMEOUT_S = 300.0
LOCK_TIMEOUT_S = 400.0
CHECK_TIMEOUT_S = 30.0


class NginxEnvError(RuntimeError):
    pass


def _library_packages(depends: str) -> list[str]:
    """The shared-library packages among a Depends field's names (the first of alternatives,
    version constraints and architecture qualifiers dropped)."""
    names = []
    for clause in depends.split(","):
        first = clause.split("|")[0].strip()
        name = re.split(r"[\s(:]", first, maxsplit=1)[0]
        if name.startswith(("lib", "zlib")):
            names.append(name)
    return names


def _installed(package: str) -> bool:
    try:
        done = subprocess.run(
            ["dpkg-query", "-W", "-f=${db:Status-Abbrev}", package],
            capture_output=True,
            text=True,
            timeout=CHECK_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and done.stdout.startswith("ii")


@dataclass(frozen=True)
class NginxEnv:
    root: Path  # the cache directory; the packages are unpacked under root/tree

    @classmethod
    def default(cls) -> NginxEnv:
        configured = os.environ.get(DIR_ENV_VAR)
        return cls(Path(configured) if configured else cache_root() / "bench-nginx")

    @property
    def tree(self) -> Path:
        return self.root / "tree"

    @property
    def binary(self) -> Path:
        return self.tree / "usr" / "sbin" / "nginx"

    @property
    def stamp(self) -> Path:
        return self.root / STAMP_NAME

    @property
    def log_path(self) -> Path:
        return self.root.parent / f"{self.root.name}-install.log"

    def library_dirs(self) -> list[Path]:
        """Where the unpacked library packages put their shared objects."""
        return sorted(p for p in self.tree.glob("*lib/*-linux-gnu") if p.is_dir()) + sorted(
            p for p in self.tree.glob("usr/lib/*-linux-gnu") if p.is_dir()
        )

    def env_prefix(self) -> list[str]:
        """``env LD_LIBRARY_PATH=...`` to put before the binary, when libraries were unpacked."""
        dirs = self.library_dirs()
        if not dirs:
            return []
        return ["env", "LD_LIBRARY_PATH=" + ":".join(str(d) for d in dirs)]

    def current(self) -> bool:
        return self.binary.exists() and self.stamp.exists()

    def version(self) -> str:
        """The Debian package version that was unpacked."""
        return self.stamp.read_text(encoding="utf-8").strip()

    def ensure(self) -> float:
        """Fetch and unpack unless cached; returns the seconds spent (0 when cached)."""
        if self.current():
            return 0.0
        self.root.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive(self.root.parent / f".{self.root.name}.lock", LOCK_TIMEOUT_S):
            if self.current():  # another run finished it while we waited
                return 0.0
            started = time.monotonic()
            deadline = started + INSTALL_TIMEOUT_S
            if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
                raise NginxEnvError("apt-get and dpkg-deb are needed to fetch Debian's nginx")
            if self.root.exists():
                shutil.rmtree(self.root)  # a half-unpacked tree from an interrupted install
            self.root.mkdir(parents=True)
            with self.log_path.open("ab") as out:
                version = self._install(out, deadline)
            self.stamp.write_text(version + "\n", encoding="utf-8")
            return time.monotonic() - started

    def _install(self, out: IO[bytes], deadline: float) -> str:
        with tempfile.TemporaryDirectory(prefix="debs-", dir=self.root) as tmp:
            debs = Path(tmp)
            # apt-get download writes into the current directory
            _run(["apt-get", "download", PACKAGE], out, deadline, cwd=debs)
            found = sorted(debs.glob(f"{PACKAGE}_*.deb"))
            if len(found) != 1:
                raise NginxEnvError(f"apt-get download {PACKAGE} left {found} in {debs}")
            deb = found[0]
            version = _deb_field(deb, "Version")
            missing = [
                p for p in _library_packages(_deb_field(deb, "Depends")) if not _installed(p)
            ]
            out.write(f"\n# library packages not installed: {missing}\n".encode())
            if missing:
                _run(["apt-get", "download", *missing], out, deadline, cwd=debs)
            for item in sorted(debs.glob("*.deb")):
                _run(["dpkg-deb", "-x", str(item), str(self.tree)], out, deadline)
        self._check()
        return version

    def _check(self) -> None:
        """The auth_request module is built in, and every library resolves."""
        built = _output([*self.env_prefix(), str(self.binary), "-V"])
        if REQUIRED_MODULE not in built:
            raise NginxEnvError(f"{self.binary} was built without {REQUIRED_MODULE}")
        linked = _output([*self.env_prefix(), "ldd", str(self.binary)])
        unresolved = [line.strip() for line in linked.splitlines() if "not found" in line]
        if unresolved:
            raise NginxEnvError(f"{self.binary}: libraries not found: {unresolved}")


def _deb_field(deb: Path, name: str) -> str:
    return _output(["dpkg-deb", "-f", str(deb), name]).strip()


def _output(argv: list[str]) -> str:
    """stdout + stderr of a short check (nginx -V writes to stderr)."""
    try:
        done = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=CHECK_TIMEOUT_S,
            check=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise NginxEnvError(f"{' '.join(argv[:4])} failed: {exc}") from None
    return done.stdout


def _run(argv: list[str], out: IO[bytes], deadline: float, cwd: Path | None = None) -> None:
    run_install_step(argv, out, deadline, NginxEnvError, "nginx install", cwd=cwd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Fetch and unpack Debian's nginx (no root).")
    parser.add_argument("action", choices=["install", "binary"])
    args = parser.parse_args(argv)
    env = NginxEnv.default()
    if args.action == "binary":
        print(env.binary)
        return 0
    try:
        seconds = env.ensure()
    except NginxEnvError as exc:
        print(f"nginx install failed: {exc} (log: {env.log_path})", file=sys.stderr)
        return 1
    state = f"unpacked in {seconds:.0f} s" if seconds else "already unpacked"
    print(f"nginx {env.version()}: {state} at {env.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
