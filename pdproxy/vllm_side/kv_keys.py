"""Which KV transfer an engine request belongs to. Pure.

vLLM (>= 0.14) appends a random 8-hex suffix to every engine request id, a different one on the
prefill and on the decode instance, which is why stock P2pNcclConnector's keys stop matching
(vLLM issue #42839). Both instances see the same X-Request-Id, so the key is the engine id
without that suffix: `cmpl-{X-Request-Id}-{prompt index}` for completions,
`chatcmpl-{X-Request-Id}` for chat. It carries the tag's 32-hex uuid, and the prompt index
keeps the prompts of one batched completion apart.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pdproxy.ids import Address, parse_request_id

_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$")
_INDEX = re.compile(r"-(\d{1,6})$")


@dataclass(frozen=True, slots=True)
class TransferKey:
    key: str  # identical on both instances
    uid: str  # the tag's 32 lowercase hex
    index: str  # the prompt index of a batched completion, "" for chat
    prefill: Address  # the prefill's KV (zmq) address, rank 0
    decode: Address  # the decode's KV (zmq) address, rank 0

    @property
    def stats_id(self) -> str:
        """How the proxy's statistics name this transfer."""
        return f"{self.uid}-{self.index or 'chat'}"


def transfer_key(engine_id: str, external_id: str | None = None) -> TransferKey | None:
    """The transfer of a tagged request, or None: an untagged request is computed locally."""
    base = external_id if external_id else _RANDOM_SUFFIX.sub("", engine_id)
    tagged = parse_request_id(base)
    if tagged is None:
        return None
    tail = base[base.index(tagged.uid) + len(tagged.uid) :]
    index = _INDEX.fullmatch(tail)
    return TransferKey(base, tagged.uid, index[1] if index else "", tagged.prefill, tagged.decode)
