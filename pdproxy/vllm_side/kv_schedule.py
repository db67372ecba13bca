"""The scheduler side of pdproxy's KV connector: which request sends or loads which blocks,
decided step by step from what vLLM's scheduler shows. Pure: plain values in and out, no vLLM,
no torch, no sockets.

A prefill instance sends a tagged request's KV once its prompt is fully computed: in the step
that computes the last prompt tokens, each layer goes out as soon as it is written (the worker
gathers it in `save_kv_layer`). All prompt tokens but the last are sent; the decode instance
computes the last one itself, to sample from it.

A decode instance reports those tokens as loadable, asynchronously, for every tagged request;
once vLLM allocated blocks for them it tells its workers where to write them (`LoadSpec`), and
the workers report the load finished (or failed) through `get_finished`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdproxy.vllm_side.kv_keys import TransferKey

_MAX_TP_SIZE = 1024  # as the registry's geometry bounds


@dataclass(frozen=True, slots=True)
class SendSpec:
    request_id: str
    key: TransferKey
    block_ids: tuple[int, ...]
    num_tokens: int  # tokens 0 .. num_tokens - 1 are sent
    decode_tp: int | None = None  # the decode's TP size; None: the same as this prefill's


@dataclass(frozen=True, slots=True)
class LoadSpec:
    request_id: str
    key: TransferKey
    block_ids: tuple[int, ...]  # all of the request's blocks, in order
    skip_tokens: int  # held already (local prefix cache): whole blocks, not written again
    num_tokens: int  # the transfer's tokens, skipped ones included


def decode_tp_size(kv_transfer_params: Any) -> int | None:
    """The decode's TP size the proxy put in the prefill leg's kv_transfer_params
    (`{"pdproxy": {"decode_tp_size": N}}`), or None when it is absent or not a sane size."""
    if not isinstance(kv_transfer_params, dict):
        return None
    ours = kv_transfer_params.get("pdproxy")
    size = ours.get("decode_tp_size") if isinstance(ours, dict) else None
    if isinstance(size, int) and not isinstance(size, bool) and 1 <= size <= _MAX_TP_SIZE:
        return size
    return None


@dataclass(slots=True)
class _Sending:
    key: TransferKey
    prompt_tokens: int
    decode_tp: int | None = None
    block_ids: list[int] = field(default_factory=list)
    sent: bool = False


class ProducerSchedule:
    def __init__(self) -> None:
        self._requests: dict[str, _Sending] = {}

    def arrived(
        self,
        request_id: str,
        key: TransferKey | None,
        prompt_tokens: int,
        decode_tp: int | None = None,
    ) -> None:
        # A prompt of one token leaves nothing to send: the decode computes it all.
        if key is not None and prompt_tokens > 1:
            self._requests[request_id] = _Sending(key, prompt_tokens, decode_tp)

    def scheduled(
        self,
        request_id: str,
        new_block_ids: list[int] | None,
        replaced: bool,
        computed: int,
        scheduled: int,
    ) -> SendSpec | None:
        """A step scheduled `scheduled` tokens after `computed`; the send, if this step ends
        the prompt. `replaced`: vLLM gave the request a whole new block list (resumed after
        preemption)."""
        sending = self._requests.get(request_id)
        if sending is None or sending.sent:
            return None
        if replaced:
            sending.block_ids = []
        sending.block_ids.extend(new_block_ids or ())
        if computed + scheduled < sending.prompt_tokens:
            return None
        sending.sent = True
        return SendSpec(
            request_id,
            sending.key,
            tuple(sending.block_ids),
            sending.prompt_tokens - 1,
            sending.decode_tp,
        )

    def finished(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._requests)


@dataclass(slots=True)
class _Loading:
    key: TransferKey
    computed: int
    tokens: int
    spec: LoadSpec | None = None


class ConsumerSchedule:
    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._requests: dict[str, _Loading] = {}
        self._new: list[LoadSpec] = []
        self._cancelled: list[str] = []

    def matched(
        self, request_id: str, key: TransferKey | None, prompt_tokens: int, computed: int
    ) -> int:
        """Tokens to load asynchronously beyond `computed`; 0: compute locally."""
        if key is None:
            return 0
        earlier = self._requests.get(request_id)
        if earlier is not None:
            if earlier.spec is not None:
                return 0  # asked again once its load began: nothing more to load
            del self._requests[request_id]  # asked again before blocks were found: anew
        # Local prefix-cache hits are whole blocks; anything else would be overwritten.
        if computed % self._block_size:
            return 0
        loadable = prompt_tokens - 1 - computed
        if loadable <= 0:
            return 0
        self._requests[request_id] = _Loading(key, computed, prompt_tokens - 1)
        return loadable

    def allocated(self, request_id: str, block_ids: list[int], external_tokens: int) -> None:
        loading = self._requests.get(request_id)
        if loading is None or loading.spec is not None or external_tokens == 0:
            return
        spec = LoadSpec(request_id, loading.key, tuple(block_ids), loading.computed, loading.tokens)
        loading.spec = spec
        self._new.append(spec)

    def take(self) -> tuple[list[LoadSpec], list[str]]:
        """Loads to start and loads to abandon, since the last call (once each)."""
        new, cancelled = self._new, self._cancelled
        self._new, self._cancelled = [], []
        return new, cancelled

    def finished(self, request_id: str) -> None:
        """The request ended: its workers stop waiting for its KV if they still do."""
        loading = self._requests.pop(request_id, None)
        if loading is not None and loading.spec is not None:
            self._cancelled.append(request_id)

    def pending(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)
