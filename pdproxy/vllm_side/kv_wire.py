"""The frames of pdproxy's KV transfer: one header (msgpack) and one payload per layer and
read. Pure.

A prefill rank sends, for every layer, one message to every decode rank that reads from it
(`kv.plan_reads`): `[header, payload]`, the payload being the raw bytes of the wire tensor
(kv, tokens, heads, head_dim) that `kv.gather_kv` built. A decode rank has the whole transfer
when it holds `layers x reads` messages for the key.

Over a plain TCP stream (`kv_tcp`) each message is one frame: a fixed prefix (`FRAME_MAGIC`,
the header's length as u32 and the payload's as u64, network order), the header, the payload.
The prefix carries the payload's length apart from the header, so a receiver stays in step with
the stream even when it refuses or cannot read a header.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack

WIRE_VERSION = 1
MAX_KEY_LENGTH = 512
MAX_LAYERS = 4096
MAX_READS = 1024
FRAME_MAGIC = b"PDKV"
MAX_HEADER_BYTES = 8192  # a header is a few hundred bytes (the key is at most 512 characters)
MAX_PAYLOAD_BYTES = 1 << 40  # a sanity bound on the prefix; real caps are the receiver's
_PREFIX = struct.Struct("!4sIQ")
PREFIX_BYTES = _PREFIX.size


class WireError(ValueError):
    """A frame that is not a pdproxy KV frame."""


@dataclass(frozen=True, slots=True)
class LayerHeader:
    key: str  # the transfer (kv_keys.TransferKey.key)
    layer: int  # index in the model's attention layers, 0-based
    layers: int  # how many layers the transfer has
    read: int  # which of this decode rank's reads (a prefill rank's slice of heads)
    reads: int  # how many reads this decode rank expects per layer
    shape: tuple[int, int, int, int]  # the wire tensor: kv, tokens, heads, head_dim
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    heads: tuple[int, int]  # the decode rank's own head range [start, stop) this read fills
    sender: str  # the prefill rank's KV address, for errors and statistics

    @property
    def payload_bytes(self) -> int:
        kv, tokens, heads, dim = self.shape
        return kv * tokens * heads * dim * _ITEM_SIZE[self.dtype]

    def encode(self) -> bytes:
        data: bytes = msgpack.packb(
            [
                WIRE_VERSION,
                self.key,
                self.layer,
                self.layers,
                self.read,
                self.reads,
                list(self.shape),
                self.dtype,
                list(self.heads),
                self.sender,
            ]
        )
        return data


_ITEM_SIZE = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}


def frame_prefix(header_bytes: int, payload_bytes: int) -> bytes:
    """The prefix of one frame on a TCP stream."""
    return _PREFIX.pack(FRAME_MAGIC, header_bytes, payload_bytes)


def decode_prefix(data: bytes | bytearray | memoryview) -> tuple[int, int]:
    """(header bytes, payload bytes) from a frame's prefix (`PREFIX_BYTES` long). A WireError
    means the stream is not pdproxy's, or out of step: the connection cannot be trusted."""
    magic, header_bytes, payload_bytes = _PREFIX.unpack(data)
    if magic != FRAME_MAGIC:
        raise WireError("not a pdproxy KV frame")
    if not 0 < header_bytes <= MAX_HEADER_BYTES:
        raise WireError(f"a header of {header_bytes} bytes")
    if payload_bytes > MAX_PAYLOAD_BYTES:
        raise WireError(f"a payload of {payload_bytes} bytes")
    return header_bytes, payload_bytes


def decode_header(frame: bytes) -> LayerHeader:
    try:
        fields = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise WireError(f"not msgpack: {exc}") from None
    if not isinstance(fields, list) or len(fields) != 10 or fields[0] != WIRE_VERSION:
        raise WireError("not a pdproxy KV header (version 1)")
    _, key, layer, layers, read, reads, shape, dtype, heads, sender = fields
    if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_LENGTH:
        raise WireError("bad key")
    if not (_int(layers, 1, MAX_LAYERS) and _int(layer, 0, layers - 1)):
        raise WireError("bad layer")
    if not (_int(reads, 1, MAX_READS) and _int(read, 0, reads - 1)):
        raise WireError("bad read")
    if not (
        isinstance(shape, list) and len(shape) == 4 and all(_int(n, 0, 1 << 24) for n in shape)
    ):
        raise WireError("bad shape")
    if dtype not in _ITEM_SIZE:
        raise WireError(f"unsupported dtype {dtype!r}")
    if not (
        isinstance(heads, list) and len(heads) == 2 and all(_int(h, 0, 1 << 16) for h in heads)
    ):
        raise WireError("bad heads")
    if heads[1] - heads[0] != shape[2] or not isinstance(sender, str):
        raise WireError("heads do not match the shape")
    return LayerHeader(
        key,
        layer,
        layers,
        read,
        reads,
        (shape[0], shape[1], shape[2], shape[3]),
        dtype,
        (heads[0], heads[1]),
        sender,
    )


def _int(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
