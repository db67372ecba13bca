"""The p2p_nccl handoff a tagged X-Request-Id triggers, as P2pNcclConnector does it.

A prefill pushes the request's KV to the decode address vLLM's regex finds in the id; a decode
waits for it and checks it came from the prefill the id names, fits its cache and is for its
own prompt. Any mismatch is a loud HTTP 500, so a proxy that tags or pairs wrongly cannot pass
unnoticed. kv_transfer_params are ignored, as P2pNcclConnector ignores them, but for pdproxy's
own connector, whose prefill learns the decode's TP size from them.
"""

from __future__ import annotations

import re
import uuid

import zmq

from pdproxy.fake_vllm.config import WorkerConfig
from pdproxy.fake_vllm.generation import Generation
from pdproxy.fake_vllm.http_json import ApiError
from pdproxy.fake_vllm.kv_accept import accept, kv_failure
from pdproxy.fake_vllm.kv_payload import compute_payload
from pdproxy.fake_vllm.kv_stats import KvStats, payload_size
from pdproxy.fake_vllm.kv_store import KvStore
from pdproxy.fake_vllm.kv_transport import KvSender
from pdproxy.fake_vllm.kv_wire import Push, WireError
from pdproxy.fake_vllm.records import Records, stamp
from pdproxy.ids import VLLM_DECODE_SIDE, VLLM_PREFILL_SIDE


def engine_request_id(header_id: str, chat: bool) -> str:
    """The id vLLM's engine (and so its connector regexes) sees for X-Request-Id."""
    suffix = uuid.uuid4().hex[:8]
    return f"chatcmpl-{header_id}-{suffix}" if chat else f"cmpl-{header_id}-0-{suffix}"


def regex_address(pattern: re.Pattern[str], engine_id: str) -> str | None:
    """ "host:port" as vLLM's greedy regex captures it, unvalidated (as vLLM uses it)."""
    match = pattern.search(engine_id)
    return None if match is None else f"{match[1]}:{int(match[2])}"


class PushFlow:
    """One worker's side of the p2p_nccl handoff: pushing (P) or awaiting and checking (D)."""

    def __init__(
        self,
        cfg: WorkerConfig,
        store: KvStore,
        sender: KvSender,
        records: Records,
        stats: KvStats,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.sender = sender
        self.records = records
        self.stats = stats

    def decode_address(self, header_id: str | None, chat: bool) -> str | None:
        """P: where the id says to push, if it is tagged."""
        if header_id is None:
            return None
        return regex_address(VLLM_PREFILL_SIDE, engine_request_id(header_id, chat))

    def prefill_address(self, header_id: str | None, chat: bool) -> tuple[str, str] | None:
        """D: (engine id, the prefill it names) when the id is tagged."""
        if header_id is None:
            return None
        engine_id = engine_request_id(header_id, chat)
        prefill = regex_address(VLLM_DECODE_SIDE, engine_id)
        return None if prefill is None else (engine_id, prefill)

    async def push(
        self, request_id: str, decode: str, generation: Generation, decode_tp: int | None = None
    ) -> None:
        key = self.stats.key(request_id, generation)
        started = self.stats.clock()
        payload = compute_payload(self.cfg, generation, decode_tp)
        message = Push(request_id, self.sender.own_address, payload)
        try:
            await self.sender.push(decode, message, self.cfg.kv_timeout_s)
        except (zmq.ZMQError, TimeoutError, WireError) as err:
            reason = "send_timeout" if isinstance(err, TimeoutError) else "send_error"
            self.stats.failed(key, decode, reason, 0, started)
            raise kv_failure(
                self.records,
                request_id,
                reason,
                f"fake prefill: cannot push KV for request {request_id} to decode {decode}",
            ) from None
        size = payload_size(message.payload)
        self.stats.report(key, decode, "ok", size, started)
        self.records.add(
            "kv_sent", {"request_id": request_id, "to": decode, "bytes": size, **stamp()}
        )

    async def await_kv(
        self, request_id: str, engine_id: str, prefill: str, generation: Generation
    ) -> None:
        key = self.stats.key(request_id, generation)
        started = self.stats.clock()
        item = await self.store.wait(request_id, self.cfg.kv_timeout_s)
        if item is None:
            self.stats.failed(key, prefill, "timeout", 0, started)
            message = (
                f"fake decode: no KV for request {request_id} from prefill {prefill} "
                f"within {self.cfg.kv_timeout_s}s"
            )
            named_decode = regex_address(VLLM_PREFILL_SIDE, engine_id)
            if named_decode is not None and named_decode != str(self.cfg.kv):
                message += f" (the id names decode {named_decode}, this worker is {self.cfg.kv})"
            raise kv_failure(self.records, request_id, "timeout", message)
        size = payload_size(item.payload)
        if item.sender != prefill:
            self.stats.failed(key, prefill, "wrong_sender", size, started)
            raise kv_failure(
                self.records,
                request_id,
                "wrong_sender",
                f"fake decode: KV for request {request_id} came from {item.sender}, "
                f"but the request id names prefill {prefill}",
            )
        try:
            accept(
                self.cfg, self.records, request_id, f"prefill {prefill}", item.payload, generation
            )
        except ApiError:
            self.stats.report(key, prefill, "error", size, started)  # it arrived, unusable
            raise
        self.stats.report(key, prefill, "ok", size, started)
