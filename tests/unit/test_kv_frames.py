"""The TCP frame prefix (`kv_wire`) and the receive buffer's admission check, asked before a
payload is read (`TransferBuffer.admit`)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.vllm_side.kv_buffer import Loss, Transfer, TransferBuffer
from pdproxy.vllm_side.kv_wire import (
    MAX_HEADER_BYTES,
    MAX_PAYLOAD_BYTES,
    PREFIX_BYTES,
    LayerHeader,
    WireError,
    decode_prefix,
    frame_prefix,
)


def header(key: str = "k", layer: int = 0, layers: int = 2, tokens: int = 4) -> LayerHeader:
    return LayerHeader(key, layer, layers, 0, 1, (2, tokens, 1, 8), "float32", (0, 1), "p:1")


# -- the prefix ------------------------------------------------------------------------------


@settings(max_examples=100)
@given(st.integers(1, MAX_HEADER_BYTES), st.integers(0, MAX_PAYLOAD_BYTES))
def test_a_prefix_reads_back(header_bytes: int, payload_bytes: int) -> None:
    prefix = frame_prefix(header_bytes, payload_bytes)
    assert len(prefix) == PREFIX_BYTES
    assert decode_prefix(prefix) == (header_bytes, payload_bytes)
    assert decode_prefix(memoryview(bytearray(prefix))) == (header_bytes, payload_bytes)


@pytest.mark.parametrize(
    "prefix",
    [
        b"GET / HTTP/1.1\r\n",
        b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f" + bytes(6),  # a ZMTP greeting
        frame_prefix(1, 0).replace(b"PDKV", b"PDKX"),
        frame_prefix(1, 0)[:4] + (0).to_bytes(4, "big") + bytes(8),  # no header
        frame_prefix(1, 0)[:4] + (MAX_HEADER_BYTES + 1).to_bytes(4, "big") + bytes(8),
        frame_prefix(1, 0)[:8] + (MAX_PAYLOAD_BYTES + 1).to_bytes(8, "big"),
    ],
)
def test_a_stream_that_is_not_ours_is_refused(prefix: bytes) -> None:
    with pytest.raises(WireError):
        decode_prefix(prefix)


# -- admission -------------------------------------------------------------------------------


def test_admit_checks_without_keeping_anything() -> None:
    h = header()
    buffer = TransferBuffer(max_bytes=h.payload_bytes * 2, ttl=5.0)
    assert buffer.admit(h, h.payload_bytes) is None
    assert buffer.size == 0 and buffer.partial("k") is None
    assert buffer.add(h, bytes(h.payload_bytes), 0.0) is None
    assert buffer.admit(header(layer=0), h.payload_bytes) is None  # a repeat: nothing to count


def test_bytes_being_received_count_against_the_cap() -> None:
    h = header()
    buffer = TransferBuffer(max_bytes=h.payload_bytes * 2, ttl=5.0)
    assert buffer.admit(header("a"), h.payload_bytes, pending=h.payload_bytes) is None
    refused = buffer.admit(header("b"), h.payload_bytes, pending=h.payload_bytes * 2)
    assert refused is Loss.OVER_CAPACITY
    assert buffer.take("b") is Loss.OVER_CAPACITY  # given up on, as `add` would have
    assert buffer.add(header("b", 1), bytes(h.payload_bytes), 0.0) is Loss.OVER_CAPACITY


def test_a_frame_larger_than_the_cap_is_refused_before_it_is_read() -> None:
    h = header(tokens=64)
    buffer = TransferBuffer(max_bytes=h.payload_bytes - 1, ttl=5.0)
    assert buffer.admit(h, h.payload_bytes) is Loss.OVER_CAPACITY
    assert buffer.size == 0


def test_admit_knows_lost_and_inconsistent_transfers() -> None:
    h = header()
    buffer = TransferBuffer(max_bytes=10_000, ttl=5.0)
    buffer.forget("gone")
    assert buffer.admit(header("gone"), h.payload_bytes) is Loss.EXPIRED
    assert buffer.admit(header("short"), h.payload_bytes - 1) is Loss.INCONSISTENT
    buffer.add(header("x"), bytes(h.payload_bytes), 0.0)
    assert buffer.admit(header("x", 1, layers=3), h.payload_bytes) is Loss.INCONSISTENT
    assert buffer.size == 0 and buffer.take("x") is Loss.INCONSISTENT


def test_admitted_frames_then_added_make_a_whole_transfer() -> None:
    h = header()
    buffer = TransferBuffer(max_bytes=10_000, ttl=5.0)
    for layer in (0, 1):
        assert buffer.admit(header(layer=layer), h.payload_bytes) is None
        assert buffer.add(header(layer=layer), bytearray(h.payload_bytes), 0.0) is None
    taken = buffer.take("k")
    assert isinstance(taken, Transfer) and taken.complete and buffer.size == 0
