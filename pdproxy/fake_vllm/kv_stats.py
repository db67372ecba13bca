"""KV transfer statistics from the fake worker, so the proxy's KV metrics can be tested without
vLLM: every handoff a v1-announcing worker takes part in is reported with the registry's
"stats" op, as each TP rank of a PdproxyConnector instance reports its share.

- the id is the tag's uid plus "-0" (completions) or "-chat", as PdproxyConnector names its
  transfers (the fake moves all prompts of a request as one payload); an untagged request
  moves no KV and reports nothing;
- the peer is the other worker's KV address, as the tag or kv_transfer_params name it;
- bytes are the payload's size (its msgpack encoding: the same on both sides), split over the
  ranks; blocks are ceil(prompt tokens / block size) for every rank; seconds are measured;
- the outcome of a failed handoff follows its kv_failed reason (OUTCOMES).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import msgpack

from pdproxy.fake_vllm.config import WorkerConfig
from pdproxy.fake_vllm.generation import Generation
from pdproxy.fake_vllm.kv_payload import KvPayload
from pdproxy.ids import parse_request_id
from pdproxy.vllm_side.announcement import TransferOutcome, TransferStat
from pdproxy.vllm_side.stats_reporter import StatsReporter

OUTCOMES: dict[str, TransferOutcome] = {
    "send_timeout": "timeout",
    "send_error": "error",
    "timeout": "timeout",
    "wrong_sender": "error",
    "geometry_mismatch": "error",
    "payload_mismatch": "error",
    "decode_tp_mismatch": "error",
    "bad_params": "error",
    "wrong_role": "error",
    "pull_error": "error",
    "bad_reply": "error",
    "engine_id_mismatch": "error",
    "missing_transfer": "missing",
    "block_ids_mismatch": "error",
    "register_error": "error",
}


@dataclass(frozen=True, slots=True)
class StatsKey:
    """What both sides agree on about a transfer before it starts."""

    transfer_id: str
    blocks: int  # per rank


class RankReporter(Protocol):
    """One simulated rank's reporter: a StatsReporter (a stub in tests)."""

    def report(self, stat: TransferStat) -> bool: ...

    def stop(self) -> None: ...


def payload_size(payload: KvPayload) -> int:
    return len(msgpack.packb(payload.as_map()))


def split(total: int, ranks: int) -> list[int]:
    """`total` over `ranks` parts that add up to it (the remainder on rank 0)."""
    share, rest = divmod(total, ranks)
    return [share + (rest if rank == 0 else 0) for rank in range(ranks)]


class KvStats:
    """Reports transfers through one StatsReporter per simulated rank (none: reports nothing)."""

    def __init__(self, cfg: WorkerConfig, reporters: Sequence[RankReporter] = ()) -> None:
        self._block_size = cfg.geometry.block_size
        self._reporters = tuple(reporters)
        self.clock = time.perf_counter

    @property
    def reporting(self) -> bool:
        return bool(self._reporters)

    @classmethod
    def connect(cls, cfg: WorkerConfig) -> KvStats:
        """Report to cfg.proxy (every address its name has) when the worker announces in v1
        (stock vLLM reports nothing)."""
        if cfg.proxy is None or cfg.announce != "v1":
            return cls(cfg)
        ranks = cfg.geometry.tp_size
        reporters: list[RankReporter] = [
            StatsReporter.connect(
                str(cfg.proxy),
                cfg.role,
                str(cfg.http),
                rank,
                ranks,
                cfg.registry_secret,
                refresh_s=cfg.announce_interval_s,
            )
            for rank in range(ranks)
        ]
        return cls(cfg, reporters)

    def key(self, request_id: str | None, generation: Generation) -> StatsKey | None:
        tagged = None if request_id is None else parse_request_id(request_id)
        if tagged is None:
            return None
        suffix = "chat" if generation.unindexed else "0"
        blocks = math.ceil(generation.prompt_tokens / self._block_size)
        return StatsKey(f"{tagged.uid}-{suffix}", blocks)

    def report(
        self, key: StatsKey | None, peer: str, outcome: TransferOutcome, size: int, started: float
    ) -> None:
        if key is None or not self._reporters:
            return
        seconds = self.clock() - started
        shares = split(size, len(self._reporters))
        for reporter, share in zip(self._reporters, shares, strict=True):
            stat = TransferStat(key.transfer_id, peer, share, key.blocks, seconds, outcome)
            reporter.report(stat)

    def failed(
        self, key: StatsKey | None, peer: str, reason: str, size: int, started: float
    ) -> None:
        self.report(key, peer, OUTCOMES.get(reason, "error"), size, started)

    def stop(self) -> None:
        for reporter in self._reporters:
            reporter.stop()
