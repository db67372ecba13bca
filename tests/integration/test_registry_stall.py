"""Instances that go on announcing while the proxy does not run are not expired when it runs
again.

- A stall of the proxy's loop alone (on asyncio's loop and on uvloop, the proxy's): ZMQ's I/O
  thread goes on queueing the announcements, and they are read before the late sweep judges
  anyone.
- A stall of the whole proxy process (SIGSTOP: as a cgroup's CPU throttling or a descheduled VM
  does it): ZMQ's I/O thread stopped too, so on waking the sweep's timer fires before the
  announcements are in the socket. Only a sweep after a period the proxy ran through judges
  (pdproxy.registry.stall), also after two stalls back to back, and a worker that really fell
  silent meanwhile is still expired. Without that, every instance expired at each stall and
  registered again a millisecond later, and requests in between got 503.

A real registry socket and real announcers; in the second test the real proxy and fake workers,
each its own process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import uvloop

from pdproxy.base.roles import Role
from pdproxy.config import Settings
from pdproxy.demo.fleet import LocalFleet, WorkerSpec
from pdproxy.demo.processes import free_ports, wait_until
from pdproxy.ids import parse_address
from pdproxy.metrics import Metrics
from pdproxy.registry.server import RegistryServer
from pdproxy.registry.table import RegistryTable
from pdproxy.vllm_side.announcement import WorkerIdentity, announce_message
from pdproxy.vllm_side.fanout import FanOutClient
from tests.integration.support import metric_value, stopped_for

TTL_S = 1.0
STALL_S = 2.0  # twice the TTL: a sweep before the reads would expire every instance
ANNOUNCE_EVERY_S = 0.1
WORKERS = (
    WorkerIdentity(Role.PREFILL, "127.0.0.1:18601", "127.0.0.1:18602"),
    WorkerIdentity(Role.DECODE, "127.0.0.1:18603", "127.0.0.1:18604"),
)


def announcing(registry: str, stop: threading.Event) -> threading.Thread:
    """A thread that announces both workers every ANNOUNCE_EVERY_S until `stop`."""

    def run() -> None:
        clients = [FanOutClient(registry, w.zmq_address) for w in WORKERS]
        try:
            while not stop.is_set():
                for client, worker in zip(clients, WORKERS, strict=True):
                    client.send(announce_message(worker))
                stop.wait(ANNOUNCE_EVERY_S)
        finally:
            for client in clients:
                client.close()

    return threading.Thread(target=run, name="announcers", daemon=True)


async def stalled_registry(port: int) -> tuple[list[str], list[str]]:
    """The registered instances' addresses before and after the loop stalls for STALL_S."""
    settings = Settings(registry_bind=f"tcp://127.0.0.1:{port}", ttl=TTL_S)
    table = RegistryTable(settings.ttl, settings.max_instances)
    server = RegistryServer(settings, table, Metrics())
    server.start()
    stop = threading.Event()
    sender = announcing(f"127.0.0.1:{port}", stop)
    sender.start()
    try:

        def names() -> list[str]:
            return sorted(
                w.http_address for w in WORKERS if table.get(parse_address(w.http_address))
            )

        for _ in range(200):  # registered within 10 s
            if len(names()) == len(WORKERS):
                break
            await asyncio.sleep(0.05)
        before = names()
        # The stall itself: the loop runs nothing while the workers go on announcing.
        time.sleep(STALL_S)  # noqa: ASYNC251
        await asyncio.sleep(0.6)  # a few sweep periods
        return before, names()
    finally:
        stop.set()
        sender.join(5.0)
        await server.stop()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_instances_announcing_through_a_stall_of_the_proxys_loop_stay(loop: str) -> None:
    (port,) = free_ports(1)
    runner: Callable[..., tuple[list[str], list[str]]] = (
        uvloop.run if loop == "uvloop" else asyncio.run
    )
    before, after = runner(stalled_registry(port))
    everyone = sorted(w.http_address for w in WORKERS)
    assert before == everyone
    assert after == everyone


PROCESS_STALLS = 3
PROCESS_STALL_S = 2.5  # more than twice the TTL


def test_instances_announcing_through_a_stop_of_the_proxy_process_stay(tmp_path: Path) -> None:
    fleet = LocalFleet(
        tmp_path, [WorkerSpec("P"), WorkerSpec("D")], ["--ttl", str(TTL_S)], announce_interval=0.1
    )
    fleet.start()
    assert fleet.proxy is not None
    proxy, log = fleet.proxy, tmp_path / "pdproxy.log"
    everyone = {worker.http_address for worker in fleet.workers}
    try:
        for _ in range(PROCESS_STALLS):
            # Two stalls with a moment between, in which the late sweep runs: the one after
            # the second stall must not judge either.
            stopped_for(proxy, PROCESS_STALL_S)
            time.sleep(0.1)
            stopped_for(proxy, PROCESS_STALL_S)
            time.sleep(TTL_S)  # four sweep periods (TTL/4 each) after it runs again
            assert fleet.registered() == everyone
        assert "expired" not in log.read_text()
        assert metric_value(fleet.proxy_url, "pdproxy_registry_stalls_total") >= 2 * PROCESS_STALLS

        # A worker that stops announcing during a stall is expired all the same, one sweep late.
        decode = fleet.role("D")[0]
        os.kill(decode.process.pid, signal.SIGSTOP)
        try:
            stopped_for(proxy, PROCESS_STALL_S)
            wait_until(
                lambda: fleet.registered() == everyone - {decode.http_address},
                5.0,
                "the silent decode to expire and the prefill to stay",
            )
        finally:
            os.kill(decode.process.pid, signal.SIGCONT)
        wait_until(lambda: fleet.registered() == everyone, 5.0, "the decode to announce again")
    finally:
        fleet.stop()
