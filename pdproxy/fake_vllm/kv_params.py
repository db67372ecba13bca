"""vLLM's `kv_transfer_params` (NixlConnector's fields) as a request carries them and as a
prefill answers them.

A proxy asks a prefill for a remote decode with {"do_remote_decode": true, ...nulls}; the
prefill answers {"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id",
"remote_block_ids", "remote_request_id", "remote_host", "remote_port", "tp_size"} and the proxy
hands that to the decode unchanged. remote_request_id (vLLM >= 0.14) names the prefill's
request, here the key of the held transfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pdproxy.fake_vllm.http_json import ApiError
from pdproxy.ids import Address

Leg = Literal["remote_decode", "remote_prefill"]


class ParamsError(ValueError):
    """kv_transfer_params that no prefill answers; the message says which field."""


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """Where a decode reads its KV from: the prefill's answer, as the decode received it."""

    engine_id: str
    block_ids: tuple[int, ...]
    transfer_id: str
    kv: Address

    def describe(self) -> str:
        return f"transfer {self.transfer_id} of engine {self.engine_id} at {self.kv}"


def request_params(body: dict[str, Any]) -> dict[str, Any] | None:
    """The body's kv_transfer_params; a 400 when present but not an object (as vLLM)."""
    params = body.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise ApiError(400, "kv_transfer_params must be an object or null", "kv_transfer_params")
    return params


def leg(params: dict[str, Any] | None) -> Leg | None:
    """Which side of a remote transfer a request asks this worker to be, if any (vLLM reads
    the flags by truthiness)."""
    if params is None:
        return None
    decode, prefill = bool(params.get("do_remote_decode")), bool(params.get("do_remote_prefill"))
    if decode and prefill:
        raise ParamsError("do_remote_decode and do_remote_prefill are both set")
    if decode:
        return "remote_decode"
    return "remote_prefill" if prefill else None


def field(params: dict[str, Any], name: str, kind: type) -> Any:
    value = params.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ParamsError(f"{name} must be a {kind.__name__}, got {value!r}")
    return value


def remote_prefill(params: dict[str, Any]) -> RemotePrefill:
    block_ids = field(params, "remote_block_ids", list)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in block_ids):
        raise ParamsError("remote_block_ids must be a list of integers")
    host, port = field(params, "remote_host", str), field(params, "remote_port", int)
    if not host or any(c.isspace() for c in host) or not 1 <= port <= 65535:
        raise ParamsError(f"remote_host:remote_port {host!r}:{port} is not a KV address")
    return RemotePrefill(
        engine_id=field(params, "remote_engine_id", str),
        block_ids=tuple(block_ids),
        transfer_id=field(params, "remote_request_id", str),
        kv=Address(host, port),
    )


def prefill_answer(
    engine_id: str, transfer_id: str, block_ids: tuple[int, ...], kv: Address, tp_size: int
) -> dict[str, Any]:
    """The kv_transfer_params a prefill's JSON answer carries, as vLLM's NixlConnector builds."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_block_ids": list(block_ids),
        "remote_request_id": transfer_id,
        "remote_host": kv.host,
        "remote_port": kv.port,
        "tp_size": tp_size,
    }
