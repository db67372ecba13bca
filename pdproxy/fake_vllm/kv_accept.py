"""A decode's last word on KV it received, pushed or pulled: does it fit this worker's cache
(kv_compat), and was it computed for this request's prompt? Failures are loud: a kv_failed
event and an HTTP 500 naming both sides."""

from __future__ import annotations

from typing import Any

from pdproxy.fake_vllm.config import WorkerConfig
from pdproxy.fake_vllm.generation import Generation
from pdproxy.fake_vllm.http_json import ApiError
from pdproxy.fake_vllm.kv_compat import incompatibility
from pdproxy.fake_vllm.kv_payload import KvPayload, prompt_digest
from pdproxy.fake_vllm.records import Records


def kv_failure(
    records: Records, request_id: str, reason: str, message: str, **entry: Any
) -> ApiError:
    """Record the failure; the caller raises the returned 500, which names the reason too."""
    records.kv_failed(reason, request_id=request_id, **entry)
    return ApiError(500, f"{message} [kv_failed: {reason}]")


def accept(
    cfg: WorkerConfig,
    records: Records,
    request_id: str,
    source: str,
    payload: KvPayload,
    generation: Generation,
) -> None:
    """Raises the 500 unless `payload` (from the prefill described by `source`) is usable."""
    problem = incompatibility(payload.connector, payload.geometry, cfg.connector, cfg.geometry)
    if problem is not None:
        raise kv_failure(
            records,
            request_id,
            "geometry_mismatch",
            f"fake decode {cfg.kv}: incompatible KV for request {request_id} from {source}: "
            f"{problem}",
            detail=problem,
        )
    # pdproxy's prefill splits heads for the decode TP the proxy told it, its own if none.
    told = payload.geometry.tp_size if payload.decode_tp is None else payload.decode_tp
    if cfg.connector == "pdproxy" and told != cfg.geometry.tp_size:
        raise kv_failure(
            records,
            request_id,
            "decode_tp_mismatch",
            f"fake decode {cfg.kv}: KV for request {request_id} from {source} was split for "
            f"decode tp {told}, this decode has tp {cfg.geometry.tp_size}",
        )
    if payload.digest != prompt_digest(generation):
        raise kv_failure(
            records,
            request_id,
            "payload_mismatch",
            f"fake decode {cfg.kv}: KV for request {request_id} from {source} was computed "
            "for a different prompt",
        )
    records.add("kv_ok", request_id)
