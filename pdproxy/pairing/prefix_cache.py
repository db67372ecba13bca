"""Which prefill instances probably hold a prompt prefix in their cache. Pure, bounded.

The proxy cannot see vLLM's prefix caches, but it chose every prefill: a prefix it sent to an
instance recently is probably still cached there. Prefixes are identified by hashes of the
prompt's leading windows (256, 512, 1,024 ... tokens, see RequestFeatures.prefix_windows), so
the longest window an instance was sent tells how much of a new prompt it can skip.

Counting that skipped part as no work matters: with every system prompt cached everywhere, a
request's real prefill work is its user turn, 5-10x less than its prompt, and balancing by
whole prompts balanced the wrong thing (docs/performance.md, "Pairing decisions").
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pdproxy.ids import Address
from pdproxy.pairing.features import PrefixWindow

# Prefix hashes remembered (least recently used forgotten first), and instances remembered per
# prefix (the most recent ones): a few MB at most, whatever the traffic.
MAX_PREFIXES = 16_384
MAX_HOLDERS = 16


class PrefixCache:
    def __init__(self, max_prefixes: int = MAX_PREFIXES, max_holders: int = MAX_HOLDERS) -> None:
        if max_prefixes < 1 or max_holders < 1:
            raise ValueError("max_prefixes and max_holders must be at least 1")
        self._max_prefixes = max_prefixes
        self._max_holders = max_holders
        self._holders: OrderedDict[int, dict[Address, None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def cached_tokens(self, windows: Sequence[PrefixWindow], address: Address) -> int:
        """How many leading tokens `address` probably holds: its longest window sent there."""
        holders = self._holders
        for window in reversed(windows):
            held = holders.get(window.key)
            if held is not None and address in held:
                return window.tokens
        return 0

    def record(self, windows: Sequence[PrefixWindow], address: Address) -> None:
        """`address` is about to prefill a prompt with these windows."""
        holders = self._holders
        for window in windows:
            held = holders.get(window.key)
            if held is None:
                held = holders[window.key] = {}
            else:
                holders.move_to_end(window.key)
                held.pop(address, None)
            held[address] = None  # most recent last
            if len(held) > self._max_holders:
                del held[next(iter(held))]
        while len(holders) > self._max_prefixes:
            holders.popitem(last=False)
