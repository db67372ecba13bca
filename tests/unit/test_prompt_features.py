"""pdproxy.proxy.prompt.request_features: size and prefix of an OpenAI body, without a
tokenizer. Pure, and never raises on a JSON object, whatever its fields hold."""

from __future__ import annotations

import hashlib
import itertools
import math
from array import array
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.pairing.features import PrefixWindow, RequestFeatures
from pdproxy.proxy.prompt import (
    CHARS_PER_TOKEN,
    DEFAULT_CHAT_TOKENS,
    DEFAULT_COMPLETION_TOKENS,
    MAX_PREFIX_WINDOWS,
    request_features,
)

# Deterministic and load-tolerant: same examples every run, no deadline, no example database.
PROFILE = settings(derandomize=True, database=None, deadline=None)

PREFIX = 16  # prefix_tokens: 64 characters of text, or 16 token ids


def completion(prompt: Any, prefix_tokens: int = PREFIX, **fields: Any) -> RequestFeatures:
    return request_features({"model": "m", "prompt": prompt, **fields}, "m", False, prefix_tokens)


def chat(messages: Any, prefix_tokens: int = PREFIX, **fields: Any) -> RequestFeatures:
    payload = {"model": "m", "messages": messages, **fields}
    return request_features(payload, "m", True, prefix_tokens)


def user(content: Any, role: str = "user") -> dict[str, Any]:
    return {"role": role, "content": content}


def text(n: int, seed: str = "x") -> str:
    """n characters, distinct per seed from the first character on."""
    base = seed + "abcdefghijklmnopqrstuvwxyz0123456789"
    return (base * (n // len(base) + 1))[:n]


# ---------------------------------------------------------------------------------------------
# Sizes


@pytest.mark.parametrize(
    ("prompt", "tokens"),
    [
        ("", 0),
        ("a", 1),
        ("abcd", 1),
        ("abcde", 2),
        ("x" * 400, 100),
        ("x" * 401, 101),
        ("é" * 8, 2),  # characters, not bytes
    ],
)
def test_text_prompt_is_chars_over_four_rounded_up(prompt: str, tokens: int) -> None:
    assert completion(prompt).prompt_tokens == tokens
    assert completion(prompt).prompt_tokens == math.ceil(len(prompt) / CHARS_PER_TOKEN)


def test_list_of_text_prompts_counts_every_prompt() -> None:
    prompts = ["a" * 40, "b" * 41, "c" * 3]
    tokens = completion(prompts).prompt_tokens
    chars = sum(map(len, prompts))
    # About four characters a token over all of them (separators may count a little).
    assert math.ceil(chars / 4) <= tokens <= math.ceil((chars + len(prompts)) / 4)


@pytest.mark.parametrize(
    ("prompt", "tokens"),
    [
        ([1], 1),
        ([5, 6, 7, 8, 9], 5),
        (list(range(1000)), 1000),
        ([[1, 2, 3], [4, 5]], 5),
        ([[1], [2], [3], []], 3),
    ],
)
def test_token_id_prompts_count_exactly(prompt: list[Any], tokens: int) -> None:
    assert completion(prompt).prompt_tokens == tokens


def test_chat_counts_the_text_of_all_messages() -> None:
    short = chat([user("hi")]).prompt_tokens
    long = chat([user("x" * 4000)]).prompt_tokens
    assert 1000 <= long <= 1010
    assert short < 10
    two = chat([user("x" * 4000, "system"), user("y" * 4000)]).prompt_tokens
    assert 2000 <= two <= 2020


def test_chat_content_parts_count_their_text() -> None:
    parts = [{"type": "text", "text": "x" * 2000}, {"type": "text", "text": "y" * 2000}]
    assert chat([user(parts)]).prompt_tokens == chat([user("x" * 2000 + "y" * 2000)]).prompt_tokens
    with_image = [*parts, {"type": "image_url", "image_url": {"url": "http://example/i.png"}}]
    assert chat([user(with_image)]).prompt_tokens == chat([user(parts)]).prompt_tokens


@pytest.mark.parametrize(
    ("fields", "limit"),
    [
        ({}, DEFAULT_COMPLETION_TOKENS),
        ({"max_tokens": 100}, 100),
        ({"max_tokens": 0}, 0),
        ({"max_completion_tokens": 50}, 50),
        ({"max_completion_tokens": 50, "max_tokens": 100}, 50),  # the newer name wins
        ({"max_completion_tokens": None, "max_tokens": 100}, 100),
        ({"max_completion_tokens": -1, "max_tokens": 100}, 100),
        ({"max_tokens": -5}, DEFAULT_COMPLETION_TOKENS),
        ({"max_tokens": True}, DEFAULT_COMPLETION_TOKENS),  # a bool is no count
        ({"max_tokens": 100.0}, DEFAULT_COMPLETION_TOKENS),
        ({"max_tokens": "100"}, DEFAULT_COMPLETION_TOKENS),
        ({"max_tokens": [100]}, DEFAULT_COMPLETION_TOKENS),
    ],
)
def test_decode_tokens_are_prompt_plus_limit(fields: dict[str, Any], limit: int) -> None:
    features = completion("x" * 40, **fields)
    assert features.prompt_tokens == 10
    assert features.decode_tokens == 10 + limit


def test_chat_default_limit() -> None:
    features = chat([user("x" * 40)])
    assert features.decode_tokens == features.prompt_tokens + DEFAULT_CHAT_TOKENS
    features = chat([user("x" * 40)], max_completion_tokens=7)
    assert features.decode_tokens == features.prompt_tokens + 7
    features = chat([user("x" * 40)], max_tokens=9)
    assert features.decode_tokens == features.prompt_tokens + 9


def test_model_is_taken_from_the_argument() -> None:
    features = request_features({"model": "ignored", "prompt": "hi"}, "served-name", False, 4)
    assert features.model == "served-name"


# ---------------------------------------------------------------------------------------------
# Prefix keys


def test_text_prompts_sharing_the_prefix_share_the_key() -> None:
    lead = text(PREFIX * 4, "L")
    a = completion(lead + "first continuation")
    b = completion(lead + "a different, much longer continuation" * 10)
    assert a.prefix_key is not None
    assert a.prefix_key == b.prefix_key
    assert completion(lead).prefix_key == a.prefix_key  # exactly the prefix


def test_text_prompts_differing_inside_the_prefix_hash_apart() -> None:
    lead = text(PREFIX * 4, "L")
    base = completion(lead + "tail").prefix_key
    for i in (0, 1, PREFIX * 4 - 1):  # first, second and last character of the prefix
        changed = lead[:i] + ("#" if lead[i] != "#" else "$") + lead[i + 1 :]
        assert completion(changed + "tail").prefix_key != base


def test_short_text_prompts_hash_whole() -> None:
    assert completion("hello").prefix_key == completion("hello").prefix_key
    assert completion("hello").prefix_key != completion("hello!").prefix_key


def test_prefix_length_follows_prefix_tokens() -> None:
    a, b = "x" * 40 + "A", "x" * 40 + "B"  # differ at character 40
    assert completion(a, prefix_tokens=10).prefix_key == completion(b, prefix_tokens=10).prefix_key
    assert completion(a, prefix_tokens=11).prefix_key != completion(b, prefix_tokens=11).prefix_key


def test_token_id_prompts_sharing_the_first_ids_share_the_key() -> None:
    lead = list(range(100, 100 + PREFIX))
    a = completion([*lead, 1, 2, 3])
    b = completion([*lead, 9])
    assert a.prefix_key is not None
    assert a.prefix_key == b.prefix_key
    other = completion([*lead[:-1], 7, 1, 2, 3])  # differs at the last id of the prefix
    assert other.prefix_key != a.prefix_key
    # Digits must not run together: [1, 23] is not [12, 3].
    assert completion([1, 23]).prefix_key != completion([12, 3]).prefix_key


def test_batched_prompts_key_on_the_first() -> None:
    lead = text(PREFIX * 4, "B")
    assert completion([lead + "one", "two"]).prefix_key == completion(lead + "x").prefix_key
    ids = list(range(PREFIX))
    assert completion([[*ids, 1], [5]]).prefix_key == completion([*ids, 2]).prefix_key


def test_text_and_token_ids_hash_apart() -> None:
    assert completion("1,2,3").prefix_key != completion([1, 2, 3]).prefix_key
    assert completion("1,2,3", prefix_tokens=1).prefix_key != completion([1]).prefix_key


def test_chat_sharing_a_system_prompt_shares_the_key() -> None:
    system = user(text(400, "S"), "system")
    a = chat([system, user("What is the weather?")])
    b = chat([system, user("Tell me a joke.")])
    assert a.prefix_key is not None
    assert a.prefix_key == b.prefix_key
    other = chat([user(text(400, "T"), "system"), user("What is the weather?")])
    assert other.prefix_key != a.prefix_key


def test_chat_roles_are_part_of_the_prefix() -> None:
    assert chat([user("hello")]).prefix_key != chat([user("hello", "system")]).prefix_key


def test_chat_string_content_and_text_parts_key_alike() -> None:
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}]
    assert chat([user(parts)]) == chat([user("Hello world")])


def test_chat_and_completion_of_the_same_words_do_not_collide() -> None:
    # A chat prompt carries its role; the same words as a completion are another prompt.
    assert chat([user("hello")]).prefix_key != completion("hello").prefix_key


@pytest.mark.parametrize(
    "prompt",
    ["", [], [[]], [[], []], None],
    ids=["empty text", "empty list", "one empty id list", "empty id lists", "missing"],
)
def test_no_prompt_no_prefix_key(prompt: Any) -> None:
    features = completion(prompt)
    assert features.prefix_key is None
    assert features.prompt_tokens == 0
    assert features.decode_tokens == DEFAULT_COMPLETION_TOKENS


def test_prefix_tokens_zero_disables_the_key() -> None:
    assert completion("hello", prefix_tokens=0).prefix_key is None
    assert completion([1, 2, 3], prefix_tokens=0).prefix_key is None
    assert completion("hello", prefix_tokens=0).prompt_tokens == 2


def test_keys_are_stable_64_bit_integers() -> None:
    key = completion("The quick brown fox").prefix_key
    assert key == completion("The quick brown fox").prefix_key
    assert key is not None
    assert 0 <= key < 2**64


def test_many_prompts_rarely_collide() -> None:
    prompts = [f"prompt number {i}: " for i in range(5000)]
    found = {completion(prompt).prefix_key for prompt in prompts}
    assert len(found) == 5000


# ---------------------------------------------------------------------------------------------
# Garbage never raises


@pytest.mark.parametrize(
    "payload",
    [
        {},
        {"prompt": 42},
        {"prompt": {"text": "hi"}},
        {"prompt": [1, "a"]},
        {"prompt": [True, False]},
        {"prompt": [[1, True]]},
        {"prompt": [[1], "a"]},
        {"prompt": [None]},
        {"prompt": ["\ud800 lone surrogate"]},
        {"prompt": "\udfff" * 100},
        {"messages": "hi"},
        {"messages": {"role": "user"}},
        {"messages": ["hi", 3, None]},
        {"messages": [{"role": "user"}]},
        {"messages": [{"content": 5}]},
        {"messages": [{"role": 7, "content": [1, {"text": 5}, {"text": None}, "str"]}]},
        {"messages": [{"role": "user", "content": "\ud800"}]},
        {"max_tokens": {"a": 1}, "max_completion_tokens": float("nan")},
    ],
)
@pytest.mark.parametrize("is_chat", [False, True])
def test_garbage_fields_never_raise(payload: dict[str, Any], is_chat: bool) -> None:
    features = request_features(payload, "m", is_chat, PREFIX)
    assert features.model == "m"
    assert features.prompt_tokens >= 0
    assert features.decode_tokens >= features.prompt_tokens
    assert features.prefix_key is None or 0 <= features.prefix_key < 2**64


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)  # what orjson parses
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(st.characters(exclude_categories=()), max_size=20)  # lone surrogates too
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(
            st.sampled_from(["role", "content", "text", "type", "x"]), inner, max_size=4
        )
    ),
    max_leaves=12,
)


@settings(PROFILE, max_examples=120)
@given(
    payload=st.dictionaries(
        st.sampled_from(["prompt", "messages", "max_tokens", "max_completion_tokens", "other"]),
        json_values,
    ),
    is_chat=st.booleans(),
    prefix_tokens=st.integers(0, 64),
)
def test_random_bodies_never_raise(
    payload: dict[str, Any], is_chat: bool, prefix_tokens: int
) -> None:
    features = request_features(payload, "m", is_chat, prefix_tokens)
    assert features.prompt_tokens >= 0
    assert features.decode_tokens >= features.prompt_tokens
    assert features.prefix_key is None or 0 <= features.prefix_key < 2**64
    if prefix_tokens == 0:
        assert features.prefix_key is None


@settings(PROFILE, max_examples=200)
@given(
    ids=st.lists(st.integers(0, 200_000), max_size=80),
    cut=st.integers(0, 80),
)
def test_token_ids_key_depends_only_on_the_first_prefix_tokens(ids: list[int], cut: int) -> None:
    features = completion(ids)
    assert features.prompt_tokens == len(ids)
    assert (features.prefix_key is None) is (not ids)
    if len(ids) >= PREFIX:
        # Changing or adding anything at or after position PREFIX keeps the key.
        tail_changed = ids[:PREFIX] + [i + 1 for i in ids[PREFIX:]] + [cut]
        assert completion(tail_changed).prefix_key == features.prefix_key
    else:
        # A shorter prompt is all prefix: one more id changes it.
        assert completion([*ids, cut]).prefix_key != features.prefix_key
    if cut < min(len(ids), PREFIX):
        head_changed = [*ids[:cut], ids[cut] + 1, *ids[cut + 1 :]]
        assert completion(head_changed).prefix_key != features.prefix_key


# ---------------------------------------------------------------------------------------------
# Prefix windows
#
# The design, restated: windows cover prefix_tokens, twice that, four times ... tokens, each
# cut at the whole prompt if shorter, until one covers the whole prompt or there are
# MAX_PREFIX_WINDOWS (6) of them. A window's key is an 8-byte blake2b, big-endian, of the lead
# up to its cut: the text's UTF-8 bytes cut at 4 bytes a token (person b"text"), or the token
# ids as 8-byte signed machine words, cut at 8 bytes a token (person b"ids"). Its `tokens` is
# its size, at most the prompt's.


def sizes(prompt_tokens: int, prefix_tokens: int = PREFIX) -> list[int]:
    out: list[int] = []
    size = prefix_tokens
    while prompt_tokens > 0 and prefix_tokens > 0 and len(out) < 6:
        out.append(min(size, prompt_tokens))
        if out[-1] == prompt_tokens:
            break
        size *= 2
    return out


def blake(data: bytes, person: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=person).digest(), "big")


def text_keys(prompt: str, prefix_tokens: int = PREFIX) -> list[int]:
    data = prompt.encode()
    tokens = math.ceil(len(prompt) / CHARS_PER_TOKEN)
    return [blake(data[: size * 4], b"text") for size in sizes(tokens, prefix_tokens)]


def id_keys(ids: list[int], prefix_tokens: int = PREFIX) -> list[int]:
    data = array("q", ids).tobytes()
    return [blake(data[: size * 8], b"ids") for size in sizes(len(ids), prefix_tokens)]


def tokens_of(features: RequestFeatures) -> list[int]:
    return [window.tokens for window in features.prefix_windows]


def keys_of(features: RequestFeatures) -> list[int]:
    return [window.key for window in features.prefix_windows]


def test_at_most_six_windows() -> None:
    assert MAX_PREFIX_WINDOWS == 6
    assert sizes(10_000) == [16, 32, 64, 128, 256, 512]
    assert sizes(300, 256) == [256, 300]
    # Whatever the prompt: long text of several bytes a character, or of ids.
    for prompt in ("é" * 10_000, "日本" * 5000, "x" * 40_000, list(range(10_000))):
        assert tokens_of(completion(prompt)) == [16, 32, 64, 128, 256, 512]
        assert len(completion(prompt, prefix_tokens=256).prefix_windows) <= 6
    assert tokens_of(completion("x" * 40_000, prefix_tokens=256)) == sizes(10_000, 256)


@pytest.mark.parametrize(
    "prompt_tokens", [1, 15, 16, 17, 31, 32, 33, 100, 511, 512, 513, 1000, 10_000]
)
def test_windows_double_up_to_the_prompt_or_six(prompt_tokens: int) -> None:
    expected = sizes(prompt_tokens)
    assert expected[0] == min(PREFIX, prompt_tokens)
    assert all(b == 2 * a for a, b in itertools.pairwise(expected[:-1]))
    as_text = completion(text(prompt_tokens * 4, "T"))
    as_ids = completion(list(range(prompt_tokens)))
    for features in (as_text, as_ids):
        assert features.prompt_tokens == prompt_tokens
        assert tokens_of(features) == expected
        assert features.prefix_windows == tuple(
            PrefixWindow(size, key) for size, key in zip(expected, keys_of(features), strict=True)
        )
        assert len(set(keys_of(features))) == len(expected)  # every cut hashes apart
        assert features.prefix_key == features.prefix_windows[0].key


@pytest.mark.parametrize("chars", [1, 63, 64, 65, 127, 129, 400, 4000])
def test_text_windows_hash_the_lead_up_to_each_cut(chars: int) -> None:
    prompt = text(chars, "K")
    assert keys_of(completion(prompt)) == text_keys(prompt)
    # A partial last token: 65 characters are 17 tokens, the second window all of them.
    if chars == 65:
        assert tokens_of(completion(prompt)) == [16, 17]


@pytest.mark.parametrize("n", [1, 15, 16, 17, 100, 512, 600])
def test_token_id_windows_hash_the_ids_up_to_each_cut(n: int) -> None:
    ids = [7 * i + 100_000 for i in range(n)]
    assert keys_of(completion(ids)) == id_keys(ids)
    # Batches of id lists: the first list's ids, then the next ones', are one lead.
    half = n // 2
    assert keys_of(completion([ids[:half], ids[half:]])) == id_keys(ids)


def test_default_prefix_tokens_share_two_windows_of_a_512_token_lead() -> None:
    # The design's example: prompts sharing their first 512 tokens share the 256 and 512
    # windows, not the 1,024 one.
    lead = text(512 * 4, "S")
    a = completion(lead + text(4000, "a"), prefix_tokens=256)
    b = completion(lead + text(6000, "b"), prefix_tokens=256)
    assert tokens_of(a) == [256, 512, 1024, 1512]
    assert tokens_of(b) == [256, 512, 1024, 2012]
    assert keys_of(a)[:2] == keys_of(b)[:2]
    assert keys_of(a)[2] != keys_of(b)[2]


@pytest.mark.parametrize("diverge", [0, 1, 15, 16, 17, 31, 32, 33, 64, 100, 255, 256, 511, 512])
def test_shared_leads_share_keys_exactly_up_to_the_divergence(diverge: int) -> None:
    """Two 700-token prompts equal in their first `diverge` tokens, different at the next."""
    ids_a = list(range(1000, 1700))
    ids_b = [*ids_a[:diverge], 5, *ids_a[diverge + 1 :]]
    text_a = text(2800, "D")
    text_b = text_a[: 4 * diverge] + "#" + text_a[4 * diverge + 1 :]
    for a, b in ((completion(ids_a), completion(ids_b)), (completion(text_a), completion(text_b))):
        assert tokens_of(a) == tokens_of(b) == [16, 32, 64, 128, 256, 512]
        shared = [ka == kb for ka, kb in zip(keys_of(a), keys_of(b), strict=True)]
        assert shared == [size <= diverge for size in tokens_of(a)]


@pytest.mark.parametrize("char", [63, 64, 65, 127, 128])
def test_text_windows_cut_at_four_characters_a_token(char: int) -> None:
    # Differing at character `char`: the 16-token window (64 characters) and the 32-token one
    # (128) share a key only if the difference lies past their cut.
    base = text(800, "C")
    changed = base[:char] + "#" + base[char + 1 :]
    shared = [
        ka == kb
        for ka, kb in zip(keys_of(completion(base)), keys_of(completion(changed)), strict=True)
    ]
    assert shared[:2] == [char >= 64, char >= 128]
    assert not any(shared[2:])


def test_a_longer_prompt_of_the_same_lead_shares_the_shorter_ones_windows() -> None:
    # A conversation growing: every window of an earlier turn that is not cut short by its end
    # is a window of the later turn.
    turn1 = text(400, "C")  # 100 tokens: 16, 32, 64, 100
    turn2 = turn1 + text(2000, "r")  # 600 tokens: 16 ... 512
    a, b = completion(turn1), completion(turn2)
    assert tokens_of(a) == [16, 32, 64, 100]
    assert tokens_of(b) == [16, 32, 64, 128, 256, 512]
    assert keys_of(a)[:3] == keys_of(b)[:3]
    assert keys_of(a)[3] not in keys_of(b)


def test_nothing_past_the_longest_window_changes_a_key() -> None:
    longest = PREFIX << (MAX_PREFIX_WINDOWS - 1)  # 512 tokens
    ids = list(range(2000))
    changed = [*ids[:longest], *(i + 1 for i in ids[longest:])]
    assert keys_of(completion(ids)) == keys_of(completion(changed))
    last = [*ids[: longest - 1], -1, *ids[longest:]]
    assert keys_of(completion(last))[:-1] == keys_of(completion(ids))[:-1]
    assert keys_of(completion(last))[-1] != keys_of(completion(ids))[-1]
    prompt = text(4 * 2000, "L")
    assert keys_of(completion(prompt)) == keys_of(completion(prompt[: 4 * longest] + "x" * 99))


def test_token_id_and_text_windows_hash_apart_and_cut_by_their_own_units() -> None:
    ids = [1] * 40  # 40 tokens: windows of 16, 32 and 40 ids
    digits = ",".join(["1"] * 40)  # 79 characters, 20 tokens: windows of 16 and 20
    assert tokens_of(completion(ids)) == [16, 32, 40]
    assert tokens_of(completion(digits)) == [16, 20]
    assert not set(keys_of(completion(ids))) & set(keys_of(completion(digits)))
    # The same bytes under the two kinds still hash apart (person b"ids" vs b"text").
    raw = array("q", [0x41414141_41414141] * 2).tobytes().decode()  # "AAAA..." x 16
    assert keys_of(completion(raw, prefix_tokens=4)) != keys_of(
        completion([0x41414141_41414141] * 2, prefix_tokens=2)
    )
    assert keys_of(completion(raw, prefix_tokens=4)) == [blake(raw.encode(), b"text")]


def test_chat_windows_share_a_system_prompt() -> None:
    system = user(text(2048, "S"), "system")  # with its framing, about 515 tokens
    a = chat([system, user("What is the weather?")], prefix_tokens=256)
    b = chat([system, user("Tell me a joke, a long one." * 20)], prefix_tokens=256)
    assert tokens_of(a)[:2] == tokens_of(b)[:2] == [256, 512]
    assert keys_of(a)[:2] == keys_of(b)[:2]
    assert keys_of(a)[2] != keys_of(b)[2]


@pytest.mark.parametrize("prompt", ["hello", "x" * 5000, [1, 2, 3], list(range(5000)), [[1], [2]]])
def test_prefix_tokens_zero_gives_no_windows(prompt: Any) -> None:
    features = completion(prompt, prefix_tokens=0)
    assert features.prefix_windows == ()
    assert features.prefix_key is None
    assert features.prompt_tokens == completion(prompt).prompt_tokens > 0
    assert chat([user("hello")], prefix_tokens=0).prefix_windows == ()


@pytest.mark.parametrize(
    "prompt",
    [
        [1, "a", 3],
        [1, 2.5],
        [1, None],
        [2**63, 1],  # past a signed 64-bit word (orjson parses up to 2**64 - 1)
        [-(2**63) - 1],
        [[1, 2], [3, "x"]],
        [5, True],
    ],
)
def test_non_int_ids_never_raise_and_still_give_windows(prompt: list[Any]) -> None:
    features = completion(prompt)
    assert 1 <= len(features.prefix_windows) <= MAX_PREFIX_WINDOWS
    assert all(0 <= key < 2**64 for key in keys_of(features))
    assert all(0 < size <= features.prompt_tokens for size in tokens_of(features))


@settings(PROFILE, max_examples=200)
@given(
    ids=st.lists(st.integers(0, 200_000), min_size=1, max_size=700),
    data=st.data(),
    prefix_tokens=st.integers(1, 40),
)
def test_token_id_windows_share_keys_exactly_before_the_first_difference(
    ids: list[int], data: st.DataObject, prefix_tokens: int
) -> None:
    at = data.draw(st.integers(0, len(ids) - 1))
    other = [*ids[:at], ids[at] + 1, *ids[at + 1 :]]
    a, b = completion(ids, prefix_tokens), completion(other, prefix_tokens)
    assert tokens_of(a) == tokens_of(b) == sizes(len(ids), prefix_tokens)
    assert keys_of(a) == id_keys(ids, prefix_tokens)
    shared = [ka == kb for ka, kb in zip(keys_of(a), keys_of(b), strict=True)]
    assert shared == [size <= at for size in tokens_of(a)]


@settings(PROFILE, max_examples=150)
@given(
    prompt=st.text(st.characters(exclude_categories=()), max_size=300),
    prefix_tokens=st.integers(0, 64),
    is_chat=st.booleans(),
)
def test_windows_are_bounded_whatever_the_text(
    prompt: str, prefix_tokens: int, is_chat: bool
) -> None:
    features = chat([user(prompt)], prefix_tokens) if is_chat else completion(prompt, prefix_tokens)
    windows = features.prefix_windows
    assert len(windows) <= MAX_PREFIX_WINDOWS
    assert (not windows) is (prefix_tokens == 0 or features.prompt_tokens == 0)
    assert all(0 < w.tokens <= features.prompt_tokens for w in windows)
    assert all(a.tokens <= b.tokens for a, b in itertools.pairwise(windows))
    assert len({w.key for w in windows}) == len(windows)
    assert all(0 <= w.key < 2**64 for w in windows)
