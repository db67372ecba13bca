"""vLLM's MooncakeConnector flow, as the fake worker speaks it.

The proxy names the transfer (`transfer_id`) in both legs, which may arrive in either order.
A prefill asked to `do_remote_decode` keeps the prompt's KV under that id and answers no
kv_transfer_params; its bootstrap server (here the worker's own HTTP port, `GET /query`, the
answer shape of vLLM's MooncakeBootstrapServer) names its engine and KV port. A decode given
`do_remote_prefill` asks `remote_bootstrap_addr` + "/query" for `remote_engine_id`'s KV port,
then pulls the transfer from it, waiting (bounded by --kv-timeout) until the prefill holds it.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from pdproxy.fake_vllm.kv_params import ParamsError, RemotePrefill, field
from pdproxy.ids import AddressError, parse_address

MAX_QUERY_BYTES = 64 * 1024


def query_answer(engine_id: str, kv_address: str) -> dict[str, Any]:
    """What vLLM's bootstrap server answers for one engine of one TP and PP rank."""
    return {"0": {"engine_id": engine_id, "worker_addr": {"0": {"0": kv_address}}}}


def transfer_id(params: dict[str, Any]) -> str:
    value = field(params, "transfer_id", str)
    if not value:
        raise ParamsError("transfer_id must be a non-empty string")
    return str(value)


class BootstrapUnusable(Exception):
    """The prefill's bootstrap server gave no KV address for the engine; `reason` is short."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


async def locate(params: dict[str, Any], timeout_s: float) -> RemotePrefill:
    """Where the decode pulls from: the engine's KV port, from the bootstrap server's /query.
    Raises ParamsError (bad params) or BootstrapUnusable."""
    transfer = transfer_id(params)
    engine_id = field(params, "remote_engine_id", str)
    bootstrap = field(params, "remote_bootstrap_addr", str)
    if not bootstrap.startswith("http://"):
        raise ParamsError(f"remote_bootstrap_addr {bootstrap!r} is not an http:// address")
    answer = await _query(bootstrap + "/query", timeout_s)
    entries = answer.values() if isinstance(answer, dict) else ()
    for entry in entries:
        if isinstance(entry, dict) and entry.get("engine_id") == engine_id:
            try:
                kv = parse_address(entry["worker_addr"]["0"]["0"])
            except (KeyError, TypeError, AddressError) as err:
                raise BootstrapUnusable("bad_bootstrap", f"no worker address: {err}") from None
            return RemotePrefill(engine_id, (), transfer, kv)
    raise BootstrapUnusable(
        "engine_id_mismatch",
        f"remote engine_id {engine_id} not found from bootstrap server {bootstrap}",
    )


async def _query(url: str, timeout_s: float) -> Any:
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as reply:
            body = await reply.content.read(MAX_QUERY_BYTES)
            if reply.status != 200:
                raise BootstrapUnusable("bootstrap_error", f"{url} answered {reply.status}")
    except (aiohttp.ClientError, TimeoutError) as err:
        raise BootstrapUnusable("bootstrap_error", f"{url}: {err!r}") from None
    try:
        return json.loads(body)
    except ValueError:
        raise BootstrapUnusable("bootstrap_error", f"{url} answered no JSON") from None


class Deadline:
    """How long a decode may still wait for a prefill to hold the transfer."""

    def __init__(self, seconds: float) -> None:
        self._end = time.monotonic() + seconds

    def left(self) -> float:
        return self._end - time.monotonic()


async def pause(deadline: Deadline, seconds: float = 0.02) -> None:
    await asyncio.sleep(max(0.0, min(seconds, deadline.left())))
