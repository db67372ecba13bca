"""The two interfaces a KV transport implements, so the connector does not care which one moves
its frames: `kv_tcp` (plain TCP, host memory) today; one over NCCL or RDMA for GPU tensors can
take its place.

A sender takes frames from the forward pass and moves them on a thread of its own, telling the
connector of each frame once it left or was given up on; a receiver keeps what arrived in a
`TransferBuffer` until the consumer takes it. Every wait inside a transport is bounded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from pdproxy.vllm_side.kv_buffer import Loss, Transfer
from pdproxy.vllm_side.kv_wire import LayerHeader

# Told of each frame once it left (True) or was given up on (False).
SentCallback = Callable[[LayerHeader, bool], None]


class KvSender(Protocol):
    def send(self, address: str, header: LayerHeader, payload: memoryview) -> bool:
        """Enqueue one frame toward `address` (host:port); False (nothing queued) when full."""
        ...

    def close(self) -> None: ...


class KvReceiver(Protocol):
    def take(self, key: str) -> Transfer | Loss | None:
        """A finished (or lost) transfer, handed over once; None while it is incomplete."""
        ...

    def forget(self, key: str) -> None: ...

    def close(self) -> None: ...
