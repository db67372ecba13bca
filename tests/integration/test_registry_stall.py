"""A proxy whose own loop stalls longer than the TTL keeps the instances that went on announcing
meanwhile: their announcements wait in the registry's socket and are read before the late
sweep judges anyone (were the sweep first, every instance would expire at once and each request
be refused with 503 until the next announcements). A real registry socket and real announcers,
on asyncio's loop and on uvloop (the proxy's)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest
import uvloop

from pdproxy.base.roles import Role
from pdproxy.config import Settings
from pdproxy.demo.processes import free_ports
from pdproxy.ids import parse_address
from pdproxy.metrics import Metrics
from pdproxy.registry.server import RegistryServer
from pdproxy.registry.table import RegistryTable
from pdproxy.vllm_side.announcement import WorkerIdentity, announce_message
from pdproxy.vllm_side.fanout import FanOutClient

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
