"""vLLM's NixlPushConnector flow, as the fake worker speaks it.

Both legs come at once, in either order, with the same X-Request-Id; vLLM matches them by the
engine request id without its random suffix (nixl/utils.get_base_request_id). The decode leg's
kv_transfer_params name the prefill: `remote_engine_id`, `remote_host`/`remote_port` (its NIXL
side channel, here its KV port), `tp_size`, and `remote_request_id` (vLLM reads it unguarded).
The decode registers with that prefill (a "register" message) and waits, bounded by
--kv-timeout, for the KV to be written into it; the prefill, once it computed the prompt, writes
(pushes) the KV to the registered decode. Whichever of the two comes first waits for the other,
at most --kv-timeout, in a bounded table. A registration naming another engine id is dropped
(vLLM's handshake refuses it), so that decode times out.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pdproxy.fake_vllm.config import WorkerConfig
from pdproxy.fake_vllm.generation import Generation
from pdproxy.fake_vllm.http_json import ApiError
from pdproxy.fake_vllm.kv_params import ParamsError, field, prefill_answer
from pdproxy.fake_vllm.kv_push_flow import PushFlow
from pdproxy.fake_vllm.kv_transport import KvSender
from pdproxy.fake_vllm.kv_wire import Register, WireError
from pdproxy.fake_vllm.records import Records, stamp
from pdproxy.ids import Address

PENDING_LIMIT = 10_000


def push_key(header_id: str, chat: bool) -> str:
    """The id vLLM's push connector matches both legs by (the engine id, suffix stripped)."""
    return f"chatcmpl-{header_id}" if chat else f"cmpl-{header_id}-0"


@dataclass(frozen=True, slots=True)
class DecodeLeg:
    """What a nixl_push decode leg's kv_transfer_params say about its prefill."""

    engine_id: str
    side_channel: Address
    tp_size: int

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> DecodeLeg:
        field(params, "remote_request_id", str)  # vLLM's scheduler dies on a KeyError without
        host, port = field(params, "remote_host", str), field(params, "remote_port", int)
        if not host or any(c.isspace() for c in host) or not 1 <= port <= 65535:
            raise ParamsError(f"remote_host:remote_port {host!r}:{port} is not a side channel")
        return cls(
            field(params, "remote_engine_id", str),
            Address(host, port),
            field(params, "tp_size", int),
        )


class Pending:
    """Entries waiting for their other half, oldest first, bounded in count and age."""

    def __init__(self, ttl_s: float, limit: int = PENDING_LIMIT) -> None:
        self._ttl_s = ttl_s
        self._limit = limit
        self._items: OrderedDict[str, tuple[float, Any]] = OrderedDict()

    def put(self, key: str, value: Any) -> None:
        now = time.monotonic()
        self._items.pop(key, None)
        self._items[key] = (now, value)
        while self._items:
            since, _ = next(iter(self._items.values()))
            if len(self._items) <= self._limit and now - since <= self._ttl_s:
                break
            self._items.popitem(last=False)

    def pop(self, key: str) -> Any | None:
        entry = self._items.pop(key, None)
        if entry is None or time.monotonic() - entry[0] > self._ttl_s:
            return None
        return entry[1]


class NixlPushFlow:
    """One worker's side of the push handoff: writing to registered decodes (P), or
    registering with the prefill and waiting for the KV (D)."""

    def __init__(self, cfg: WorkerConfig, push: PushFlow, sender: KvSender, records: Records):
        self.cfg = cfg
        self.push = push
        self.sender = sender
        self.records = records
        self._finished = Pending(cfg.kv_timeout_s)  # P: key -> Generation, no decode yet
        self._registered = Pending(cfg.kv_timeout_s)  # P: key -> decode KV address

    async def finished(self, header_id: str, generation: Generation) -> dict[str, Any]:
        """P: the prompt is computed; write it to its decode if one registered already, else
        keep it for the registration. Answers what vLLM's push prefill answers."""
        key = push_key(header_id, generation.unindexed)
        decode = self._registered.pop(key)
        if decode is None:
            self._finished.put(key, generation)
        else:
            await self._write(key, decode, generation)
        answer = prefill_answer(self.cfg.engine_id, key, (), self.cfg.kv, self.cfg.geometry.tp_size)
        return answer | {"transfer_mode": "push"}

    async def registered(self, message: Register) -> None:
        """P: a decode's registration arrived at the side channel."""
        entry = {"request_id": message.request_id, "decode": message.sender}
        if message.engine_id != self.cfg.engine_id:
            self.records.kv_failed("engine_id_mismatch", **entry, engine_id=message.engine_id)
            return
        self.records.add("kv_registered", {**entry, **stamp()})
        generation = self._finished.pop(message.request_id)
        if generation is None:
            self._registered.put(message.request_id, message.sender)
        else:
            await self._write(message.request_id, message.sender, generation)

    async def _write(self, key: str, decode: str, generation: Generation) -> None:
        # A failure is recorded as kv_failed; the decode then times out, as vLLM's waits out
        # its registration.
        with contextlib.suppress(ApiError):
            await self.push.push(key, decode, generation)

    async def receive(
        self, request_id: str, header_id: str | None, params: dict[str, Any], generation: Generation
    ) -> None:
        """D: register with the prefill the params name, then wait for its KV (bounded)."""
        prefill = DecodeLeg.from_params(params)  # raises ParamsError
        key = push_key(header_id or request_id, generation.unindexed)
        registration = Register(key, prefill.engine_id, str(self.cfg.kv))
        try:
            await self.sender.push(str(prefill.side_channel), registration, self.cfg.kv_timeout_s)
        except (OSError, TimeoutError, WireError) as err:
            self.records.kv_failed("register_error", request_id=request_id, error=repr(err))
        await self.push.await_kv(key, key, str(prefill.side_channel), generation)
