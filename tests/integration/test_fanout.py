"""The fan-out announcer (pdproxy.vllm_side.fanout) against live proxy replicas, and the KV
transfer statistics that fan out the same way.

The announcer runs in this process with its real FanOutClient and real ZMQ sockets; the proxies
are real `pdproxy serve` processes on 127.0.0.1, .2, .3 and .4 (all loopback on Linux), on one
registry port as pods behind a headless Service. Only the name lookup is the test's: an
injected resolver (name -> addresses) reading a table the test changes while the announcer
runs, or, for processes, tests.harness.fake_dns reading the same table; /etc/hosts is never
touched.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdproxy.base.resolve import BoundedResolver
from pdproxy.base.roles import Role
from pdproxy.demo.processes import ManagedProcess, free_ports, wait_until
from pdproxy.registry.messages import Load
from pdproxy.vllm_side.announcement import WorkerIdentity
from pdproxy.vllm_side.announcer import Announcer, LoadSample
from pdproxy.vllm_side.fanout import FanOutClient
from tests.integration.replicas import Names, Replica, Replicas, fake_dns_command
from tests.integration.support import metric_value, post_json

NAME = "pdproxy-registry.test"
PERIOD_S = 0.5
TTL_S = 30  # long: an instance a replica stops hearing from stays, so its last_seen shows it
IDENTITY = WorkerIdentity(Role.PREFILL, "127.0.0.1:18100", "127.0.0.1:18101", model="m")
UNREACHABLE = "127.0.0.9"  # nothing listens there: it must not delay the others


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[Replicas]:
    started = Replicas(tmp_path, Names(tmp_path / "hosts.json"), ["--ttl", str(TTL_S)])
    try:
        yield started
    finally:
        started.close()


def listed(replica: Replica) -> dict[str, object] | None:
    return replica.instances().get(IDENTITY.http_address)


def wait_listed(replica: Replica, present: bool, timeout: float) -> None:
    what = f"{replica.name} {'lists' if present else 'forgets'} the instance"
    wait_until(lambda: (listed(replica) is not None) == present, timeout, what)


def test_announces_to_every_address_the_name_has(replicas: Replicas) -> None:
    first = replicas.start(["127.0.0.1", "127.0.0.2", "127.0.0.3"])
    one, two, three = first
    replicas.names.set(NAME, ["127.0.0.1", "127.0.0.2", "127.0.0.3", UNREACHABLE])
    client = FanOutClient(
        f"{NAME}:{one.registry_port}", IDENTITY.zmq_address, BoundedResolver(replicas.names.lookup)
    )
    announcer = Announcer(client, IDENTITY, lambda: LoadSample(Load(running=1)), PERIOD_S)
    announcer.start()
    try:
        started = time.monotonic()
        for replica in first:
            wait_listed(replica, True, 10)
        print(f"3 live replicas, one unreachable: listed in {time.monotonic() - started:.2f}s")

        # One replica added to the name, one removed, while the announcer runs.
        four = replicas.add("127.0.0.4", like=one)
        replicas.names.set(NAME, ["127.0.0.1", "127.0.0.2", "127.0.0.4", UNREACHABLE])
        added = time.monotonic()
        # Within one period of the lookup that finds it (plus the poll's own slack).
        wait_listed(four, True, 2 * PERIOD_S + 3)
        print(f"the added replica listed it {time.monotonic() - added:.2f}s after the change")
        time.sleep(4 * PERIOD_S)
        entry = listed(three)
        assert entry is not None  # not forgotten (TTL 30 s): just no longer announced to
        silent = float(entry["last_seen_seconds_ago"])  # type: ignore[arg-type]
        # Its socket was closed at the first lookup after the change: nothing since.
        assert silent > 2 * PERIOD_S, f"the removed replica still hears from it ({silent}s)"
        for replica in (one, two, four):
            seen = float(listed(replica)["last_seen_seconds_ago"])  # type: ignore[index,arg-type]
            assert seen < 2 * PERIOD_S + 1, f"{replica.name} last heard {seen}s ago"
    finally:
        announcer.stop()

    # `leave` reaches every replica the name still has: each forgets the instance at once.
    for replica in (one, two, four):
        wait_listed(replica, False, 5)
    assert listed(three) is not None  # the removed replica got no `leave` either


def fake_worker(replicas: Replicas, role: str, registry: str) -> tuple[ManagedProcess, str]:
    """A fake worker announcing (v1) and reporting its KV transfers to `registry`, a name."""
    http_port, kv_port = free_ports(2)
    argv = fake_dns_command(
        "fake-worker",
        *("--role", role, "--port", str(http_port), "--kv-port", str(kv_port)),
        *("--model", "fake-model", "--proxy", registry, "--announce", "v1"),
        *("--announce-interval", str(PERIOD_S)),
    )
    name = f"fake-{role}"
    process = ManagedProcess(name, argv, replicas.log_dir / f"{name}.log", env=replicas.names.env)
    return process.start(), f"127.0.0.1:{http_port}"


def transfers_ok(replica: Replica) -> float:
    return metric_value(replica.url, "pdproxy_kv_transfers_total", {"outcome": "ok"})


def test_kv_transfer_statistics_reach_every_replica(replicas: Replicas) -> None:
    one, two = replicas.start(["127.0.0.1", "127.0.0.2"])
    replicas.names.set(NAME, ["127.0.0.1", "127.0.0.2"])
    registry = f"{NAME}:{one.registry_port}"
    workers: list[ManagedProcess] = []
    try:
        prefill, prefill_http = fake_worker(replicas, "P", registry)
        workers.append(prefill)
        decode, decode_http = fake_worker(replicas, "D", registry)
        workers.append(decode)
        processes = [*replicas.processes(), *workers]
        for replica in (one, two):
            wait_until(
                lambda r=replica: {prefill_http, decode_http} <= set(r.instances()),  # type: ignore[misc]
                15,
                f"{replica.name} lists both workers",
                processes,
            )
        body = {"model": "fake-model", "prompt": "word " * 40, "max_tokens": 2}
        answer = post_json(one.url + "/v1/completions", body)
        assert answer.status == 200, answer.body
        # Only `one` routed the request; both count its transfer, once.
        for replica in (one, two):
            wait_until(
                lambda r=replica: transfers_ok(r) == 1,  # type: ignore[misc]
                15,
                f"{replica.name} counts the transfer",
                processes,
            )
        pair = {"prefill": prefill_http, "decode": decode_http}
        moved = [metric_value(r.url, "pdproxy_kv_transfer_bytes_total", pair) for r in (one, two)]
        assert moved[0] > 0 and moved[0] == moved[1], moved
        time.sleep(1.0)  # the prefill's reports of the same transfer add no second count
        assert [transfers_ok(one), transfers_ok(two)] == [1, 1]
    finally:
        for worker in workers:
            worker.stop()
