"""KV payloads a p2p_nccl decode worker was pushed, and the requests waiting for theirs."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass

from pdproxy.fake_vllm.kv_payload import KvPayload

KV_STORE_LIMIT = 10_000
KV_STORE_TTL_S = 60.0


@dataclass(frozen=True, slots=True)
class KvItem:
    sender: str
    payload: KvPayload
    arrived: float  # monotonic


class KvStore:
    """KV payloads received by this worker, keyed by request id, and the requests awaiting them."""

    def __init__(self, limit: int = KV_STORE_LIMIT, ttl_s: float = KV_STORE_TTL_S) -> None:
        self._limit = limit
        self._ttl_s = ttl_s
        self._items: OrderedDict[str, KvItem] = OrderedDict()  # oldest first
        self._waiters: dict[str, set[asyncio.Future[KvItem]]] = {}

    def put(self, request_id: str, item: KvItem) -> None:
        self._items.pop(request_id, None)
        self._items[request_id] = item
        self._prune(item.arrived)
        for waiter in self._waiters.get(request_id, ()):
            if not waiter.done():
                waiter.set_result(item)

    def _prune(self, now: float) -> None:
        while self._items:
            oldest = next(iter(self._items.values()))
            if len(self._items) <= self._limit and now - oldest.arrived <= self._ttl_s:
                break
            self._items.popitem(last=False)

    async def wait(self, request_id: str, timeout_s: float) -> KvItem | None:
        """The payload for `request_id`, waiting at most `timeout_s`; None on timeout."""
        item = self._items.get(request_id)
        if item is not None and time.monotonic() - item.arrived <= self._ttl_s:
            return item
        waiter: asyncio.Future[KvItem] = asyncio.get_running_loop().create_future()
        waiters = self._waiters.setdefault(request_id, set())
        waiters.add(waiter)
        try:
            async with asyncio.timeout(timeout_s):  # not wait_for: see KvSender.push
                return await waiter
        except TimeoutError:
            return None
        finally:  # also on cancellation: no waiter outlives its request
            waiters.discard(waiter)
            if not waiters:
                self._waiters.pop(request_id, None)
