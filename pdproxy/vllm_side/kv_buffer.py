"""What a decode rank received and nobody has claimed yet. Pure: `now` is passed in.

KV usually arrives before the decode leg does (the prefill pushes it while the proxy is still
reading the prefill's answer), so it waits here. Bounded twice: a transfer nobody claims within
`ttl` is dropped, and past `max_bytes` buffered a new transfer is refused whole rather than
evicting one a request may be about to claim. A dropped or refused key is remembered (bounded)
so the request that comes for it fails at once instead of waiting for its timeout.

The cap counts payload bytes. A transport that reads payloads into memory of its own asks
`admit` before it reads one, passing what it is still receiving, so a frame that would be
refused is never read into memory and frames being received count against the cap as well.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum

from pdproxy.vllm_side.kv_wire import LayerHeader

_REMEMBERED_LOSSES = 4096

# A frame's payload as the transport hands it over: zero-copy transports give a memoryview of
# their own receive buffer, which then lives as long as the frame is held here.
Payload = bytes | bytearray | memoryview


class Loss(StrEnum):
    EXPIRED = "expired"  # nobody claimed it within the TTL
    OVER_CAPACITY = "over_capacity"  # the buffer was full when it arrived
    INCONSISTENT = "inconsistent"  # frames of one key disagree (layers, reads, sizes)


@dataclass(slots=True)
class Transfer:
    key: str
    layers: int
    reads: int
    first_at: float
    last_at: float = 0.0
    frames: dict[tuple[int, int], tuple[LayerHeader, Payload]] = field(default_factory=dict)
    size: int = 0

    @property
    def complete(self) -> bool:
        return len(self.frames) == self.layers * self.reads

    @property
    def senders(self) -> set[str]:
        return {header.sender for header, _ in self.frames.values()}


class TransferBuffer:
    def __init__(self, max_bytes: int, ttl: float) -> None:
        if max_bytes < 1 or ttl <= 0:
            raise ValueError("max_bytes and ttl must be positive")
        self._max_bytes = max_bytes
        self._ttl = ttl
        self._transfers: dict[str, Transfer] = {}
        self._losses: OrderedDict[str, Loss] = OrderedDict()
        self.size = 0

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    def admit(self, header: LayerHeader, size: int, pending: int = 0) -> Loss | None:
        """Whether a frame of `size` payload bytes would be kept, asked before its payload is
        read: a Loss (and the transfer given up on, as `add` would) when it would not. `pending`
        counts bytes being received that are not here yet, so they count against the cap too."""
        return self._check(header, size, pending)

    def add(self, header: LayerHeader, payload: Payload, now: float) -> Loss | None:
        """Keep one frame; a Loss when the frame's whole transfer was given up on."""
        size = payload.nbytes if isinstance(payload, memoryview) else len(payload)
        loss = self._check(header, size, 0)
        if loss is not None:
            return loss
        transfer = self._transfers.get(header.key)
        if transfer is None:
            transfer = self._transfers[header.key] = Transfer(
                header.key, header.layers, header.reads, now
            )
        slot = (header.layer, header.read)
        if slot in transfer.frames:
            return None  # a repeat: the first copy stands
        transfer.frames[slot] = (header, payload)
        transfer.size += size
        transfer.last_at = now
        self.size += size
        return None

    def _check(self, header: LayerHeader, size: int, pending: int) -> Loss | None:
        if header.key in self._losses:
            return self._losses[header.key]
        if size != header.payload_bytes:
            return self._lose(header.key, Loss.INCONSISTENT)
        transfer = self._transfers.get(header.key)
        if transfer is not None:
            if (transfer.layers, transfer.reads) != (header.layers, header.reads):
                return self._lose(header.key, Loss.INCONSISTENT)
            if (header.layer, header.read) in transfer.frames:
                return None  # a repeat: `add` keeps the first copy, nothing to count
        if self.size + pending + size > self._max_bytes:
            return self._lose(header.key, Loss.OVER_CAPACITY)
        return None

    def take(self, key: str) -> Transfer | Loss | None:
        """The whole transfer (removed), what became of it, or None: not all here yet."""
        loss = self._losses.get(key)
        if loss is not None:
            return loss
        transfer = self._transfers.get(key)
        if transfer is None or not transfer.complete:
            return None
        del self._transfers[key]
        self.size -= transfer.size
        return transfer

    def forget(self, key: str) -> None:
        """The request gave up waiting: drop whatever arrived, now or later."""
        self._lose(key, Loss.EXPIRED)

    def expire(self, now: float) -> list[str]:
        """Drop transfers nobody claimed within the TTL (oldest first)."""
        stale = [k for k, t in self._transfers.items() if now - t.first_at >= self._ttl]
        for key in stale:
            self._lose(key, Loss.EXPIRED)
        return stale

    def partial(self, key: str) -> Transfer | None:
        """What arrived so far of an incomplete transfer (for errors and statistics)."""
        return self._transfers.get(key)

    def _lose(self, key: str, loss: Loss) -> Loss:
        transfer = self._transfers.pop(key, None)
        if transfer is not None:
            self.size -= transfer.size
        self._losses[key] = loss
        self._losses.move_to_end(key)
        while len(self._losses) > _REMEMBERED_LOSSES:
            self._losses.popitem(last=False)
        return loss
