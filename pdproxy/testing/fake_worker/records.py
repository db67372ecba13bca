"""What the worker saw, kept in bounded rings for tests in other processes to read."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

RECORD_LIMIT = 1000  # each /_fake/ ring keeps the last this many entries
EVENT_NAMES = ("kv_sent", "kv_received", "kv_ok", "kv_failed", "aborted", "completed")


def stamp() -> dict[str, float]:
    return {"time": time.monotonic(), "wall": time.time()}


@dataclass(slots=True)
class Exchange:
    """One completion request as the records know it."""

    record_id: str  # X-Request-Id, or the response id when the header is absent
    path: str
    aborted: bool = False


class Records:
    """What the worker saw, for GET /_fake/requests and /_fake/events (bounded rings)."""

    def __init__(self) -> None:
        self.requests: deque[dict[str, Any]] = deque(maxlen=RECORD_LIMIT)
        self.events: dict[str, deque[Any]] = {n: deque(maxlen=RECORD_LIMIT) for n in EVENT_NAMES}

    def add(self, event: str, entry: Any) -> None:
        self.events[event].append(entry)

    def add_abort(self, exchange: Exchange) -> None:
        # Both a reset connection and the handler's cancellation may report one abort.
        if not exchange.aborted:
            exchange.aborted = True
            self.add(
                "aborted", {"request_id": exchange.record_id, "path": exchange.path, **stamp()}
            )

    def events_snapshot(self) -> dict[str, list[Any]]:
        return {name: list(entries) for name, entries in self.events.items()}

    def clear(self) -> None:
        self.requests.clear()
        for entries in self.events.values():
            entries.clear()
