"""Shared fixtures: real processes on loopback, always stopped by PID."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from pdproxy.demo.fleet import LocalFleet, WorkerSpec

FleetFactory = Callable[..., LocalFleet]


@pytest.fixture
def fleet_factory(tmp_path: Path) -> Iterator[FleetFactory]:
    """Start fleets on demand; every process they started is stopped at teardown."""
    fleets: list[LocalFleet] = []

    def make(workers: Sequence[WorkerSpec], proxy_args: Sequence[str] = ()) -> LocalFleet:
        fleet = LocalFleet(tmp_path / f"fleet{len(fleets)}", workers, proxy_args)
        fleets.append(fleet)
        return fleet.start()

    yield make
    for fleet in fleets:
        fleet.stop()


SKIP_VLLM_VARIABLE = "PDPROXY_SKIP_VLLM"
VLLM_TEST_TIMEOUT_S = 420  # the first test also starts the real servers (setup counts)


def vllm_skipped() -> bool:
    return os.environ.get(SKIP_VLLM_VARIABLE) == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Real-vLLM tests run by default; PDPROXY_SKIP_VLLM=1 is the only way to skip them."""
    skipped = 0
    for item in items:
        if "vllm" not in item.keywords:
            continue
        if item.get_closest_marker("timeout") is None:  # a module may know it needs longer
            item.add_marker(pytest.mark.timeout(VLLM_TEST_TIMEOUT_S))
        if vllm_skipped():
            item.add_marker(pytest.mark.skip(reason=f"{SKIP_VLLM_VARIABLE}=1"))
            skipped += 1
    config.stash[_SKIPPED_VLLM] = skipped


_SKIPPED_VLLM = pytest.StashKey[int]()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    skipped = terminalreporter.config.stash.get(_SKIPPED_VLLM, 0)
    if skipped:
        terminalreporter.write_sep(
            "!",
            f"{skipped} real-vLLM tests NOT RUN: {SKIP_VLLM_VARIABLE}=1 is set",
            yellow=True,
            bold=True,
        )
