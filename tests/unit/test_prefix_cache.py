"""pdproxy.pairing.prefix_cache: which prefill instances probably hold which prompt prefix.
Pure and bounded.

A window is (tokens, key): the hash of a prompt's first `tokens` tokens. Recording a prompt's
windows for an address marks it a recent holder of every one of their keys; the cached tokens
of a prompt at an address are the tokens of its longest window whose key lists that address.
Keys are forgotten least recently used first (beyond max_prefixes), holders per key oldest
first (beyond max_holders).
"""

from __future__ import annotations

import hashlib
import random

import pytest

from pdproxy.ids import Address
from pdproxy.pairing.features import PrefixWindow
from pdproxy.pairing.prefix_cache import MAX_HOLDERS, MAX_PREFIXES, PrefixCache


def addr(n: int) -> Address:
    return Address(f"10.0.0.{n}", 8100)


def key_of(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "big")


def chain(
    *cuts: int, lead: str = "sys", shared: int | None = None, branch: str = ""
) -> tuple[PrefixWindow, ...]:
    """Windows of a prompt at these cuts (tokens): its first `shared` tokens are the lead common
    to every prompt of `lead` (all of them when None), the rest belong to `branch`."""
    return tuple(
        PrefixWindow(
            cut, key_of(lead, cut) if shared is None or cut <= shared else key_of(lead, branch, cut)
        )
        for cut in cuts
    )


def one(key: int, tokens: int = 256) -> tuple[PrefixWindow, ...]:
    return (PrefixWindow(tokens, key),)


def test_defaults() -> None:
    assert (MAX_PREFIXES, MAX_HOLDERS) == (16_384, 16)
    cache = PrefixCache()
    assert len(cache) == 0


@pytest.mark.parametrize(("max_prefixes", "max_holders"), [(0, 1), (1, 0), (-1, 5), (5, -1)])
def test_bounds_must_be_positive(max_prefixes: int, max_holders: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        PrefixCache(max_prefixes, max_holders)


def test_an_address_never_recorded_holds_nothing() -> None:
    cache = PrefixCache()
    windows = chain(256, 512, 1024)
    assert cache.cached_tokens(windows, addr(1)) == 0
    cache.record(windows, addr(1))
    assert cache.cached_tokens(windows, addr(1)) == 1024
    assert cache.cached_tokens(windows, addr(2)) == 0  # never sent this prompt
    assert cache.cached_tokens((), addr(1)) == 0  # a request without windows
    assert cache.cached_tokens(one(12345), addr(1)) == 0  # another prefix


def test_record_then_cached_tokens() -> None:
    cache = PrefixCache()
    windows = chain(256, 300)  # a 300-token prompt
    cache.record(windows, addr(1))
    assert len(cache) == 2  # one entry per window key
    assert cache.cached_tokens(windows, addr(1)) == 300
    # The same key for a shorter lead: only the first window is held.
    assert cache.cached_tokens(windows[:1], addr(1)) == 256
    cache.record((), addr(1))  # recording no windows changes nothing
    assert len(cache) == 2


def test_the_longest_window_held_wins() -> None:
    cache = PrefixCache()
    # addr 1 was sent a 600-token prompt of the lead, addr 2 a 300-token one, addr 3 a
    # 2,000-token one that shares only its first 512 tokens with the prompt asked about.
    cache.record(chain(256, 512, 600), addr(1))
    cache.record(chain(256, 300), addr(2))
    cache.record(chain(256, 512, 1024, 2000, shared=512, branch="other"), addr(3))
    asked = chain(256, 512, 1024, 1500, shared=1500, branch="asked")
    assert cache.cached_tokens(asked, addr(1)) == 512
    assert cache.cached_tokens(asked, addr(2)) == 256
    assert cache.cached_tokens(asked, addr(3)) == 512
    # Once sent the asked prompt itself, an address holds all of it.
    cache.record(asked, addr(2))
    assert cache.cached_tokens(asked, addr(2)) == 1500
    assert cache.cached_tokens(asked, addr(1)) == 512  # the others are unchanged


def test_the_longest_window_wins_even_if_a_shorter_one_was_forgotten() -> None:
    # Holders are per key: a deeper key listing the address counts even when a shorter key no
    # longer does (it was pushed out by other holders).
    cache = PrefixCache(max_holders=2)
    windows = chain(256, 512)
    cache.record(windows, addr(1))
    cache.record(windows[:1], addr(2))
    cache.record(windows[:1], addr(3))  # the 256 key now lists 2 and 3, not 1
    assert cache.cached_tokens(windows[:1], addr(1)) == 0
    assert cache.cached_tokens(windows, addr(1)) == 512


def test_windows_are_shared_across_prompts() -> None:
    cache = PrefixCache()
    # Two conversations with the same system prompt (its first 512 tokens), different users.
    alice = chain(256, 512, 1024, 1100, shared=512, branch="alice")
    bob = chain(256, 512, 1024, 2048, 3000, shared=512, branch="bob")
    cache.record(alice, addr(1))
    assert cache.cached_tokens(bob, addr(1)) == 512  # the system prompt is held
    assert cache.cached_tokens(alice, addr(1)) == 1100
    cache.record(bob, addr(2))
    assert cache.cached_tokens(alice, addr(2)) == 512
    assert len(cache) == 2 + 2 + 3  # the shared keys are stored once


def test_holders_are_capped_and_the_most_recent_kept() -> None:
    cache = PrefixCache(max_holders=3)
    windows = one(77)
    for n in range(1, 6):
        cache.record(windows, addr(n))
    held = [n for n in range(1, 6) if cache.cached_tokens(windows, addr(n))]
    assert held == [3, 4, 5]
    # Recording an address again makes it the most recent: the oldest goes instead.
    cache.record(windows, addr(3))
    cache.record(windows, addr(6))
    held = [n for n in range(1, 7) if cache.cached_tokens(windows, addr(n))]
    assert held == [3, 5, 6]
    assert len(cache) == 1


def test_the_default_holder_cap_keeps_the_16_most_recent() -> None:
    cache = PrefixCache()
    windows = one(5)
    for n in range(40):
        cache.record(windows, addr(n))
    assert [n for n in range(40) if cache.cached_tokens(windows, addr(n))] == list(range(24, 40))


def test_keys_are_forgotten_least_recently_used_first() -> None:
    cache = PrefixCache(max_prefixes=3)
    a, b, c, d = one(1), one(2), one(3), one(4)
    for windows in (a, b, c):
        cache.record(windows, addr(1))
    assert len(cache) == 3
    cache.record(a, addr(2))  # a is used again (by another address): b is now the oldest
    cache.record(d, addr(1))
    assert len(cache) == 3
    assert cache.cached_tokens(b, addr(1)) == 0  # forgotten
    assert [cache.cached_tokens(w, addr(1)) for w in (a, c, d)] == [256, 256, 256]
    assert cache.cached_tokens(a, addr(2)) == 256
    cache.record(b, addr(1))  # back, pushing out c (the least recently recorded)
    assert cache.cached_tokens(c, addr(1)) == 0
    assert [cache.cached_tokens(w, addr(1)) for w in (a, b, d)] == [256, 256, 256]


def test_looking_up_does_not_refresh_a_key() -> None:
    # Only recording (a prompt being sent) makes a key recent; asking about it does not.
    cache = PrefixCache(max_prefixes=2)
    cache.record(one(1), addr(1))
    cache.record(one(2), addr(1))
    assert cache.cached_tokens(one(1), addr(1)) == 256
    cache.record(one(3), addr(1))
    assert cache.cached_tokens(one(1), addr(1)) == 0
    assert cache.cached_tokens(one(2), addr(1)) == 256


def test_a_prompt_longer_than_the_bound_keeps_its_deepest_windows() -> None:
    cache = PrefixCache(max_prefixes=2)
    windows = chain(256, 512, 1024)
    cache.record(windows, addr(1))
    assert len(cache) == 2
    # The shortest window's key went first; the deepest one still answers.
    assert cache.cached_tokens(windows, addr(1)) == 1024
    assert cache.cached_tokens(windows[:1], addr(1)) == 0


def test_random_histories_match_an_unbounded_model_within_the_bounds() -> None:
    rng = random.Random(11)
    max_prefixes, max_holders = 40, 3
    cache = PrefixCache(max_prefixes, max_holders)
    # The model: per key, its holders oldest first; keys in order of last recording.
    model: dict[int, list[Address]] = {}
    leads = [f"lead{i}" for i in range(12)]
    for _ in range(2000):
        cuts = [256 * 2**j for j in range(rng.randint(1, 4))]
        windows = chain(
            *cuts, lead=rng.choice(leads), shared=rng.choice((256, 512, 4096)), branch="b"
        )
        address = addr(rng.randrange(6))
        probe = addr(rng.randrange(6))
        expected = max((w.tokens for w in windows if probe in model.get(w.key, [])), default=0)
        assert cache.cached_tokens(windows, probe) == expected
        cache.record(windows, address)
        for window in windows:
            holders = model.pop(window.key, [])
            if address in holders:
                holders.remove(address)
            model[window.key] = [*holders, address][-max_holders:]
        while len(model) > max_prefixes:
            del model[next(iter(model))]
        assert len(cache) == len(model)
