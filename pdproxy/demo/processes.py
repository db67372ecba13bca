"""Starting and stopping the real processes of a local fleet (tests, the demo, benchmarks).

Each child runs in its own session, so stopping it by PID also stops anything it spawned; every
wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

LOOPBACK = "127.0.0.1"
# SIGKILL cannot be refused: a child still there after it has not yet been let run its exit on a
# starved host, so this wait is longer than any grace period.
KILL_WAIT_S = 60.0


# Ports for the servers started here are drawn below Linux's default ephemeral range (32768-
# 60999), where the kernel puts every connect() and every bind to port 0: a port chosen there and
# bound only once its server is up (30 s for vLLM) could meanwhile be handed to another socket,
# as vLLM's own free-port lookup once took a NIXL side channel's port.
SERVER_PORTS = range(20000, 32768)
PORT_DRAWS = 200


def free_port() -> int:
    """A port nothing listens on right now, outside the kernel's ephemeral range."""
    for _ in range(PORT_DRAWS):
        port = random.choice(SERVER_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((LOOPBACK, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORT_DRAWS} draws from {SERVER_PORTS}")


def free_ports(count: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < count:
        ports.add(free_port())
    return sorted(ports)


def free_port_run(count: int, attempts: int = 200) -> int:
    """The first of `count` consecutive ports nothing listens on right now (KV ports: one per
    TP rank, from a base port)."""
    for _ in range(attempts):
        base = free_port()
        if base + count - 1 > 65535:
            continue
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + count):
                    sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    # As the servers bind: connections in TIME_WAIT (thousands after a
                    # benchmark) hold their ports against a plain bind, not against them.
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    sock.bind((LOOPBACK, port))
            except OSError:
                continue
            return base
    raise RuntimeError(f"no {count} consecutive free ports in {attempts} attempts")


def pdproxy_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdproxy", *args]


@dataclass
class ManagedProcess:
    name: str
    argv: Sequence[str]
    log_path: Path | None = None
    env: dict[str, str] | None = None
    unset: tuple[str, ...] = ()  # inherited variables the child must not see
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)
    _log: IO[bytes] | None = field(default=None, init=False)

    def start(self) -> ManagedProcess:
        output: IO[bytes] | int = subprocess.DEVNULL
        if self.log_path is not None:
            self._log = self.log_path.open("ab")
            output = self._log
        self.process = subprocess.Popen(
            list(self.argv),
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={
                **{k: v for k, v in os.environ.items() if k not in self.unset},
                **(self.env or {}),
            },
        )
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)

    def stop(self, grace: float = 5.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after `grace` seconds. Returns the exit code, None
        if the child outlasted even the wait after SIGKILL."""
        if self.process is None:
            return None
        try:
            if self.process.poll() is None:
                self.signal(signal.SIGTERM)
                try:
                    self.process.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    self.signal(signal.SIGKILL)
                    self._reap_killed()
            # Children of the group that outlived their parent go too.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            return self.process.returncode
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None

    def _reap_killed(self) -> None:
        """Wait, bounded, for a child just sent SIGKILL. One still there at the bound is
        reported, not raised: stop() runs in cleanups, where an exception would hide the error
        that led there and leave the processes stopped after this one running."""
        assert self.process is not None
        try:
            self.process.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            print(
                f"{self.name} (pid {self.pid}) still there {KILL_WAIT_S:g} s after SIGKILL",
                file=sys.stderr,
            )

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])


def http_get(
    url: str, timeout: float = 2.0, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    """GET with a bound; (status, body), status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers or {}), timeout=timeout
        ) as response:
            return int(response.status), bytes(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (OSError, ValueError):
        return 0, b""


def http_json(url: str, timeout: float = 2.0) -> Any:
    status, body = http_get(url, timeout)
    if status != 200:
        raise RuntimeError(f"GET {url} answered {status}: {body[:200]!r}")
    return json.loads(body)


def wait_until(
    condition: Callable[[], bool],
    timeout: float,
    what: str,
    processes: Sequence[ManagedProcess] = (),
    interval: float = 0.05,
) -> None:
    """Poll `condition` until true; fail after `timeout` s or as soon as a process died."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return
        for proc in processes:
            if not proc.alive():
                raise RuntimeError(
                    f"{proc.name} exited while waiting for {what}:\n{proc.log_tail()}"
                )
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}\n{p.log_tail()}" for p in processes)
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}\n{tails}")
        time.sleep(interval)


def wait_http_ok(url: str, timeout: float, processes: Sequence[ManagedProcess] = ()) -> None:
    wait_until(lambda: http_get(url, 1.0)[0] == 200, timeout, f"{url} to answer 200", processes)
