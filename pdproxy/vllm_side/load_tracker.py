"""Running/waiting counts as the scheduler-side connector sees them. Pure.

The connector is told when a request arrives (on_new_request), when it gets KV blocks (it is
being scheduled) and when it finishes; that is enough for the load a router needs. A request
preempted back to the queue still counts as running until it finishes: an overestimate that
steers new work away, which is the safe side.
"""

from __future__ import annotations

from pdproxy.registry.messages import Load


class LoadTracker:
    def __init__(self) -> None:
        self._waiting: set[str] = set()
        self._running: set[str] = set()

    def arrived(self, request_id: str) -> None:
        if request_id not in self._running:
            self._waiting.add(request_id)

    def scheduled(self, request_id: str) -> None:
        self._waiting.discard(request_id)
        self._running.add(request_id)

    def finished(self, request_id: str) -> None:
        self._waiting.discard(request_id)
        self._running.discard(request_id)

    def load(self, kv_usage: float | None = None) -> Load:
        return Load(running=len(self._running), waiting=len(self._waiting), kv_usage=kv_usage)
