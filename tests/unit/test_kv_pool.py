"""The receive pool of the TCP KV transport: reuse, the cap, trimming, and never handing out
memory something still refers to."""

from __future__ import annotations

import ctypes

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.vllm_side.kv import wire_from_bytes
from pdproxy.vllm_side.kv_pool import MIN_POOLED_BYTES, ReceivePool, capacity_for

MIB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 1 << 34))
def test_size_classes_waste_at_most_an_eighth_and_are_whole_pages(size: int) -> None:
    capacity = capacity_for(size)
    assert capacity >= size and capacity % 4096 == 0
    if size >= 32 * 1024:  # eight pages and more (the pool serves 256 KiB and more)
        assert capacity <= size * 9 // 8
    else:
        assert capacity - size < 4096
    assert capacity_for(capacity) == capacity  # a class serves its own size exactly


def test_small_payloads_are_not_pooled() -> None:
    pool = ReceivePool(64 * MIB)
    view = pool.lend(MIN_POOLED_BYTES - 1)
    assert view.nbytes == MIN_POOLED_BYTES - 1 and not view.readonly
    assert pool.stats().total_bytes == 0


def test_a_dropped_buffer_is_lent_again_without_a_new_mapping() -> None:
    pool = ReceivePool(64 * MIB)
    first = pool.lend(4 * MIB)
    where = address(first)
    first[:3] = b"abc"
    del first
    again = pool.lend(4 * MIB - 100)  # the same size class
    assert address(again) == where and again.nbytes == 4 * MIB - 100
    stats = pool.stats()
    assert (stats.mapped, stats.reused, stats.total_bytes) == (1, 1, 4 * MIB)


def test_memory_a_tensor_still_uses_is_never_lent_again() -> None:
    pool = ReceivePool(64 * MIB)
    view = pool.lend(MIB)
    tensor = wire_from_bytes(view, (2, MIB // 8), torch.float32)  # in place, as scatter does
    where = tensor.data_ptr()
    del view
    other = pool.lend(MIB)
    elsewhere = address(other)
    assert elsewhere != where and pool.stats().mapped == 2
    del other
    assert pool.reclaim() == 1  # the tensor still holds the first one
    assert address(pool.lend(MIB)) == elsewhere
    del tensor
    assert pool.reclaim() == 2  # the first one, and the one just lent and dropped
    assert pool.stats().mapped == 2


def test_the_cap_bounds_every_mapping_and_idle_ones_make_room() -> None:
    pool = ReceivePool(8 * MIB)
    held = [pool.lend(4 * MIB), pool.lend(4 * MIB)]
    assert pool.stats().total_bytes == 8 * MIB
    beyond = pool.lend(4 * MIB)  # everything lent: memory of its own, not pooled
    assert pool.stats().unpooled == 1 and pool.stats().total_bytes == 8 * MIB
    del beyond, held
    wider = pool.lend(6 * MIB)  # another class: the oldest idle buffers are unmapped for it
    stats = pool.stats()
    assert stats.total_bytes <= 8 * MIB and stats.lent == 1
    assert wider.nbytes == 6 * MIB


def test_a_payload_larger_than_the_cap_gets_its_own_memory() -> None:
    pool = ReceivePool(MIB)
    view = pool.lend(2 * MIB)
    assert view.nbytes == 2 * MIB and pool.stats().total_bytes == 0
    assert pool.stats().unpooled == 1


def test_a_pool_of_zero_bytes_pools_nothing() -> None:
    pool = ReceivePool(0)
    assert pool.lend(4 * MIB).nbytes == 4 * MIB
    assert pool.stats().total_bytes == 0


def test_idle_buffers_are_unmapped_after_the_idle_time() -> None:
    clock = Clock()
    pool = ReceivePool(64 * MIB, idle_s=10.0, clock=clock)
    kept = pool.lend(MIB)
    pool.lend(2 * MIB)  # dropped at once
    pool.reclaim()
    clock.now = 9.0
    assert pool.trim() == 0
    clock.now = 10.0
    assert pool.trim() == 2 * MIB
    assert pool.stats().total_bytes == MIB and pool.stats().lent == 1
    del kept


def test_close_unmaps_idle_buffers_and_leaves_lent_ones_to_their_holders() -> None:
    pool = ReceivePool(64 * MIB)
    held = pool.lend(MIB)
    pool.lend(MIB)
    pool.close()
    assert pool.stats().total_bytes == 0
    held[:4] = b"still"[:4]  # the holder's memory stays valid
    assert bytes(held[:4]) == b"stil"


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        ReceivePool(-1)
    with pytest.raises(ValueError):
        ReceivePool(MIB, idle_s=0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6 * MIB), st.booleans()), max_size=30))
def test_the_pool_never_maps_more_than_its_cap(steps: list[tuple[int, bool]]) -> None:
    pool = ReceivePool(12 * MIB)
    held: list[memoryview] = []
    for size, keep in steps:
        view = pool.lend(size)
        assert view.nbytes == size
        if keep:
            held.append(view)
        elif held:
            held.pop(0)
        assert pool.stats().total_bytes <= 12 * MIB
    pool.close()
