"""Random hex for request ids and trace ids, from the OS's generator, bought in bulk.

os.urandom is a getrandom() system call, and every request needs two ids (the tag's uid and a
span id): docs/performance.md, "Random ids". The bytes come from the same generator, only
fetched a few kilobytes at a time, so ids stay unpredictable.
"""

from __future__ import annotations

import os

_REFILL_BYTES = 4096


class RandomHex:
    __slots__ = ("_buffer", "_offset")

    def __init__(self) -> None:
        self._buffer = b""
        self._offset = 0

    def hex(self, nbytes: int) -> str:
        """`nbytes` fresh random bytes as 2 * `nbytes` lowercase hex digits."""
        start = self._offset
        end = start + nbytes
        if end > len(self._buffer):
            self._buffer = os.urandom(max(_REFILL_BYTES, nbytes))
            start, end = 0, nbytes
        self._offset = end
        return self._buffer[start:end].hex()
