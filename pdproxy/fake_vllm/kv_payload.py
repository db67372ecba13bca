"""What a fake prefill "computes" for a request: a digest of the prompt, plus the connector and
geometry its KV cache has, so a decode can tell both whose prompt and what shape it received.
A pdproxy-connector prefill also says which decode TP size the proxy told it to send for (the
real connector splits heads by it), so a decode can tell whether the proxy said the truth."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any

from pdproxy.fake_vllm.config import Geometry, WorkerConfig
from pdproxy.fake_vllm.generation import Generation

DIGEST_BYTES = 32  # sha256
GEOMETRY_TYPES: dict[str, type] = {
    "tp_size": int,
    "block_size": int,
    "num_layers": int,
    "num_kv_heads": int,
    "head_dim": int,
    "kv_dtype": str,
    "is_mla": bool,
    "kv_layout": str,
}


class PayloadError(ValueError):
    """A KV payload on the wire is not what a fake prefill sends."""


@dataclass(frozen=True, slots=True)
class KvPayload:
    digest: bytes
    connector: str
    geometry: Geometry
    decode_tp: int | None = None  # pdproxy: the decode TP size the prefill was told

    def as_map(self) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "connector": self.connector,
            "geometry": asdict(self.geometry),
            "decode_tp": self.decode_tp,
        }


def prompt_digest(generation: Generation) -> bytes:
    return hashlib.sha256("\x00".join(p.text for p in generation.prompts).encode()).digest()


def compute_payload(
    cfg: WorkerConfig, generation: Generation, decode_tp: int | None = None
) -> KvPayload:
    return KvPayload(prompt_digest(generation), cfg.connector, cfg.geometry, decode_tp)


def told_decode_tp(params: Any) -> int | None:
    """The decode TP size pdproxy put in a prefill leg's kv_transfer_params, if any."""
    ours = params.get("pdproxy") if isinstance(params, dict) else None
    size = ours.get("decode_tp_size") if isinstance(ours, dict) else None
    return size if isinstance(size, int) and not isinstance(size, bool) and size >= 1 else None


def geometry_from_map(value: Any) -> Geometry:
    if not isinstance(value, dict) or set(value) != set(GEOMETRY_TYPES):
        raise PayloadError(f"geometry must be a map of exactly {sorted(GEOMETRY_TYPES)}")
    for name, kind in GEOMETRY_TYPES.items():
        item = value[name]
        if kind is int:
            # bool is an int subclass: an is_mla=True must not pass for tp_size=1.
            valid = isinstance(item, int) and not isinstance(item, bool) and item >= 1
        else:
            valid = isinstance(item, kind)
        if not valid:
            raise PayloadError(f"geometry {name} must be a {kind.__name__}, got {item!r}")
    return Geometry(**value)


def payload_from_map(value: Any) -> KvPayload:
    """Raises PayloadError unless `value` is exactly what KvPayload.as_map makes."""
    if not isinstance(value, dict) or set(value) != {
        "digest",
        "connector",
        "geometry",
        "decode_tp",
    }:
        raise PayloadError("a KV payload is a map of digest, connector, geometry and decode_tp")
    digest, connector, decode_tp = value["digest"], value["connector"], value["decode_tp"]
    if decode_tp is not None and told_decode_tp({"pdproxy": {"decode_tp_size": decode_tp}}) is None:
        raise PayloadError(f"decode_tp must be a positive int or null, got {decode_tp!r}")
    if not isinstance(digest, bytes) or len(digest) != DIGEST_BYTES:
        raise PayloadError(f"digest must be {DIGEST_BYTES} bytes")
    if not isinstance(connector, str):
        raise PayloadError("connector must be a string")
    return KvPayload(digest, connector, geometry_from_map(value["geometry"]), decode_tp)
