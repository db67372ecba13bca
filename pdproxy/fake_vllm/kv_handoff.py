"""What happens before a request's first token: compute the prompt, or hand its KV over.

The connector picks the flow. p2p_nccl: the request id's tag decides (kv_push_flow). nixl and
pdproxy: kv_transfer_params decide and the tag is only a label (kv_pull_flow); mooncake too,
with the proxy's transfer id and the prefill's bootstrap server (kv_mooncake), and nixl_push,
whose decode registers with the prefill it names, which writes the KV into it (kv_nixl_push).
A decode asked
for no KV computes the prompt itself (conditional disaggregation: short prompts skip the
prefill) and says so with a computed_locally event.
"""

from __future__ import annotations

from typing import Any

from pdproxy.base.roles import Role
from pdproxy.fake_vllm.asyncio_helpers import sleep
from pdproxy.fake_vllm.config import WorkerConfig
from pdproxy.fake_vllm.generation import Generation
from pdproxy.fake_vllm.kv_accept import kv_failure
from pdproxy.fake_vllm.kv_nixl_push import NixlPushFlow
from pdproxy.fake_vllm.kv_params import ParamsError, leg
from pdproxy.fake_vllm.kv_payload import told_decode_tp
from pdproxy.fake_vllm.kv_pull_flow import PullFlow
from pdproxy.fake_vllm.kv_push_flow import PushFlow
from pdproxy.fake_vllm.records import Records, stamp


class KvHandoff:
    def __init__(
        self,
        cfg: WorkerConfig,
        records: Records,
        push: PushFlow,
        pull: PullFlow,
        nixl_push: NixlPushFlow,
    ) -> None:
        self.cfg = cfg
        self.records = records
        self.push = push
        self.pull = pull
        self.nixl_push = nixl_push

    async def before_first_token(
        self,
        request_id: str,
        header_id: str | None,
        params: dict[str, Any] | None,
        generation: Generation,
    ) -> dict[str, Any] | None:
        """Raises ApiError on failure; returns the kv_transfer_params a nixl/pdproxy prefill
        answers with, if it holds KV for a remote decode."""
        if self.cfg.pulls_kv:
            return await self._by_params(request_id, header_id, params, generation)
        await self._by_request_id(header_id, request_id, params, generation)
        return None

    async def _by_request_id(
        self,
        header_id: str | None,
        request_id: str,
        params: dict[str, Any] | None,
        generation: Generation,
    ) -> None:
        if self.cfg.role is Role.PREFILL:
            await sleep(self.cfg.prefill_latency_s)
            decode = self.push.decode_address(header_id, generation.unindexed)
            if header_id is not None and decode is not None:
                told = told_decode_tp(params) if self.cfg.connector == "pdproxy" else None
                await self.push.push(header_id, decode, generation, told)
            return
        tagged = self.push.prefill_address(header_id, generation.unindexed)
        if header_id is not None and tagged is not None:
            await self.push.await_kv(header_id, *tagged, generation)
        else:
            await self._compute_locally(request_id)

    async def _by_params(
        self,
        request_id: str,
        header_id: str | None,
        params: dict[str, Any] | None,
        generation: Generation,
    ) -> dict[str, Any] | None:
        try:
            asked = leg(params)
        except ParamsError as err:
            raise self._failure(request_id, "bad_params", f"kv_transfer_params: {err}") from None
        if self.cfg.role is Role.PREFILL:
            if asked == "remote_prefill":
                raise self._failure(
                    request_id, "wrong_role", "asked to decode (do_remote_prefill) on a prefill"
                )
            await sleep(self.cfg.prefill_latency_s)
            if asked == "remote_decode" and self.cfg.connector == "nixl_push":
                return await self.nixl_push.finished(header_id or request_id, generation)
            if asked == "remote_decode" and self.cfg.connector == "mooncake":
                assert params is not None
                self.pull.hold_mooncake(request_id, params, generation)
            elif asked == "remote_decode":
                return self.pull.hold(request_id, header_id, generation)
            return None
        if asked == "remote_decode":
            raise self._failure(
                request_id, "wrong_role", "asked to prefill (do_remote_decode) on a decode"
            )
        if asked == "remote_prefill" and self.cfg.connector == "nixl_push":
            assert params is not None
            try:
                await self.nixl_push.receive(request_id, header_id, params, generation)
            except ParamsError as err:
                raise self._failure(
                    request_id, "bad_params", f"kv_transfer_params: {err}"
                ) from None
        elif asked == "remote_prefill" and self.cfg.connector == "mooncake":
            assert params is not None
            await self.pull.read_mooncake(request_id, params, generation)
        elif asked == "remote_prefill":
            assert params is not None
            await self.pull.read(request_id, params, generation)
        else:
            await self._compute_locally(request_id)
        return None

    async def _compute_locally(self, request_id: str) -> None:
        self.records.add("computed_locally", {"request_id": request_id, **stamp()})
        await sleep(self.cfg.prefill_latency_s)

    def _failure(self, request_id: str, reason: str, what: str) -> Exception:
        cfg = self.cfg
        message = f"fake {cfg.role} {cfg.kv} ({cfg.connector}): request {request_id}: {what}"
        return kv_failure(self.records, request_id, reason, message)
