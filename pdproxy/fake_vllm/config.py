"""What one fake worker is: its role, addresses, model, latencies, connector and geometry."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Literal

from pdproxy.base.endpoints import Endpoint
from pdproxy.base.roles import Role
from pdproxy.ids import Address

ConnectorKind = Literal["p2p_nccl", "nixl", "pdproxy", "mooncake", "nixl_push"]
CONNECTOR_KINDS: tuple[ConnectorKind, ...] = (
    "p2p_nccl",
    "nixl",
    "pdproxy",
    "mooncake",
    "nixl_push",
)
# Connectors whose decode reads the KV from the prefill named in kv_transfer_params (vLLM's NIXL
# flow). p2p_nccl and pdproxy's own connector push to the decode named in the request id
# (pdproxy with nixl's geometry rules, keyed by the tag's uuid).
# mooncake: the same, with the proxy's transfer id and the prefill's bootstrap server.
# nixl_push: kv_transfer_params decide too, but the decode names the prefill (engine id, side
# channel) and the prefill writes the KV into the decode (kv_nixl_push).
PULL_CONNECTORS: frozenset[str] = frozenset({"nixl", "mooncake", "nixl_push"})
DEFAULT_HTTP_BACKLOG = 2048


@dataclass(frozen=True, slots=True)
class Geometry:
    tp_size: int = 1
    block_size: int = 16
    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 32
    kv_dtype: str = "float16"
    is_mla: bool = False
    kv_layout: str = "NHD"


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    role: Role
    http: Address
    kv: Address
    proxy: Endpoint | None
    announce: Literal["v0", "v1"]
    announce_interval_s: float
    model: str
    token_latency_s: float
    prefill_latency_s: float
    kv_timeout_s: float
    max_model_len: int
    kv_capacity_tokens: int
    connector: ConnectorKind
    geometry: Geometry
    # Signs every v1 message when set (pdproxy.registry.auth); kept out of repr and logs.
    registry_secret: bytes | None = field(default=None, repr=False)
    # The HTTP listener's accept queue. uvicorn's default, which vLLM runs with: aiohttp's own
    # 128 overflows when a proxy opens thousands of connections at once, which vLLM would not.
    http_backlog: int = DEFAULT_HTTP_BACKLOG
    # The engine id its KV connector answers to: fresh per start unless given (vLLM's
    # kv_transfer_config engine_id), so a nixl_push prefill can be declared up front.
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))

    @property
    def pulls_kv(self) -> bool:
        return self.connector in PULL_CONNECTORS
