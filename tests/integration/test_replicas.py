"""Three proxy replicas behind a real L4 balancer (HAProxy, `mode tcp`), one fleet: nothing is
lost when a replica goes.

The replicas are real `pdproxy serve` processes on 127.0.0.1, .2 and .3 (all loopback on Linux),
one port, as pods behind a headless Service; two fake prefills and two fake decodes announce
through the name `pdproxy-replicas.test`, which resolves to the three (the test's own table,
tests.harness.fake_dns, never /etc/hosts), so every replica has the whole fleet. HAProxy
health-checks each replica's /ready (three failed checks take it out, as a Kubernetes
readiness probe's default) and retries a refused connection on another replica; the
load opens one connection per request (as many clients do through an L4 balancer), half of
them streaming.

- Rolling restart, one replica at a time: the replica is taken out of the balancer first (HAProxy
  `set server ... state drain`, what Kubernetes does by removing the pod's endpoint), SIGTERMed
  (it finishes what it holds and exits 0), started again, put back once it lists the fleet:
  no request fails.
- SIGKILL of one replica under load: only requests that were already in flight fail (counted and
  printed; each started before the kill), none started after it, and the replica started
  again lists the whole fleet within one announce period and answers.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from pdproxy.demo.processes import ManagedProcess, free_port, free_ports, wait_until
from tests.integration.replicas import Names, Replica, Replicas, fake_dns_command
from tests.integration.support import post_json

NAME = "pdproxy-replicas.test"
HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
ANNOUNCE_S = 0.5
CONCURRENCY = 32
MAX_REQUESTS = 3000  # per scenario, with a time bound too
LOAD_DEADLINE_S = 45.0
REQUEST_TIMEOUT_S = 20.0
INSTALL_TIMEOUT_S = 300


def haproxy_binary() -> str:
    """HAProxy from Debian's packages, installed when missing (we run as root in CI)."""
    found = shutil.which("haproxy")
    if found:
        return found
    env = {"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    for step in (
        ["apt-get", "install", "-y", "--no-install-recommends", "haproxy"],
        ["apt-get", "update"],
        ["apt-get", "install", "-y", "--no-install-recommends", "haproxy"],
    ):
        subprocess.run(step, env=env, timeout=INSTALL_TIMEOUT_S, capture_output=True, check=False)
        found = shutil.which("haproxy")
        if found:
            return found
    pytest.fail("HAProxy is not installed and `apt-get install haproxy` did not install it")


@pytest.fixture(scope="session")
def haproxy() -> str:
    return haproxy_binary()


@dataclass
class Balancer:
    process: ManagedProcess
    port: int
    admin_socket: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self, line: str) -> str:
        """One line to HAProxy's runtime API (its stats socket)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(str(self.admin_socket))
            sock.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def set_state(self, server: str, state: str) -> None:
        self.command(f"set server replicas/{server} state {state}")

    def servers_taken_out(self) -> list[str]:
        """HAProxy's own lines for each replica it took out and why (printed with failures)."""
        log = self.process.log_path
        if log is None or not log.exists():
            return []
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
        return [line for line in lines if " is DOWN" in line or "no server available" in line]

    def server_up(self, server: str) -> bool:
        for line in self.command("show stat").splitlines():
            fields = line.split(",")
            if len(fields) > 17 and fields[0] == "replicas" and fields[1] == server:
                return fields[17] == "UP"
        return False


def haproxy_config(port: int, admin_socket: Path, replicas: list[Replica]) -> str:
    servers = "\n".join(f"  server {server_name(r)} {r.host}:{r.http_port} check" for r in replicas)
    return f"""global
  maxconn 2048
  stats socket {admin_socket} mode 600 level admin
defaults
  mode tcp
  timeout connect 1s
  timeout client {int(REQUEST_TIMEOUT_S) + 10}s
  timeout server {int(REQUEST_TIMEOUT_S) + 10}s
  # A refused connection (a replica that is gone) is tried again, on another replica.
  retries 3
  option redispatch 1
listen replicas
  bind 127.0.0.1:{port}
  balance roundrobin
  option httpchk GET /ready
  # A replica serving its share of the load can answer /ready late on a loaded machine: one
  # late answer must not take it out (with `fall 1` and the check timing out at `inter`, all
  # three were out at once and the balancer closed every new connection). A refused check,
  # a killed replica, fails at once, so three take 0.3 s; its connections are redispatched.
  timeout check 2s
  default-server inter 100ms fastinter 100ms downinter 200ms fall 3 rise 2
{servers}
"""


def server_name(replica: Replica) -> str:
    return "r" + replica.host.rsplit(".", 1)[1]


@dataclass
class Outcome:
    started: float
    ok: bool
    why: str = ""


@dataclass
class Load:
    outcomes: list[Outcome] = field(default_factory=list)

    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    def summary(self) -> str:
        streams = len(self.outcomes)
        return f"{streams} requests, {len(self.failed())} failed"


async def one_request(session: aiohttp.ClientSession, url: str, n: int) -> Outcome:
    started = time.monotonic()
    stream = n % 2 == 0
    payload = {"model": "fake-model", "prompt": f"request {n}", "max_tokens": 4, "stream": stream}
    try:
        async with session.post(url + "/v1/completions", json=payload) as answer:
            body = await answer.read()
        if answer.status != 200:
            return Outcome(started, False, f"HTTP {answer.status}: {body[:200]!r}")
        if stream and b"data: [DONE]" not in body:
            return Outcome(started, False, f"stream cut short: {body[-200:]!r}")
        if not stream and not json.loads(body)["choices"][0]["text"]:
            return Outcome(started, False, "no text")
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
        return Outcome(started, False, repr(exc))
    return Outcome(started, True)


async def run_load(url: str, done: threading.Event, minimum: int) -> Load:
    """Requests at CONCURRENCY until `done` is set and `minimum` were sent (at most
    MAX_REQUESTS, at most LOAD_DEADLINE_S): one connection each."""
    load = Load()
    counter = iter(range(MAX_REQUESTS))
    deadline = time.monotonic() + LOAD_DEADLINE_S
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(force_close=True, limit=CONCURRENCY)

    async def client(session: aiohttp.ClientSession) -> None:
        for n in counter:
            if (done.is_set() and n >= minimum) or time.monotonic() > deadline:
                return
            load.outcomes.append(await one_request(session, url, n))

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(CONCURRENCY)))
    return load


def load_during(url: str, scenario: Callable[[], None], minimum: int) -> Load:
    """Run `scenario` on a thread while the load runs; its failure fails the test."""
    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            scenario()
        except BaseException as exc:  # re-raised below, on the test's thread
            errors.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    load = asyncio.run(run_load(url, done, minimum))
    thread.join(60)
    if errors:
        raise errors[0]
    assert not thread.is_alive(), "the scenario did not finish"
    return load


@dataclass
class Cluster:
    replicas: list[Replica]
    balancer: Balancer
    workers: list[ManagedProcess]
    fleet: set[str]
    starters: Replicas

    def lists_fleet(self, replica: Replica) -> bool:
        try:
            return set(replica.instances()) == self.fleet
        except (RuntimeError, OSError, ValueError):
            return False

    def processes(self) -> list[ManagedProcess]:
        return [*self.starters.processes(), self.balancer.process, *self.workers]


@pytest.fixture
def cluster(tmp_path: Path, haproxy: str) -> Iterator[Cluster]:
    names = Names(tmp_path / "hosts.json")
    names.set(NAME, HOSTS)
    starters = Replicas(tmp_path, names, ["--ttl", "10", "--drain-seconds", "10"])
    workers: list[ManagedProcess] = []
    balancer: ManagedProcess | None = None
    try:
        replicas = starters.start(HOSTS)
        registry = f"{NAME}:{replicas[0].registry_port}"
        fleet = set()
        for index, role in enumerate(["P", "P", "D", "D"]):
            http_port, kv_port = free_ports(2)
            argv = fake_dns_command(
                "fake-worker",
                *("--role", role, "--port", str(http_port), "--kv-port", str(kv_port)),
                *("--model", "fake-model", "--token-latency-ms", "2"),
                *("--prefill-latency-ms", "2", "--proxy", registry, "--announce", "v1"),
                *("--announce-interval", str(ANNOUNCE_S)),
            )
            name = f"fake-{role}{index}"
            log = tmp_path / f"{name}.log"
            workers.append(ManagedProcess(name, argv, log, env=names.env).start())
            fleet.add(f"127.0.0.1:{http_port}")
        port = free_port()
        admin_socket = tmp_path / "haproxy.sock"
        config = tmp_path / "haproxy.cfg"
        config.write_text(haproxy_config(port, admin_socket, replicas), encoding="utf-8")
        balancer = ManagedProcess(
            "haproxy", [haproxy, "-db", "-f", str(config)], tmp_path / "haproxy.log"
        ).start()
        cluster = Cluster(
            replicas, Balancer(balancer, port, admin_socket), workers, fleet, starters
        )
        for replica in replicas:
            wait_until(
                lambda r=replica: cluster.lists_fleet(r),  # type: ignore[misc]
                15,
                f"{replica.name} lists the fleet",
                cluster.processes(),
            )
        wait_until(
            lambda: all(cluster.balancer.server_up(server_name(r)) for r in replicas),
            15,
            "HAProxy sees every replica up",
            cluster.processes(),
        )
        yield cluster
    finally:
        if balancer is not None:
            balancer.stop()
        for worker in workers:
            worker.stop()
        starters.close()


def wait_back(cluster: Cluster, replica: Replica) -> None:
    """Until the restarted replica lists the fleet; then back into the balancer."""
    wait_until(lambda: cluster.lists_fleet(replica), 10, f"{replica.name} lists the fleet")
    server = server_name(replica)
    cluster.balancer.set_state(server, "ready")
    wait_until(lambda: cluster.balancer.server_up(server), 10, f"{server} up again")


def test_a_rolling_restart_loses_nothing(cluster: Cluster) -> None:
    exits: list[int | None] = []

    def roll() -> None:
        time.sleep(1.0)  # the load is under way
        for replica in cluster.replicas:
            server = server_name(replica)
            # Out of the balancer first (a pod's endpoint removed), then SIGTERM: it drains.
            cluster.balancer.set_state(server, "drain")
            time.sleep(0.3)  # HAProxy's in-progress connects to it land
            exits.append(replica.stop(grace=15.0))
            replica.start()
            replica.wait_ready()
            wait_back(cluster, replica)
            time.sleep(0.5)  # it takes requests before the next one goes

    load = load_during(cluster.balancer.url, roll, minimum=1500)
    print(f"\nrolling restart of 3 replicas under load: {load.summary()}; exits {exits}")
    for outcome in load.failed()[:10]:
        print("  failed:", outcome.why)
    if load.failed():
        print("\n".join(cluster.balancer.servers_taken_out()))
    assert exits == [0, 0, 0]  # each drained and exited cleanly
    assert len(load.outcomes) >= 1500
    assert load.failed() == []


def test_a_killed_replica_loses_only_what_it_held(cluster: Cluster) -> None:
    victim = cluster.replicas[1]
    killed_at: list[float] = []
    relisted: list[float] = []

    def kill_and_restart() -> None:
        time.sleep(2.0)
        assert victim.process is not None and victim.process.process is not None
        victim.process.signal(signal.SIGKILL)
        # From the moment it is dead (its sockets closed): a connection that its accept queue
        # held before then was in flight on it, though no request handler had it yet.
        victim.process.process.wait(10)
        killed_at.append(time.monotonic())
        time.sleep(2.0)  # new requests keep coming while it is gone
        victim.stop()
        victim.start()
        victim.wait_ready()
        up = time.monotonic()
        wait_until(lambda: cluster.lists_fleet(victim), 10, f"{victim.name} lists the fleet")
        relisted.append(time.monotonic() - up)
        time.sleep(2.0)  # and takes its share again

    load = load_during(cluster.balancer.url, kill_and_restart, minimum=1500)
    (kill,) = killed_at
    failed = load.failed()
    after = [o for o in failed if o.started >= kill]
    print(
        f"\nSIGKILL of one of 3 replicas under load: {load.summary()} "
        f"(in flight on it: {len(failed) - len(after)}, started after the kill: {len(after)}); "
        f"the restarted replica listed the fleet {relisted[0]:.2f}s after it answered"
    )
    for outcome in failed[:10]:
        print(f"  failed ({outcome.started - kill:+.3f}s from the kill):", outcome.why)
    if after:
        print("\n".join(cluster.balancer.servers_taken_out()))
    assert len(load.outcomes) >= 1500
    assert after == [], "requests started after the kill failed"
    assert len(failed) <= CONCURRENCY  # at most what was in flight
    # Within one announce period (plus the poll's slack on a loaded machine).
    assert relisted[0] <= ANNOUNCE_S + 2.0
    # The restarted replica routes: straight to it, an answer from the fleet.
    answer = post_json(victim.url + "/v1/completions", {"model": "fake-model", "prompt": "x"})
    assert answer.status == 200, answer.body
    assert answer.json()["choices"][0]["text"]
