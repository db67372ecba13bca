"""The nixl/pdproxy handoff, as vLLM's NixlConnector and its toy proxy do it.

kv_transfer_params decide, not the request id (a proxy may still tag it, for its logs): a
prefill asked to do_remote_decode holds the request's KV and answers where to read it; a decode
given do_remote_prefill reads it from that prefill's KV port and checks who answered, that the
KV fits its cache and is for its own prompt. Anything else is a loud HTTP 500.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

import zmq
import zmq.asyncio

from pdproxy.fake_vllm.config import WorkerConfig
from pdproxy.fake_vllm.generation import Generation
from pdproxy.fake_vllm.http_json import ApiError
from pdproxy.fake_vllm.kv_accept import accept, kv_failure
from pdproxy.fake_vllm.kv_held import HeldTransfers
from pdproxy.fake_vllm.kv_mooncake import (
    BootstrapUnusable,
    Deadline,
    locate,
    pause,
    transfer_id,
)
from pdproxy.fake_vllm.kv_params import (
    ParamsError,
    RemotePrefill,
    prefill_answer,
    remote_prefill,
)
from pdproxy.fake_vllm.kv_payload import compute_payload
from pdproxy.fake_vllm.kv_push_flow import engine_request_id
from pdproxy.fake_vllm.kv_stats import KvStats, StatsKey, payload_size
from pdproxy.fake_vllm.kv_transport import pull_kv
from pdproxy.fake_vllm.kv_wire import Pull, PullReply, WireError
from pdproxy.fake_vllm.records import Records, stamp

REFUSALS = {
    "missing_transfer": "it holds no such transfer (never held, expired, or already read)",
    "block_ids_mismatch": "it holds that transfer under other remote_block_ids",
}


class PullFlow:
    """One worker's side of the NIXL-style handoff: holding (P) or reading and checking (D)."""

    def __init__(
        self,
        cfg: WorkerConfig,
        held: HeldTransfers,
        ctx: zmq.asyncio.Context,
        records: Records,
        stats: KvStats,
    ) -> None:
        self.cfg = cfg
        self.held = held
        self.ctx = ctx
        self.records = records
        self.stats = stats

    def hold(
        self, request_id: str, header_id: str | None, generation: Generation
    ) -> dict[str, Any]:
        """P: keep the request's KV and answer the kv_transfer_params a decode reads it with."""
        # Keyed like vLLM's remote_request_id: the prefill engine's own id for the request.
        transfer_id = engine_request_id(header_id or uuid.uuid4().hex, generation.unindexed)
        blocks = max(1, math.ceil(generation.prompt_tokens / self.cfg.geometry.block_size))
        payload = compute_payload(self.cfg, generation)
        # The prefill reports the transfer when a decode reads it (kv_transport.serve_kv).
        held = self.held.hold(transfer_id, payload, blocks, self.stats.key(header_id, generation))
        self.records.add(
            "kv_held",
            {"request_id": request_id, "transfer_id": transfer_id, "blocks": blocks, **stamp()},
        )
        return prefill_answer(
            self.held.engine_id, transfer_id, held.block_ids, self.cfg.kv, self.cfg.geometry.tp_size
        )

    def hold_mooncake(
        self, request_id: str, params: dict[str, Any], generation: Generation
    ) -> None:
        """P (mooncake): keep the request's KV under the proxy's transfer id; nothing to answer."""
        try:
            transfer = transfer_id(params)
        except ParamsError as err:
            raise self._bad_params(request_id, err) from None
        payload = compute_payload(self.cfg, generation)
        # No block ids: a mooncake decode names the transfer, not the prefill's blocks.
        self.held.hold(transfer, payload, 0, self.stats.key(request_id, generation))
        self.records.add(
            "kv_held", {"request_id": request_id, "transfer_id": transfer, "blocks": 0, **stamp()}
        )

    async def read(self, request_id: str, params: dict[str, Any], generation: Generation) -> None:
        """D: read the KV the prefill holds for this request; raises a 500 unless usable."""
        try:
            remote = remote_prefill(params)
        except ParamsError as err:
            raise self._bad_params(request_id, err) from None
        await self._read(request_id, remote, generation, wait_for_hold=False)

    async def read_mooncake(
        self, request_id: str, params: dict[str, Any], generation: Generation
    ) -> None:
        """D (mooncake): find the prefill's KV port through its bootstrap server, then pull the
        transfer, waiting for the prefill to hold it (both legs may come at once)."""
        try:
            remote = await locate(params, self.cfg.kv_timeout_s)
        except ParamsError as err:
            raise self._bad_params(request_id, err) from None
        except BootstrapUnusable as err:
            raise kv_failure(
                self.records,
                request_id,
                err.reason,
                f"fake decode {self.cfg.kv}: request {request_id}: {err}",
            ) from None
        await self._read(request_id, remote, generation, wait_for_hold=True)

    def _bad_params(self, request_id: str, err: ParamsError) -> Exception:
        return kv_failure(
            self.records,
            request_id,
            "bad_params",
            f"fake {self.cfg.role} {self.cfg.kv}: unusable kv_transfer_params for request "
            f"{request_id}: {err}",
        )

    async def _read(
        self, request_id: str, remote: RemotePrefill, generation: Generation, wait_for_hold: bool
    ) -> None:
        key = self.stats.key(request_id, generation)
        started = self.stats.clock()
        reply = await self._pull(request_id, remote, key, started)
        deadline = Deadline(self.cfg.kv_timeout_s)
        while wait_for_hold and reply.error == "missing_transfer" and deadline.left() > 0:
            await pause(deadline)
            reply = await self._pull(request_id, remote, key, started)
        peer = str(remote.kv)
        if reply.engine_id != remote.engine_id:
            self.stats.failed(key, peer, "engine_id_mismatch", 0, started)
            raise kv_failure(
                self.records,
                request_id,
                "engine_id_mismatch",
                f"fake decode {self.cfg.kv}: for request {request_id} the prefill KV port "
                f"{remote.kv} answered as engine {reply.engine_id}, but remote_engine_id is "
                f"{remote.engine_id}",
            )
        if reply.payload is None:
            assert reply.error is not None
            why = REFUSALS.get(reply.error, reply.error)
            self.stats.failed(key, peer, reply.error, 0, started)
            raise kv_failure(
                self.records,
                request_id,
                reply.error,
                f"fake decode {self.cfg.kv}: prefill refused {remote.describe()} for request "
                f"{request_id}: {why}",
            )
        source = f"prefill {remote.kv} (engine {remote.engine_id})"
        size = payload_size(reply.payload)
        try:
            accept(self.cfg, self.records, request_id, source, reply.payload, generation)
        except ApiError:
            self.stats.report(key, peer, "error", size, started)  # it arrived, unusable
            raise
        self.stats.report(key, peer, "ok", size, started)

    async def _pull(
        self, request_id: str, remote: RemotePrefill, key: StatsKey | None, started: float
    ) -> PullReply:
        pull = Pull(remote.transfer_id, remote.engine_id, remote.block_ids, str(self.cfg.kv))
        try:
            return await pull_kv(self.ctx, str(remote.kv), pull, self.cfg.kv_timeout_s)
        except TimeoutError:
            reason, why = "timeout", f"no answer within {self.cfg.kv_timeout_s}s"
        except zmq.ZMQError as err:
            reason, why = "pull_error", f"ZMQ error {err}"
        except WireError as err:
            reason, why = "bad_reply", f"bad answer: {err}"
        self.stats.failed(key, str(remote.kv), reason, 0, started)
        raise kv_failure(
            self.records,
            request_id,
            reason,
            f"fake decode {self.cfg.kv}: cannot read {remote.describe()} for request "
            f"{request_id}: {why}",
        )
