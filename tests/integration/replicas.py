"""Proxy replicas for the scale-out tests: `pdproxy serve` processes on 127.0.0.1, .2, .3...
(Linux routes all of 127/8 to lo), all on the same HTTP and registry ports, as pods behind a
headless Service are, started through tests.harness.fake_dns so that one name can resolve to
all of them (the test's own table, never /etc/hosts)."""

from __future__ import annotations

import contextlib
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdproxy.demo.processes import ManagedProcess, free_port, http_json, wait_http_ok
from tests.harness.fake_dns import HOSTS_VARIABLE, write_table

START_TIMEOUT_S = 30.0


def free_on_every(hosts: Sequence[str], attempts: int = 50) -> int:
    """A port nothing listens on at any of `hosts` right now."""
    for _ in range(attempts):
        port = free_port()
        with contextlib.ExitStack() as held:
            try:
                for host in hosts:
                    sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    sock.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no port free on all of {hosts}")


def fake_dns_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "tests.harness.fake_dns", *args]


@dataclass
class Names:
    """The test's name table, handed to every process it starts."""

    path: Path
    hosts: dict[str, list[str]] = field(default_factory=dict)

    def set(self, name: str, addresses: Sequence[str]) -> None:
        self.hosts[name] = list(addresses)
        write_table(self.path, self.hosts)

    def lookup(self, name: str) -> list[str]:
        """The same table as an in-process resolver (name -> addresses)."""
        if name not in self.hosts:
            raise OSError(f"{name}: not in the test's table")
        return list(self.hosts[name])

    @property
    def env(self) -> dict[str, str]:
        return {HOSTS_VARIABLE: str(self.path)}


@dataclass
class Replica:
    host: str
    http_port: int
    registry_port: int
    log_dir: Path
    names: Names
    extra: Sequence[str] = ()
    generation: int = 0
    process: ManagedProcess | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def name(self) -> str:
        return f"proxy@{self.host}"

    def start(self) -> Replica:
        self.generation += 1
        argv = fake_dns_command(
            "serve",
            "--host",
            self.host,
            "--port",
            str(self.http_port),
            "--registry-bind",
            f"tcp://{self.host}:{self.registry_port}",
            *self.extra,
        )
        log = self.log_dir / f"{self.name}.{self.generation}.log"
        self.process = ManagedProcess(self.name, argv, log, env=self.names.env).start()
        return self

    def wait_ready(self) -> None:
        assert self.process is not None
        wait_http_ok(self.url + "/health", START_TIMEOUT_S, [self.process])

    def instances(self) -> dict[str, dict[str, Any]]:
        data = http_json(self.url + "/v1/instances", timeout=5)
        return {item["http_address"]: item for item in data["instances"]}

    def stop(self, grace: float = 10.0) -> int | None:
        return None if self.process is None else self.process.stop(grace)


class Replicas:
    """Proxy replicas on 127.0.0.1..N, stopped by PID by close() whatever happened."""

    def __init__(self, log_dir: Path, names: Names, extra: Sequence[str] = ()) -> None:
        self.log_dir = log_dir
        self.names = names
        self.extra = tuple(extra)
        self.started: list[Replica] = []

    def start(self, hosts: Sequence[str]) -> list[Replica]:
        http_port = free_on_every(hosts)
        registry_port = free_on_every(hosts)
        replicas = [
            Replica(host, http_port, registry_port, self.log_dir, self.names, self.extra)
            for host in hosts
        ]
        for replica in replicas:
            self.started.append(replica.start())
        for replica in replicas:
            replica.wait_ready()
        return replicas

    def add(self, host: str, like: Replica) -> Replica:
        """One more replica at `host`, on the ports of the others (the port must be free
        there too: it is on an address nothing else binds)."""
        replica = Replica(
            host, like.http_port, like.registry_port, self.log_dir, self.names, self.extra
        )
        self.started.append(replica.start())
        replica.wait_ready()
        return replica

    def processes(self) -> list[ManagedProcess]:
        return [r.process for r in self.started if r.process is not None]

    def close(self) -> None:
        for replica in self.started:
            replica.stop(grace=5.0)
