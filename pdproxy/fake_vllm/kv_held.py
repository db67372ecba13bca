"""KV a nixl/pdproxy prefill holds for its decode to read, and its answer to a decode's pull.

Like vLLM's NixlConnector, a prefill keeps a finished request's blocks until the decode has read
them or a timeout passes (vLLM: VLLM_NIXL_ABORT_REQUEST_TIMEOUT; here --kv-timeout), and a
transfer is read once: a second read of the same blocks finds nothing.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass

from pdproxy.fake_vllm.kv_payload import KvPayload
from pdproxy.fake_vllm.kv_stats import StatsKey
from pdproxy.fake_vllm.kv_wire import Pull, PullReply

HELD_LIMIT = 10_000


@dataclass(frozen=True, slots=True)
class HeldKv:
    payload: KvPayload
    block_ids: tuple[int, ...]
    held_at: float  # monotonic
    stats: StatsKey | None = None  # how the transfer is reported once read (None: not at all)


class HeldTransfers:
    """Held KV keyed by transfer id (the remote_request_id the prefill answered with)."""

    def __init__(self, engine_id: str, ttl_s: float, limit: int = HELD_LIMIT) -> None:
        self.engine_id = engine_id
        self._ttl_s = ttl_s
        self._limit = limit
        self._items: OrderedDict[str, HeldKv] = OrderedDict()  # oldest first
        self._next_block = itertools.count()

    def hold(
        self, transfer_id: str, payload: KvPayload, blocks: int, stats: StatsKey | None = None
    ) -> HeldKv:
        """Keep `payload` under fresh block ids (as a prefill's KV sits in its own blocks)."""
        now = time.monotonic()
        held = HeldKv(payload, tuple(itertools.islice(self._next_block, blocks)), now, stats)
        self._items.pop(transfer_id, None)
        self._items[transfer_id] = held
        self._prune(now)
        return held

    def _prune(self, now: float) -> None:
        while self._items:
            oldest = next(iter(self._items.values()))
            if len(self._items) <= self._limit and now - oldest.held_at <= self._ttl_s:
                break
            self._items.popitem(last=False)

    def answer(self, pull: Pull) -> tuple[PullReply, HeldKv | None]:
        """The reply to a decode's pull, and the KV it serves (None: refused); a transfer
        served once is gone."""
        self._prune(time.monotonic())

        def refuse(error: str) -> tuple[PullReply, None]:
            return PullReply(pull.transfer_id, self.engine_id, None, error), None

        if pull.engine_id != self.engine_id:
            return refuse("engine_id_mismatch")  # meant for another prefill: leave ours alone
        held = self._items.get(pull.transfer_id)
        if held is None:
            return refuse("missing_transfer")
        if held.block_ids != pull.block_ids:
            return refuse("block_ids_mismatch")
        del self._items[pull.transfer_id]
        return PullReply(pull.transfer_id, self.engine_id, held.payload, None), held
