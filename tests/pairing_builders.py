"""Instances with a KV geometry, for the pure pairing tests."""

from __future__ import annotations

from pdproxy.base.roles import Role
from pdproxy.ids import Address
from pdproxy.registry.messages import Connector, Geometry
from pdproxy.registry.table import Instance, Source

P2P, NIXL, PDPROXY = Connector.P2P_NCCL, Connector.NIXL, Connector.PDPROXY


def geo(
    tp: int = 2,
    *,
    block: int = 16,
    heads: int = 8,
    layers: int = 32,
    dim: int = 128,
    dtype: str = "bfloat16",
    layout: str | None = "HND",
    mla: bool = False,
) -> Geometry:
    return Geometry(tp, block, layers, heads, dim, dtype, mla, layout)


def _instance(
    role: Role,
    address: Address,
    zmq_address: Address,
    geometry: Geometry | None,
    connector: Connector | None,
    model: str | None,
) -> Instance:
    # Nothing announced but addresses: what stock vLLM's v0 ping gives.
    v0 = geometry is None and connector is None and model is None
    return Instance(
        role,
        address,
        zmq_address,
        Source.V0 if v0 else Source.V1,
        model=model,
        connector=connector,
        geometry=geometry,
    )


def pre(
    n: int,
    geometry: Geometry | None = None,
    connector: Connector | None = P2P,
    model: str | None = "m",
    zmq_port: int = 21001,
) -> Instance:
    """Prefill n: http 10.0.0.n:8100, KV 10.0.0.n:zmq_port."""
    host = f"10.0.0.{n}"
    return _instance(
        Role.PREFILL, Address(host, 8100), Address(host, zmq_port), geometry, connector, model
    )


def dec(
    n: int,
    geometry: Geometry | None = None,
    connector: Connector | None = P2P,
    model: str | None = "m",
) -> Instance:
    """Decode n: http 10.0.1.n:8200, KV 10.0.1.n:22001."""
    host = f"10.0.1.{n}"
    return _instance(
        Role.DECODE, Address(host, 8200), Address(host, 22001), geometry, connector, model
    )
