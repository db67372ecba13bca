"""The checks a tagged X-Request-Id triggers before the first token, as P2pNcclConnector does.

A prefill worker pushes the request's KV to the decode address vLLM's regex finds in the id; a
decode worker waits for it and checks it came from the prefill the id names, for its own prompt.
Any mismatch is a loud HTTP 500, so a proxy that tags or pairs wrongly cannot pass unnoticed.
"""

from __future__ import annotations

import hashlib
import re
import uuid

import zmq

from pdproxy.ids import VLLM_DECODE_SIDE, VLLM_PREFILL_SIDE
from pdproxy.testing.fake_worker.asyncio_helpers import sleep
from pdproxy.testing.fake_worker.config import WorkerConfig
from pdproxy.testing.fake_worker.generation import Generation
from pdproxy.testing.fake_worker.http_json import ApiError
from pdproxy.testing.fake_worker.kv_store import KvStore
from pdproxy.testing.fake_worker.kv_transport import KvSender
from pdproxy.testing.fake_worker.records import Records, stamp


def engine_request_id(header_id: str, chat: bool) -> str:
    """The id vLLM's engine (and so its connector regexes) sees for X-Request-Id."""
    suffix = uuid.uuid4().hex[:8]
    return f"chatcmpl-{header_id}-{suffix}" if chat else f"cmpl-{header_id}-0-{suffix}"


def regex_address(pattern: re.Pattern[str], engine_id: str) -> str | None:
    """ "host:port" as vLLM's greedy regex captures it, unvalidated (as vLLM uses it)."""
    match = pattern.search(engine_id)
    return None if match is None else f"{match[1]}:{int(match[2])}"


def kv_payload(generation: Generation) -> bytes:
    """What a P "computes" for a request; a D checks it got the KV of its own prompt."""
    return hashlib.sha256("\x00".join(p.text for p in generation.prompts).encode()).digest()


class KvHandoff:
    """One worker's side of the handoff: pushing (P) or awaiting and checking (D)."""

    def __init__(
        self, cfg: WorkerConfig, store: KvStore, sender: KvSender, records: Records
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.sender = sender
        self.records = records

    async def before_first_token(self, header_id: str | None, generation: Generation) -> None:
        """Prefill latency and the KV handoff a tagged id asks for; raises ApiError on failure."""
        engine_id = None if header_id is None else engine_request_id(header_id, generation.chat)
        if self.cfg.role == "P":
            await sleep(self.cfg.prefill_latency_s)
            decode = None if engine_id is None else regex_address(VLLM_PREFILL_SIDE, engine_id)
            if header_id is not None and decode is not None:
                await self._push_kv(header_id, decode, generation)
            return
        prefill = None if engine_id is None else regex_address(VLLM_DECODE_SIDE, engine_id)
        if header_id is not None and engine_id is not None and prefill is not None:
            await self._await_kv(header_id, engine_id, prefill, generation)
        else:  # untagged: this D computes the prompt itself
            await sleep(self.cfg.prefill_latency_s)

    async def _push_kv(self, request_id: str, decode: str, generation: Generation) -> None:
        try:
            await self.sender.push(
                decode, request_id, kv_payload(generation), self.cfg.kv_timeout_s
            )
        except (zmq.ZMQError, TimeoutError) as err:
            reason = "send_timeout" if isinstance(err, TimeoutError) else "send_error"
            self.records.add("kv_failed", {"request_id": request_id, "reason": reason, **stamp()})
            raise ApiError(
                500, f"fake prefill: cannot push KV for request {request_id} to decode {decode}"
            ) from None
        self.records.add("kv_sent", {"request_id": request_id, "to": decode, **stamp()})

    async def _await_kv(
        self, request_id: str, engine_id: str, prefill: str, generation: Generation
    ) -> None:
        item = await self.store.wait(request_id, self.cfg.kv_timeout_s)
        if item is None:
            reason = "timeout"
            message = (
                f"fake decode: no KV for request {request_id} from prefill {prefill} "
                f"within {self.cfg.kv_timeout_s}s"
            )
            named_decode = regex_address(VLLM_PREFILL_SIDE, engine_id)
            if named_decode is not None and named_decode != str(self.cfg.kv):
                message += f" (the id names decode {named_decode}, this worker is {self.cfg.kv})"
        elif item.sender != prefill:
            reason = "wrong_sender"
            message = (
                f"fake decode: KV for request {request_id} came from {item.sender}, "
                f"but the request id names prefill {prefill}"
            )
        elif item.payload != kv_payload(generation):
            reason = "payload_mismatch"
            message = (
                f"fake decode: KV for request {request_id} from {item.sender} was computed "
                "for a different prompt"
            )
        else:
            self.records.add("kv_ok", request_id)
            return
        self.records.add("kv_failed", {"request_id": request_id, "reason": reason, **stamp()})
        raise ApiError(500, message)
