"""The engine id of each mooncake prefill, from its bootstrap server.

vLLM's MooncakeConnector decode leg names the prefill engine it pulls from
(`remote_engine_id`); only the prefill's bootstrap server (VLLM_MOONCAKE_BOOTSTRAP_PORT, started
by its TP rank 0) knows it: `GET /query` answers `{"<dp rank>": {"engine_id": ..., "worker_addr":
{"<tp rank>": {"<pp rank>": "host:port"}}}}` (vllm/.../mooncake/mooncake_utils.py
`MooncakeBootstrapServer.query`). The id changes when the prefill restarts, so it is asked
once per bootstrap address, cached, and forgotten when an attempt with that prefill failed
(the next attempt asks again). Concurrent requests for the same address share one question,
each waiting at most the bound; the cache holds at most `limit` addresses.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

import orjson

from pdproxy.http.upstream import UpstreamClient, UpstreamError
from pdproxy.ids import Address

QUERY_PATH = "/query"
MAX_QUERY_BYTES = 256 * 1024  # a few entries per data-parallel rank; far more is not an answer


class BootstrapError(Exception):
    """The bootstrap server gave no usable engine id; the message says why."""


def engine_id_from_query(body: bytes) -> str:
    """The engine id in a /query answer: the lowest data-parallel rank's (the rank vLLM's own
    proxy example sends to); raises BootstrapError."""
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise BootstrapError("its answer is not JSON") from None
    if not isinstance(answer, dict):
        raise BootstrapError("its answer is not a JSON object")
    ranks: list[tuple[int, Any]] = []
    for key, entry in answer.items():
        try:
            ranks.append((int(key), entry))
        except ValueError:
            raise BootstrapError(f"data-parallel rank {key[:32]!r} is not an integer") from None
    if not ranks:
        raise BootstrapError("no prefill worker has registered with it yet")
    _, entry = min(ranks, key=lambda item: item[0])
    engine_id = entry.get("engine_id") if isinstance(entry, dict) else None
    if not isinstance(engine_id, str) or not engine_id:
        raise BootstrapError("its entry has no engine_id string")
    return engine_id


class EngineIds:
    """Engine ids by bootstrap address: asked over `upstream`, each question bounded by
    `timeout` seconds."""

    def __init__(
        self,
        upstream: UpstreamClient,
        timeout: float,
        loop: asyncio.AbstractEventLoop,
        limit: int = 4096,
    ) -> None:
        self._upstream = upstream
        self._timeout = timeout
        self._loop = loop
        self._limit = limit
        self._known: OrderedDict[Address, str] = OrderedDict()
        self._asking: dict[Address, asyncio.Task[str]] = {}

    async def engine_id(self, bootstrap: Address) -> str:
        """The cached id, or the server's answer; raises BootstrapError."""
        known = self._known.get(bootstrap)
        if known is not None:
            return known
        task = self._asking.get(bootstrap)
        if task is None:
            task = self._asking[bootstrap] = self._loop.create_task(self._ask(bootstrap))
            task.add_done_callback(lambda done: self._asked(bootstrap, done))
        # Shielded: one caller going away does not cancel the others' question.
        return await asyncio.shield(task)

    def _asked(self, bootstrap: Address, task: asyncio.Task[str]) -> None:
        self._asking.pop(bootstrap, None)
        if not task.cancelled():
            task.exception()  # retrieved here too: its waiters may all have gone

    def forget(self, bootstrap: Address) -> None:
        """Ask again next time (the prefill may have restarted as another engine)."""
        self._known.pop(bootstrap, None)

    async def _ask(self, bootstrap: Address) -> str:
        where = f"bootstrap server http://{bootstrap}{QUERY_PATH}"
        headers = {"Accept": "application/json"}
        try:
            async with asyncio.timeout(self._timeout):
                async with self._upstream.stream(
                    "GET", bootstrap, QUERY_PATH, None, headers
                ) as answer:
                    body = await answer.read_all(MAX_QUERY_BYTES)
                    status = answer.status
        except TimeoutError:
            raise BootstrapError(f"{where} did not answer within {self._timeout:g}s") from None
        except UpstreamError as exc:
            raise BootstrapError(f"{where}: {exc}") from None
        if status != 200:
            raise BootstrapError(f"{where} answered HTTP {status}")
        try:
            engine_id = engine_id_from_query(body)
        except BootstrapError as exc:
            raise BootstrapError(f"{where}: {exc}") from None
        self._known[bootstrap] = engine_id
        while len(self._known) > self._limit:
            self._known.popitem(last=False)
        return engine_id
