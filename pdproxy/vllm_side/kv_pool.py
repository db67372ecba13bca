"""Receive memory for large KV payloads, reused from one transfer to the next. Capped in bytes.

Memory a process writes for the first time costs a page fault per 4 KiB page, more CPU than
copying the bytes (docs/performance.md, "KV receive buffers"). This pool hands out receive
buffers from anonymous mappings it keeps, so a transfer lands in pages an earlier transfer
already faulted in, as a plain `recv_into` into a preallocated buffer does.

A buffer is lent as a writable memoryview of exactly the payload's size. It comes back by
itself once nothing refers to its memory any more: the frame dropped by the `TransferBuffer`
(expired, forgotten, refused) or taken and scattered by the consumer, and every tensor made
from it gone. The pool sees that from the mapping's reference count (CPython's: each
memoryview over it, and so each tensor made from one, holds a reference to the mapping), so
memory still in use, however it is held, is never handed out again; there is no release call to
forget, nor one that could hand back memory a tensor still shows. Only the thread that asks for
buffers checks, so a free buffer may wait until the next `lend` or `reclaim`.

Bounded: all mappings together (lent and idle) stay within `max_bytes`; past that, idle buffers
are unmapped oldest first, and when everything is lent a payload gets memory of its own that is
not pooled (and freed as usual when dropped). Idle buffers are unmapped after `idle_s`.
Sizes are rounded up to classes of at most 1/8 more (so a buffer serves other transfers of
about the same length): whole pages, and whole 2 MiB huge pages from 16 MiB on.

Mappings of 2 MiB and more ask for transparent huge pages (`madvise(MADV_HUGEPAGE)` on this
memory alone; nothing process-wide), which makes their first use cheaper where the kernel's THP
mode is `madvise` or `always` (docs/performance.md, "KV receive buffers"). Reused memory costs
the same either way.

Not thread-safe: one receive thread owns a pool.
"""

from __future__ import annotations

import contextlib
import mmap
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

MIN_POOLED_BYTES = 256 * 1024  # smaller payloads come from the ordinary heap: few page faults
_PAGE = mmap.PAGESIZE
_HUGE = 2 * 1024 * 1024
_HUGE_FROM = 16 * 1024 * 1024  # classes from here on are whole huge pages
_THP_FROM = 2 * 1024 * 1024  # mappings from here on ask for transparent huge pages


@dataclass(slots=True, eq=False)  # identity: one slab is one mapping
class _Slab:
    memory: mmap.mmap
    capacity: int
    idle_since: float = 0.0


@dataclass(frozen=True, slots=True)
class PoolStats:
    total_bytes: int  # every mapping the pool holds, lent and idle
    idle_bytes: int
    lent: int  # buffers lent and not yet seen free
    reused: int  # lends served by an idle buffer
    mapped: int  # lends that needed a new mapping
    unpooled: int  # lends past the cap: memory of their own


def capacity_for(size: int) -> int:
    """The size class a payload of `size` bytes is served from: whole pages, and from 32 KiB
    on at most 1/8 more than `size`."""
    size = max(size, _PAGE)
    step = max(1 << (size.bit_length() - 4), _PAGE)
    if size >= _HUGE_FROM:
        step = max(step, _HUGE)
    return -(-size // step) * step


def _references(slab: _Slab) -> int:
    return sys.getrefcount(slab.memory)


class ReceivePool:
    def __init__(
        self,
        max_bytes: int,
        idle_s: float = 60.0,
        *,
        huge_pages: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_bytes < 0 or idle_s <= 0:
            raise ValueError("max_bytes must not be negative and idle_s must be positive")
        self._max_bytes = max_bytes
        self._idle_s = idle_s
        self._huge_pages = huge_pages and hasattr(mmap, "MADV_HUGEPAGE")
        self._clock = clock
        self._idle: dict[int, list[_Slab]] = {}  # by capacity, most recently freed last
        self._lent: list[_Slab] = []
        self._total = 0
        self._reused = self._mapped = self._unpooled = 0
        # References to a mapping nobody else holds, as `_references` counts them (the slab's
        # own and the call's); measured, not assumed.
        probe = _Slab(mmap.mmap(-1, _PAGE), _PAGE)
        self._free_references = _references(probe)
        probe.memory.close()

    def lend(self, size: int) -> memoryview:
        """A writable buffer of exactly `size` bytes."""
        if size < MIN_POOLED_BYTES or self._max_bytes == 0:
            return memoryview(bytearray(size))
        capacity = capacity_for(size)
        slab = self._idle_slab(capacity)
        if slab is None:
            self.reclaim()
            slab = self._idle_slab(capacity)
        if slab is not None:
            self._reused += 1
        else:
            slab = self._map(capacity)
            if slab is None:
                self._unpooled += 1
                return memoryview(bytearray(size))
            self._mapped += 1
        self._lent.append(slab)
        return memoryview(slab.memory)[:size]

    def reclaim(self) -> int:
        """Take back lent buffers nothing refers to any more; how many came back."""
        now = self._clock()
        still: list[_Slab] = []
        back = 0
        for slab in self._lent:
            if _references(slab) > self._free_references:
                still.append(slab)
                continue
            slab.idle_since = now
            self._idle.setdefault(slab.capacity, []).append(slab)
            back += 1
        self._lent = still
        return back

    def trim(self) -> int:
        """Unmap buffers idle for `idle_s` or longer; how many bytes were unmapped."""
        self.reclaim()
        cutoff = self._clock() - self._idle_s
        freed = 0
        for slab in [s for slabs in self._idle.values() for s in slabs if s.idle_since <= cutoff]:
            freed += self._unmap(slab)
        return freed

    def stats(self) -> PoolStats:
        idle = sum(s.capacity for slabs in self._idle.values() for s in slabs)
        return PoolStats(
            self._total, idle, len(self._lent), self._reused, self._mapped, self._unpooled
        )

    def close(self) -> None:
        """Unmap every idle buffer and forget the lent ones (they are freed when dropped)."""
        self.reclaim()
        for slab in [s for slabs in self._idle.values() for s in slabs]:
            self._unmap(slab)
        self._lent = []
        self._total = 0

    def _idle_slab(self, capacity: int) -> _Slab | None:
        # The class itself, else the next two up (at most about a quarter more memory).
        for candidate in sorted(c for c in self._idle if capacity <= c <= capacity * 5 // 4):
            slabs = self._idle[candidate]
            slab = slabs.pop()
            if not slabs:
                del self._idle[candidate]
            return slab
        return None

    def _map(self, capacity: int) -> _Slab | None:
        if capacity > self._max_bytes:
            return None
        if self._total + capacity > self._max_bytes:
            self.reclaim()
            idle = sorted(
                (s for slabs in self._idle.values() for s in slabs), key=lambda s: s.idle_since
            )
            for slab in idle:
                if self._total + capacity <= self._max_bytes:
                    break
                self._unmap(slab)
            if self._total + capacity > self._max_bytes:
                return None
        memory = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if self._huge_pages and capacity >= _THP_FROM:
            with contextlib.suppress(OSError):
                memory.madvise(mmap.MADV_HUGEPAGE)
        self._total += capacity
        return _Slab(memory, capacity)

    def _unmap(self, slab: _Slab) -> int:
        slabs = self._idle.get(slab.capacity, [])
        if slab in slabs:
            slabs.remove(slab)
            if not slabs:
                del self._idle[slab.capacity]
        try:
            slab.memory.close()
        except BufferError:  # a view appeared after all: cannot be, but never unmap one in use
            self._lent.append(slab)
            return 0
        self._total -= slab.capacity
        return slab.capacity
