"""Shared fixtures: real processes on loopback, always stopped by PID."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from pdproxy.testing.fleet import LocalFleet, WorkerSpec

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
