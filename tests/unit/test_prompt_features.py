"""pdproxy.proxy.prompt.request_features: size and prefix of an OpenAI body, without a
tokenizer. Pure, and never raises on a JSON object, whatever its fields hold."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.pairing.features import RequestFeatures
from pdproxy.proxy.prompt import (
    CHARS_PER_TOKEN,
    DEFAULT_CHAT_TOKENS,
    DEFAULT_COMPLETION_TOKENS,
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
