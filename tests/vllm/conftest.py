"""One real pdproxy in front of one real vLLM prefill and one real vLLM decode, per session.

Starting vLLM costs about 30 s, so the servers start once and every `vllm` test shares them;
each test tells its own requests apart by the ids the proxy gave them.
"""

from __future__ import annotations

import re
import time
from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from pdproxy.demo.fleet import LocalFleet
from pdproxy.demo.processes import free_ports, http_json, wait_until
from tests.conftest import vllm_skipped
from tests.harness.vllm_cpu import (
    VllmServer,
    running_servers,
    tiny_model_dir,
    vllm_id_patterns,
)
from tests.harness.vllm_env import VllmEnv

REGISTRATION_TIMEOUT_S = 30.0
CLIENT_TIMEOUT_S = 120.0


@dataclass
class RealStack:
    proxy: LocalFleet
    prefill: VllmServer
    decode: VllmServer
    env: VllmEnv
    model: Path
    work: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.proxy.proxy_url}/v1",
            api_key="unused",
            max_retries=0,
            timeout=CLIENT_TIMEOUT_S,
        )

    def instances(self) -> dict[str, dict[str, Any]]:
        listed = http_json(f"{self.proxy.proxy_url}/v1/instances")["instances"]
        return {item["http_address"]: item for item in listed}

    def records_for(self, server: VllmServer, tag: str) -> list[dict[str, Any]]:
        """What `server`'s connector recorded for the requests carrying `tag`."""
        return [row for row in server.records() if tag in str(row.get("request_id", ""))]

    def wait_finished(self, server: VllmServer, tag: str, count: int = 1) -> list[dict[str, Any]]:
        """The `finished` records for `tag`, once `count` of them exist (bounded)."""
        rows: list[dict[str, Any]] = []

        def enough() -> bool:
            nonlocal rows
            rows = [r for r in self.records_for(server, tag) if r["event"] == "finished"]
            return len(rows) >= count

        wait_until(enough, 15.0, f"{count} finished record(s) for {tag} on {server.name}")
        return rows


@dataclass(frozen=True)
class IdPatterns:
    """vLLM's own regexes for the P and D addresses in a request id."""

    prefill: re.Pattern[str]
    decode: re.Pattern[str]

    def addresses(self, engine_id: str) -> tuple[str, str]:
        prefill, decode = self.prefill.search(engine_id), self.decode.search(engine_id)
        assert prefill is not None and decode is not None, engine_id
        return prefill.group(1), decode.group(1)


@pytest.fixture(scope="session")
def vllm_env() -> VllmEnv:
    if vllm_skipped():
        pytest.skip("PDPROXY_SKIP_VLLM=1")
    env = VllmEnv.default()
    env.ensure()  # normally done by `make test` before pytest starts; a no-op then
    return env


@pytest.fixture(scope="session")
def vllm_model(vllm_env: VllmEnv) -> Path:
    return tiny_model_dir(vllm_env)


@pytest.fixture(scope="session")
def id_patterns(vllm_env: VllmEnv) -> IdPatterns:
    patterns = vllm_id_patterns(vllm_env)
    return IdPatterns(re.compile(patterns["prefill"]), re.compile(patterns["decode"]))


@pytest.fixture(scope="session")
def real_stack(
    vllm_env: VllmEnv, vllm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealStack]:
    work = tmp_path_factory.mktemp("vllm-stack")
    proxy = LocalFleet(work / "proxy", [], ["--ttl", "10"])
    proxy.start()
    try:
        p_http, p_kv, d_http, d_kv = free_ports(4)
        # The prefill advertises no host: its connector finds 127.0.0.1, its route to the
        # registry (test_registry_real checks what it announced).
        prefill = VllmServer(
            "vllm-P0",
            "kv_producer",
            p_http,
            p_kv,
            work,
            proxy.registry_address,
            cpu="0",
            advertise_host=None,
        )
        decode = VllmServer(
            "vllm-D0", "kv_consumer", d_http, d_kv, work, proxy.registry_address, cpu="1"
        )
        started = time.monotonic()
        with running_servers(vllm_env, vllm_model, [prefill, decode]):
            stack = RealStack(proxy, prefill, decode, vllm_env, vllm_model, work)
            expected = {prefill.http_address, decode.http_address}
            wait_until(
                lambda: expected <= set(stack.instances()),
                REGISTRATION_TIMEOUT_S,
                "the vLLM servers' connectors to register",
                [proxy.proxy] if proxy.proxy else [],
            )
            print(f"\nreal vLLM P and D serving after {time.monotonic() - started:.1f} s")
            _SESSION_STACKS.append(stack)
            yield stack
    finally:
        _SESSION_STACKS.clear()
        proxy.stop()


# On two cores, the session's P and D beside a module's own pair (four vLLM servers) starved
# each other: a NIXL push transfer took 40-70 s, announcements lapsed past the registry's TTL.
# So the modules that use the session's stack run first, and it stops after the last of them.
_SESSION_STACKS: list[RealStack] = []
_HERE = Path(__file__).resolve().parent


def _uses_session_stack(item: pytest.Item) -> bool:
    return "real_stack" in getattr(item, "fixturenames", ())


def _is_mine(item: pytest.Item) -> bool:
    return Path(str(item.path)).resolve().is_relative_to(_HERE)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Within this directory, whole modules that use `real_stack` before the others (order
    otherwise kept: a module split in two would start its own fixtures twice)."""
    positions = [index for index, item in enumerate(items) if _is_mine(item)]
    mine = [items[index] for index in positions]
    first = {item.path for item in mine if _uses_session_stack(item)}
    ordered = [i for i in mine if i.path in first] + [i for i in mine if i.path not in first]
    for index, item in zip(positions, ordered, strict=True):
        items[index] = item


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the session's stack once no test left needs it (the fixture's own teardown, at
    the session's end, then finds it stopped)."""
    if not _SESSION_STACKS or nextitem is None or not _is_mine(item):
        return
    if any(_uses_session_stack(later) for later in _remaining(item, nextitem)):
        return
    stack = _SESSION_STACKS.pop()
    for server in (stack.decode, stack.prefill):
        server.stop()


def _remaining(item: pytest.Item, nextitem: pytest.Item) -> list[pytest.Item]:
    items = item.session.items
    return items[items.index(nextitem) :]


def metric_sum(server: VllmServer, name: str) -> float:
    """The sum over label sets of one sample in a real vLLM server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    total, seen = 0.0, False
    for family in text_string_to_metric_families(server.metrics_text()):
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
                seen = True
    assert seen, f"{server.name} exports no {name}"
    return total


@dataclass
class PairStack:
    """A proxy of its own with one real prefill and one real decode (for tests that need
    servers configured differently from the session's)."""

    proxy: LocalFleet
    prefill: VllmServer
    decode: VllmServer


@contextmanager
def pair_stack(
    env: VllmEnv,
    model: Path,
    work: Path,
    names: tuple[str, str],
    proxy_args: Sequence[str] = (),
    prefill: dict[str, Any] | None = None,
    decode: dict[str, Any] | None = None,
) -> Iterator[PairStack]:
    """Start the proxy and both servers (`prefill` / `decode`: extra VllmServer fields), wait
    until both registered, stop everything by PID on the way out."""
    proxy = LocalFleet(work / "proxy", [], ["--ttl", "10", *proxy_args])
    proxy.start()
    try:
        p_http, p_kv, d_http, d_kv = free_ports(4)
        registry = proxy.registry_address
        p_server = VllmServer(
            names[0], "kv_producer", p_http, p_kv, work, registry, **{"cpu": "0", **(prefill or {})}
        )
        d_server = VllmServer(
            names[1], "kv_consumer", d_http, d_kv, work, registry, **{"cpu": "1", **(decode or {})}
        )
        with running_servers(env, model, [p_server, d_server]):
            wait_until(
                lambda: {p_server.http_address, d_server.http_address} <= proxy.registered(),
                REGISTRATION_TIMEOUT_S,
                "both servers registered",
            )
            yield PairStack(proxy, p_server, d_server)
    finally:
        proxy.stop()


LOG_TAIL_LINES = 30
LOG_FILES_SHOWN = 12


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed real-vLLM test, or a fixture that failed to set it up, shows the tails of the
    logs its processes wrote meanwhile (the proxies', vLLM's, the sidecars'): CI keeps nothing
    else of a run that failed."""
    report = yield
    if report.failed and call.when in ("setup", "call"):
        factory = getattr(item.config, "_tmp_path_factory", None)
        if isinstance(factory, pytest.TempPathFactory):
            for path in logs_written_since(factory.getbasetemp(), call.start):
                report.sections.append((f"log {path.name} (last lines)", log_tail(path)))
    return report


def logs_written_since(root: Path, since: float) -> list[Path]:
    """The `*.log` files below `root` written to at or after `since`, newest first (bounded)."""
    found = []
    for path in root.rglob("*.log"):
        try:
            written = path.stat().st_mtime
        except OSError:
            continue
        if written >= since:
            found.append((written, path))
    found.sort(reverse=True)
    return [path for _, path in found[:LOG_FILES_SHOWN]]


def log_tail(path: Path) -> str:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as exc:
        return f"unreadable: {exc}"
    return "\n".join(lines[-LOG_TAIL_LINES:])
