"""Request migration through a live proxy and fake workers (a causal fake model): a decode that
dies mid-stream costs the client nothing; its answer equals an uninterrupted run's."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import pytest

from pdproxy.demo.fleet import LocalFleet, Worker, WorkerSpec
from pdproxy.demo.processes import wait_until
from tests.conftest import FleetFactory
from tests.integration.support import metric_value, open_raw_request, post_json, set_behaviour
from tests.integration.test_observability import wait_access_lines

MODEL = "fake-model"
ROUND_ROBIN = ["--prefill-policy", "round_robin", "--decode-policy", "round_robin"]
# The decode that cuts every stream would be ejected after a few cuts in a row: these tests
# want it to keep taking requests.
KEEP_CUTTER = ["--outlier-consecutive-failures", "1000"]
TOKENS = 8
MAX_TRIES = 8
_T = TypeVar("_T")


def aborted(worker: Worker) -> Callable[[], float]:
    return lambda: float(len(worker.events()["aborted"]))


def until_cut(ask_once: Callable[[], _T], cuts: Callable[[], float]) -> list[_T]:
    """Answers to the same request until one was cut (`cuts()` grew): the policy spreads
    requests over the decodes, one of which cuts them."""
    before = cuts()
    answers = []
    for _ in range(MAX_TRIES):
        answers.append(ask_once())
        if cuts() > before:
            return answers
    raise AssertionError(f"none of {MAX_TRIES} requests reached the decode that cuts")


def events(body: bytes) -> list[bytes]:
    return [e[len(b"data: ") :] for e in body.split(b"\n\n") if e]


def summary(body: bytes, chat: bool) -> dict[str, Any]:
    """What a client reads from a stream: its ids, text, finish, usage, token ids, [DONE]s."""
    raw = events(body)
    chunks = [json.loads(e) for e in raw if e != b"[DONE]"]
    text, usage = "", None
    finishes: list[tuple[str, str | None]] = []
    ids: set[tuple[str, int, str, str]] = set()
    token_ids: list[int] = []
    for chunk in chunks:
        assert "error" not in chunk, chunk
        ids.add((chunk["id"], chunk["created"], chunk["model"], chunk["object"]))
        for choice in chunk["choices"]:
            assert choice["index"] == 0
            text += (choice["delta"].get("content") or "") if chat else choice["text"]
            token_ids.extend(choice.get("token_ids") or [])
            if choice["finish_reason"] is not None:
                finishes.append((choice["finish_reason"], choice.get("stop_reason")))
        if chunk.get("usage"):
            usage = chunk["usage"]
    assert len(ids) == 1, ids  # one response id and `created` throughout
    return {
        "done": raw.count(b"[DONE]"),
        "last_is_done": raw[-1] == b"[DONE]",
        "text": text,
        "finishes": finishes,
        "usage": usage and {k: usage[k] for k in ("prompt_tokens", "completion_tokens")},
        "token_ids": token_ids,
    }


def body_of(chat: bool, prompt: str, **extra: Any) -> tuple[str, dict[str, Any]]:
    payload: dict[str, Any]
    if chat:
        payload = {"model": MODEL, "messages": [{"role": "user", "content": prompt}]}
        payload["max_completion_tokens"] = TOKENS
        return "/v1/chat/completions", payload | extra
    payload = {"model": MODEL, "prompt": prompt, "max_tokens": TOKENS}
    return "/v1/completions", payload | extra


def ask(fleet: LocalFleet, path: str, payload: dict[str, Any]) -> bytes:
    answer = post_json(fleet.proxy_url + path, payload)
    assert answer.status == 200, answer.body
    return answer.body


def answered(fleet: LocalFleet, path: str, payload: dict[str, Any], chat: bool) -> dict[str, Any]:
    return summary(ask(fleet, path, payload), chat)


@pytest.fixture()
def fleet(fleet_factory: FleetFactory) -> LocalFleet:
    return fleet_factory(
        [WorkerSpec("P"), WorkerSpec("D"), WorkerSpec("D")], [*ROUND_ROBIN, *KEEP_CUTTER]
    )


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_stream_cut_after_k_chunks_is_whole_and_equal_to_an_uninterrupted_one(
    fleet: LocalFleet, chat: bool
) -> None:
    dropper = fleet.role("D")[0]
    options = {"stream": True, "stream_options": {"include_usage": True}}
    migrated = 0.0
    retried_resets = {"role": "decode", "reason": "reset"}
    # Chat streams open with a role chunk: k counts it too. A stream cut after its role chunk
    # alone has no token yet: nothing of it was relayed, so it is retried, not migrated
    # (proxy/stream_opening.py).
    for k in (1, 2, 5, TOKENS if not chat else TOKENS + 1):
        retried = metric_value(fleet.proxy_url, "pdproxy_retries_total", retried_resets)
        for prompt, ask_ids in (("the quick brown fox", False), ("a different prompt", True)):
            path, payload = body_of(chat, prompt, **options)
            if ask_ids:
                payload["return_token_ids"] = True
            set_behaviour(dropper.url)
            whole = summary(ask(fleet, path, payload), chat)
            set_behaviour(dropper.url, drop_after_chunks=k)
            cut = until_cut(partial(answered, fleet, path, payload, chat), aborted(dropper))
            assert cut == [whole] * len(cut), (k, prompt)
            assert whole["done"] == 1 and whole["last_is_done"]
            assert whole["finishes"] == [("length", None)]
            expected_usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": TOKENS}
            assert whole["usage"] == expected_usage
            assert bool(whole["token_ids"]) == ask_ids
            if ask_ids:
                assert len(whole["token_ids"]) == TOKENS
        migrated_now = metric_value(
            fleet.proxy_url, "pdproxy_migrations_total", {"outcome": "completed"}
        )
        retried_now = metric_value(fleet.proxy_url, "pdproxy_retries_total", retried_resets)
        if chat and k == 1:
            assert retried_now > retried and migrated_now == migrated, k
        elif k < (TOKENS if not chat else TOKENS + 1):
            assert migrated_now > migrated, k
        migrated = migrated_now
    # Different prompts give different answers (the comparison above can fail).
    texts = {
        summary(ask(fleet, *body_of(chat, p, stream=True)), chat)["text"]
        for p in ("one prompt", "another prompt")
    }
    assert len(texts) == 2
    assert metric_value(fleet.proxy_url, "pdproxy_migration_recomputed_tokens_total") > 0


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_whole_answer_whose_decode_dies_is_answered_once_and_equal(
    fleet: LocalFleet, chat: bool
) -> None:
    dropper = fleet.role("D")[0]
    path, payload = body_of(chat, "the quick brown fox")
    whole = json.loads(ask(fleet, path, payload))
    set_behaviour(dropper.url, drop_after_chunks=0)
    for again in until_cut(lambda: json.loads(ask(fleet, path, payload)), aborted(dropper)):
        assert again["choices"] == whole["choices"]
        assert again["usage"] == whole["usage"]


def content_of(answer: dict[str, Any], chat: bool) -> dict[str, Any]:
    """What a whole answer says: text, ids, finish, usage (its other fields are nulls)."""
    [choice] = answer["choices"]
    usage = answer["usage"]
    return {
        "text": choice["message"]["content"] if chat else choice["text"],
        "token_ids": choice["token_ids"],
        "prompt_token_ids": (answer if chat else choice)["prompt_token_ids"],
        "finish": (choice["finish_reason"], choice["stop_reason"]),
        "usage": (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]),
    }


@pytest.mark.parametrize(
    ("chat", "tokens", "minimum"),
    [(False, 256, None), (True, 256, None), (False, 12, "0"), (True, 12, "0")],
    ids=["completions", "chat", "completions-short", "chat-short"],
)
def test_a_long_whole_answer_whose_decode_dies_mid_answer_is_continued(
    fleet_factory: FleetFactory, chat: bool, tokens: int, minimum: str | None
) -> None:
    """Long enough to be worth continuing (256 tokens by default, any with a minimum of 0):
    the proxy reads its decode's stream, continues it on the other decode when cut, and
    answers whole once."""
    options = ["--migration-whole-min-tokens", minimum] if minimum else []
    fleet = fleet_factory(
        [WorkerSpec("P"), WorkerSpec("D"), WorkerSpec("D")], [*ROUND_ROBIN, *KEEP_CUTTER, *options]
    )
    dropper, other = fleet.role("D")
    limit = "max_completion_tokens" if chat else "max_tokens"
    fields = {limit: tokens, "return_token_ids": True}
    path, payload = body_of(chat, "a long whole answer", **fields)
    whole = json.loads(ask(fleet, path, payload))
    # Put together by the proxy from a stream, it says what the decode says when asked whole.
    direct = post_json(other.url + path, payload)
    assert direct.status == 200, direct.body
    assert content_of(whole, chat) == content_of(json.loads(direct.body), chat)
    assert len(whole["choices"][0]["token_ids"]) == tokens
    different = json.loads(ask(fleet, *body_of(chat, "something else", **fields)))
    assert content_of(different, chat)["text"] != content_of(whole, chat)["text"]

    def completed() -> float:
        labels = {"outcome": "completed"}
        return metric_value(fleet.proxy_url, "pdproxy_migrations_total", labels)

    # Cut after the first token (a chat stream starts with its role), half-way, and before
    # the last token.
    for k in (2, tokens // 2, tokens - 1):
        set_behaviour(dropper.url, drop_after_chunks=k)
        for again in until_cut(lambda: json.loads(ask(fleet, path, payload)), completed):
            assert content_of(again, chat) == content_of(whole, chat), k
            assert again["object"] == whole["object"] and list(again) == list(whole)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_whole_answer_cut_while_it_is_received_is_run_again(
    fleet: LocalFleet, chat: bool
) -> None:
    dropper = fleet.role("D")[0]
    path, payload = body_of(chat, "cut me in half")
    whole = json.loads(ask(fleet, path, payload))
    set_behaviour(dropper.url, truncate_whole=True)

    def retries() -> float:
        return metric_value(fleet.proxy_url, "pdproxy_retries_total", {"role": "decode"})

    for again in until_cut(lambda: json.loads(ask(fleet, path, payload)), retries):
        assert again["choices"] == whole["choices"] and again["usage"] == whole["usage"]


def test_a_stop_string_over_the_cut_ends_the_answer_where_an_uninterrupted_one_ends(
    fleet: LocalFleet,
) -> None:
    path, payload = body_of(False, "stop here please", stream=True)
    full = summary(ask(fleet, path, payload), False)["text"]
    words = full.split()
    # A stop string made of the end of word 2 and the start of word 3: the cut after two
    # token chunks falls inside it.
    stop = f"{words[1][-2:]} {words[2][:2]}"
    payload["stop"] = [stop]
    dropper = fleet.role("D")[0]
    set_behaviour(dropper.url)
    whole = summary(ask(fleet, path, payload), False)
    assert whole["finishes"] == [("stop", stop)]
    set_behaviour(dropper.url, drop_after_chunks=2)
    before = metric_value(fleet.proxy_url, "pdproxy_migrations_total", {"outcome": "completed"})
    cut = until_cut(lambda: summary(ask(fleet, path, payload), False), aborted(dropper))
    assert cut == [whole] * len(cut)
    after = metric_value(fleet.proxy_url, "pdproxy_migrations_total", {"outcome": "completed"})
    assert after > before


def test_a_continuation_that_fails_too_is_migrated_again_within_the_limit(
    fleet_factory: FleetFactory,
) -> None:
    fleet = fleet_factory(
        [WorkerSpec("P"), WorkerSpec("D"), WorkerSpec("D"), WorkerSpec("D")],
        [*ROUND_ROBIN, "--migration-limit", "2"],
    )
    path, payload = body_of(False, "twice cut", stream=True)
    whole = summary(ask(fleet, path, payload), False)
    first, second, good = fleet.role("D")
    for worker in (first, second):
        set_behaviour(worker.url, drop_after_chunks=2)
    answers = [summary(ask(fleet, path, payload), False) for _ in range(3)]
    assert answers == [whole] * 3
    # Every dropper is cut too once its limit is spent: the stream ends with an error event.
    set_behaviour(good.url, drop_after_chunks=1)
    body = ask(fleet, path, dict(payload, max_tokens=40))
    raw = events(body)
    assert raw[-1] == b"[DONE]"
    assert json.loads(raw[-2])["error"]["code"] == "decode_reset"
    refused = metric_value(fleet.proxy_url, "pdproxy_migrations_total", {"outcome": "refused"})
    assert refused >= 1


def test_a_client_that_leaves_during_a_migration_cancels_it(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory(
        [
            WorkerSpec("P"),
            WorkerSpec("D", token_latency_ms=100),
            WorkerSpec("D", token_latency_ms=100),
        ],
        [*ROUND_ROBIN, "--log-format", "json"],
    )
    decodes = fleet.role("D")
    for worker in decodes:
        set_behaviour(worker.url, drop_after_chunks=2)
    _, payload = body_of(False, "leave me", stream=True, max_tokens=50)
    sock = open_raw_request(fleet.proxy_url + "/v1/completions", payload)
    data = b""
    sock.settimeout(10)
    while data.count(b'"text"') < 3:  # the third text chunk comes from the continuation
        received = sock.recv(65536)
        assert received, data
        data += received
    sock.close()

    def both_ended() -> bool:
        return sum(len(w.events()["aborted"]) for w in decodes) == 2

    wait_until(both_ended, 5, "the cut decode and the continuation's decode to abort")
    assert all(w.events()["completed"] == [] for w in decodes)
    assert len(fleet.completion_requests("P")) == 2  # the first prefill, the continuation's
    (line,) = wait_access_lines(fleet, 1)
    assert line["outcome"] == "client_gone" and line["migrations"] == 1
    failed = metric_value(fleet.proxy_url, "pdproxy_migrations_total", {"outcome": "failed"})
    assert failed == 1


def test_the_access_line_counts_migrations(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory(
        [WorkerSpec("P"), WorkerSpec("D"), WorkerSpec("D")], [*ROUND_ROBIN, "--log-format", "json"]
    )
    for worker in fleet.role("D"):
        set_behaviour(worker.url, drop_after_chunks=3)
    path, payload = body_of(False, "count me", stream=True)
    # Each decode cuts after 3 chunks: the stream needs two migrations to be whole.
    answer = summary(ask(fleet, path, payload), False)
    assert len(answer["text"].split()) == TOKENS
    (line,) = wait_access_lines(fleet, 1)
    assert line["outcome"] == "ok" and line["migrations"] == 2


def test_requests_that_are_not_migrated_end_as_without_migration(fleet: LocalFleet) -> None:
    """Tools (the chat answer's parser runs in the server): the stream is relayed byte for
    byte and a cut ends it with the error event, as with migration off."""
    dropper = fleet.role("D")[0]
    set_behaviour(dropper.url, drop_after_chunks=2)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    path, payload = body_of(True, "call a tool", stream=True, tools=tools)
    answers = until_cut(lambda: events(ask(fleet, path, payload)), aborted(dropper))
    assert all(raw[-1] == b"[DONE]" for raw in answers)
    codes = [json.loads(raw[-2]).get("error", {}).get("code") for raw in answers]
    assert codes == [None] * (len(codes) - 1) + ["decode_reset"]
    refused = metric_value(fleet.proxy_url, "pdproxy_migrations_total", {"outcome": "refused"})
    completed = metric_value(fleet.proxy_url, "pdproxy_migrations_total", {"outcome": "completed"})
    assert (refused, completed) == (0, 0)  # not migratable up front: nothing to count
