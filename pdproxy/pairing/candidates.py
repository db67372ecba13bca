"""One set of interchangeable-for-pairing instances a policy picks from. Pure.

Built once per fleet snapshot by the planner; whatever a policy derives from the set (score
boards, a hash ring) is built on first use and lives as long as the set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from pdproxy.pairing.inflight import Busy, InFlight
from pdproxy.pairing.scoreboard import LoadKind, ScoreBoard, kv_load, request_load
from pdproxy.registry.table import Instance

T = TypeVar("T")


class Candidates:
    def __init__(
        self, instances: tuple[Instance, ...], inflight: InFlight, kv_capacity_tokens: int
    ) -> None:
        if not instances:
            raise ValueError("a candidate set is never empty")
        self.instances = instances
        self._inflight = inflight
        self._kv_capacity_tokens = kv_capacity_tokens
        self._boards: dict[LoadKind, ScoreBoard] = {}
        self._derived: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.instances)

    def __iter__(self) -> Iterator[Instance]:
        return iter(self.instances)

    def board(self, kind: LoadKind) -> ScoreBoard:
        board = self._boards.get(kind)
        if board is None:
            board = ScoreBoard(self.instances, self._scorer(kind), self._inflight)
            self._inflight.listen(board.changed)
            self._boards[kind] = board
        return board

    def derived(self, key: str, build: Callable[[tuple[Instance, ...]], T]) -> T:
        """`build(instances)`, computed once per candidate set (policies' own structures)."""
        if key not in self._derived:
            self._derived[key] = build(self.instances)
        value: T = self._derived[key]
        return value

    def _scorer(self, kind: LoadKind) -> Callable[[Instance, Busy], float]:
        if kind is LoadKind.REQUESTS:
            return request_load
        capacity = self._kv_capacity_tokens
        return lambda instance, busy: kv_load(instance, busy, capacity)
