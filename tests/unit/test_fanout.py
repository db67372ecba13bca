"""The bounded name lookup, the fan-out client's socket set and the announcer's schedule, in
process (the live fan-out against real proxies: tests/integration/test_fanout.py)."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import pytest

from pdproxy.base.resolve import BoundedResolver, ResolveError
from pdproxy.base.roles import Role
from pdproxy.demo.processes import wait_until
from pdproxy.registry.messages import Load
from pdproxy.vllm_side.announcement import WorkerIdentity
from pdproxy.vllm_side.announcer import PREFILL_WORK_REPORT_S, Announcer, LoadSample
from pdproxy.vllm_side.fanout import FanOutClient, endpoint

IDENTITY = WorkerIdentity(Role.DECODE, "127.0.0.1:8200", "127.0.0.1:8201")


def test_a_hanging_lookup_is_bounded_and_never_started_twice() -> None:
    calls = []
    release = threading.Event()

    def hangs(name: str) -> list[str]:
        calls.append(name)
        release.wait(10)
        return ["127.0.0.5"]

    resolver = BoundedResolver(hangs, timeout_s=0.2)
    for _ in range(3):
        started = time.monotonic()
        with pytest.raises(ResolveError, match="no answer within"):
            resolver.resolve("slow.test")
        assert time.monotonic() - started < 2.0  # bounded (0.2 s asked; generous for CI)
    assert calls == ["slow.test"]  # the later lookups waited on the one in flight
    release.set()
    wait_until(lambda: resolver.resolve("slow.test") == ("127.0.0.5",), 5, "the late answer")


def test_failures_and_non_addresses_are_resolve_errors() -> None:
    def fails(name: str) -> list[str]:
        raise OSError("no such name")

    with pytest.raises(ResolveError, match="no such name"):
        BoundedResolver(fails).resolve("x.test")
    with pytest.raises(ResolveError, match="no address"):
        BoundedResolver(lambda name: ["not-an-ip"]).resolve("x.test")
    # An address is its own answer: the resolver is not even asked.
    assert BoundedResolver(fails).resolve("::1") == ("::1",)


def test_the_client_follows_the_name() -> None:
    table = {"proxies.test": ["127.0.0.1", "::1"]}
    client = FanOutClient("proxies.test:30001", "id", BoundedResolver(lambda n: table[n]))
    try:
        assert client.endpoints == ()  # nothing until the first lookup
        client.refresh()
        assert set(client.endpoints) == {"tcp://127.0.0.1:30001", "tcp://[::1]:30001"}
        table["proxies.test"] = ["127.0.0.2", "::1"]
        client.refresh()
        assert set(client.endpoints) == {"tcp://127.0.0.2:30001", "tcp://[::1]:30001"}
        del table["proxies.test"]  # the lookup fails: the set stays
        client.refresh()
        assert set(client.endpoints) == {"tcp://127.0.0.2:30001", "tcp://[::1]:30001"}
        # Nobody listens: the tiny queues fill and messages drop, nothing waits.
        started = time.monotonic()
        results = [client.send({"op": "announce", "n": n}) for n in range(100)]
        assert time.monotonic() - started < 2.0
        assert results[0] and not results[-1]
    finally:
        client.close()


def test_an_ip_registry_needs_no_lookup() -> None:
    def never(name: str) -> list[str]:
        raise AssertionError("looked up")

    client = FanOutClient("127.0.0.1:30001", "id", BoundedResolver(never))
    try:
        assert client.endpoints == (endpoint("127.0.0.1", 30001),)
    finally:
        client.close()


class Recorder:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.refreshed = 0

    def refresh(self) -> None:
        self.refreshed += 1

    def send(self, message: dict[str, Any]) -> bool:
        self.sent.append(message)
        return True

    def close(self) -> None:
        pass


def test_a_load_change_is_announced_within_a_second_not_a_period() -> None:
    load = [Load(running=0)]
    client = Recorder()
    # A period far longer than the test: only a load change can make a second announcement.
    announcer = Announcer(client, IDENTITY, lambda: LoadSample(load[0]), interval_s=60.0)
    announcer.start()
    try:
        wait_until(lambda: len(client.sent) == 1, 5, "the first announcement")
        time.sleep(1.5)
        assert len(client.sent) == 1  # the same load is not announced again before the period
        load[0] = Load(running=3)
        changed = time.monotonic()
        wait_until(lambda: len(client.sent) == 2, 5, "the changed load")
        print(f"changed load announced after {time.monotonic() - changed:.2f}s")
        assert client.sent[1]["load"]["running"] == 3
        assert client.refreshed == 1  # the name is looked up once a period, not every tick
    finally:
        announcer.stop()
    assert client.sent[-1]["op"] == "leave"


def test_a_prefills_changing_work_is_announced_every_report_period() -> None:
    # Work that changes at every sample (a busy prefill): announced each PREFILL_WORK_REPORT_S
    # (10 ms), where the requests' LOAD_REPORT_S (1 s) would announce it once or twice here.
    samples = itertools.count()
    client = Recorder()
    announcer = Announcer(
        client,
        IDENTITY,
        lambda: LoadSample(Load(running=1, prefill_tokens=next(samples))),
        interval_s=60.0,
        load_report_s=PREFILL_WORK_REPORT_S,
    )
    announcer.start()
    try:
        time.sleep(0.5)
    finally:
        announcer.stop()
    announced = [m["load"]["prefill_tokens"] for m in client.sent if m["op"] == "announce"]
    print(f"{len(announced)} announcements in 0.5 s")
    assert len(announced) >= 10
    assert announced == sorted(set(announced))  # each one a new figure, in order


@pytest.mark.parametrize(
    ("registry", "connected"),
    [
        ("tcp://127.0.0.1:30001", "tcp://127.0.0.1:30001"),
        ("[::1]:30001", "tcp://[::1]:30001"),
        ("tcp://[::1]:30001", "tcp://[::1]:30001"),
    ],
)
def test_a_registry_address_takes_the_one_syntax(registry: str, connected: str) -> None:
    # tcp:// optional, IPv6 in brackets: a registry address is not held to the request-id
    # rules, which refuse IPv6 literals.
    client = FanOutClient(registry, "id", BoundedResolver(lambda name: []))
    try:
        assert client.endpoints == (connected,)
    finally:
        client.close()


def test_a_malformed_registry_address_says_the_syntax() -> None:
    with pytest.raises(ValueError, match=r"expected \[tcp://\]HOST:PORT"):
        FanOutClient("udp://127.0.0.1:30001", "id")
