"""One set of interchangeable-for-pairing instances a policy picks from. Pure.

Built once per fleet snapshot by the planner; whatever a policy derives from the set (score
boards, a hash ring) is built on first use and lives as long as the set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from pdproxy.pairing.inflight import InFlight
from pdproxy.pairing.prefix_cache import PrefixCache
from pdproxy.pairing.scoreboard import LoadKind, ScoreBoard, scoring
from pdproxy.registry.table import Instance

T = TypeVar("T")


class Candidates:
    def __init__(
        self,
        instances: tuple[Instance, ...],
        inflight: InFlight,
        kv_capacity_tokens: int,
        prefix_cache: PrefixCache | None = None,
        *,
        live: bool = True,
    ) -> None:
        if not instances:
            raise ValueError("a candidate set is never empty")
        self.instances = instances
        # The planner's model of which instance holds which prompt prefix (read-only here).
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache()
        self._inflight = inflight
        self._kv_capacity_tokens = kv_capacity_tokens
        # A live set's boards follow every later leg; a one-off set (a retry that avoids
        # instances) reads the scores once and leaves no listener behind.
        self._live = live
        self._boards: dict[LoadKind, ScoreBoard] = {}
        self._derived: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.instances)

    def __iter__(self) -> Iterator[Instance]:
        return iter(self.instances)

    def board(self, kind: LoadKind) -> ScoreBoard:
        board = self._boards.get(kind)
        if board is None:
            rule = scoring(kind, self._kv_capacity_tokens, self.instances, self._inflight)
            board = ScoreBoard(self.instances, rule, self._inflight)
            if self._live:
                self._inflight.listen((i.http_address for i in self.instances), board.changed)
            self._boards[kind] = board
        return board

    def derived(self, key: str, build: Callable[[tuple[Instance, ...]], T]) -> T:
        """`build(instances)`, computed once per candidate set (policies' own structures)."""
        if key not in self._derived:
            self._derived[key] = build(self.instances)
        value: T = self._derived[key]
        return value
