"""The stream ledger: what the client got before a cut, and continuation chunks made into the
rest of the same answer."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdproxy.proxy.migration_stream import SSE_DONE, MalformedStream, StreamLedger


def event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chunk(text: str, ids: list[int], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    choice |= {"stop_reason": None, "token_ids": ids} | extra
    return {
        "id": "cmpl-A",
        "object": "text_completion",
        "created": 5,
        "model": "m",
        "choices": [choice],
    }


def chat_chunk(content: str, ids: list[int], **top: Any) -> dict[str, Any]:
    choice = {
        "index": 0,
        "delta": {"content": content},
        "logprobs": None,
        "finish_reason": None,
        "token_ids": ids,
    }
    return {
        "id": "chatcmpl-A",
        "object": "chat.completion.chunk",
        "created": 5,
        "model": "m",
        "choices": [choice],
    } | top


def parsed(data: bytes) -> list[Any]:
    return [e[6:] if e == b"data: [DONE]" else json.loads(e[6:]) for e in data.split(b"\n\n") if e]


def ledger(chat: bool = False, wants_ids: bool = False, usage: bool = True) -> StreamLedger:
    return StreamLedger(chat, wants_ids, usage, 1 << 20)


def test_a_relayed_stream_is_recorded_and_ids_the_client_did_not_ask_for_are_removed() -> None:
    book = ledger()
    first = event(chunk(" a", [11], prompt_token_ids=[1, 2, 3]))
    second = event(chunk(" b", [12]))
    # Split mid-event: only whole events reach the client.
    out = book.feed(first + second[:10])
    out += book.feed(second[10:])
    sent = parsed(out)
    assert [c["choices"][0]["text"] for c in sent] == [" a", " b"]
    assert all("token_ids" not in c["choices"][0] for c in sent)
    assert all("prompt_token_ids" not in c["choices"][0] for c in sent)
    assert book.prompt_ids == [1, 2, 3] and book.generated == [11, 12]
    assert book.chars_sent == 4 and not book.finished


def test_a_client_that_asked_for_ids_gets_the_upstream_bytes_unchanged() -> None:
    book = ledger(wants_ids=True)
    data = event(chunk(" a", [11], prompt_token_ids=[1]))
    assert book.feed(data) == data


def test_a_chat_stream_takes_its_prompt_ids_from_the_first_chunk() -> None:
    book = ledger(chat=True)
    out = parsed(book.feed(event(chat_chunk("", [], prompt_token_ids=[4, 5]))))
    assert "prompt_token_ids" not in out[0]
    book.feed(event(chat_chunk(" x", [9])))
    assert book.prompt_ids == [4, 5] and book.generated == [9] and book.chars_sent == 2


def test_a_tool_call_or_reasoning_makes_the_stream_unmigratable() -> None:
    book = ledger(chat=True)
    tool = chat_chunk("", [3])
    tool["choices"][0]["delta"] = {"tool_calls": [{"index": 0}]}
    book.feed(event(tool))
    assert not book.migratable


@pytest.mark.parametrize("bad", [b"data: {not json\n\n", b"data: [1]\n\n"])
def test_a_malformed_event_is_a_failure(bad: bytes) -> None:
    with pytest.raises(MalformedStream):
        ledger().feed(bad)


def test_an_event_longer_than_the_bound_is_a_failure() -> None:
    book = StreamLedger(False, False, False, 64)
    with pytest.raises(MalformedStream):
        book.feed(b"data: " + b"x" * 100)


def test_a_continuation_reads_as_the_rest_of_the_same_answer() -> None:
    book = ledger()
    book.feed(event(chunk(" a", [11], prompt_token_ids=[1, 2])))
    book.cut(replay=False)
    following = chunk(" c", [13], "length")
    following["id"], following["created"] = "cmpl-B", 99
    out = book.feed(event(following))
    usage = {
        "id": "cmpl-B",
        "created": 99,
        "model": "m",
        "object": "text_completion",
        "choices": [],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
    out += book.feed(event(usage) + SSE_DONE)
    sent = parsed(out)
    assert [(c["id"], c["created"]) for c in sent[:-1]] == [("cmpl-A", 5)] * 2
    assert sent[0]["choices"] == [
        {"index": 0, "text": " c", "logprobs": None, "finish_reason": "length", "stop_reason": None}
    ]
    # One usage block: the original prompt's tokens and every completion token.
    assert sent[1]["usage"]["prompt_tokens"] == 2
    assert sent[1]["usage"]["completion_tokens"] == 2
    assert sent[-1] == b"[DONE]" and book.done and book.generated == [11, 13]


def test_a_chat_continuation_is_made_chat_shaped() -> None:
    book = ledger(chat=True, wants_ids=True)
    book.feed(event(chat_chunk("", [], prompt_token_ids=[4])))
    book.feed(event(chat_chunk(" x", [9])))
    book.cut(replay=False)
    [sent] = parsed(book.feed(event(chunk(" y", [10], "stop"))))
    assert sent["object"] == "chat.completion.chunk" and sent["id"] == "chatcmpl-A"
    assert sent["choices"][0]["delta"] == {"content": " y"}
    assert sent["choices"][0]["token_ids"] == [10]
    assert sent["choices"][0]["finish_reason"] == "stop" and book.finished


def logprobs_of(tokens: list[str], offset: int) -> dict[str, Any]:
    offsets = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {
        "tokens": tokens,
        "token_logprobs": [-1.0] * len(tokens),
        "top_logprobs": None,
        "text_offset": offsets,
    }


def test_completions_text_offsets_continue_from_the_last_token_reported() -> None:
    book = ledger()
    first = chunk(" a", [1], logprobs=logprobs_of([" a"], 0), prompt_token_ids=[0])
    book.feed(event(first) + event(chunk("bc", [2], logprobs=logprobs_of(["bc"], 2))))
    book.cut(replay=False)
    following = chunk(
        "d",
        [3],
        logprobs={
            "tokens": ["d"],
            "token_logprobs": [-0.5],
            "top_logprobs": None,
            "text_offset": [0],
        },
    )
    [sent] = parsed(book.feed(event(following)))
    assert sent["choices"][0]["logprobs"]["text_offset"] == [4]


def test_text_offsets_after_a_cut_count_token_strings_not_text() -> None:
    # vLLM 0.32 advances text_offset by each reported token's string: a special token adds
    # its string's length and no text, so the characters sent are no measure of it.
    book = ledger()
    book.feed(event(chunk(" a", [1], logprobs=logprobs_of([" a"], 0), prompt_token_ids=[0])))
    book.feed(event(chunk("", [2], logprobs=logprobs_of(["<|sys|>"], 2))))
    book.feed(event(chunk(" b", [3], logprobs=logprobs_of([" b"], 9))))
    assert book.chars_sent == 4
    book.cut(replay=False)
    [sent] = parsed(book.feed(event(chunk(" c", [4], logprobs=logprobs_of([" c"], 0)))))
    assert sent["choices"][0]["logprobs"]["text_offset"] == [11]
    # The next cut goes on from there, counted the same way.
    book.cut(replay=False)
    [sent] = parsed(book.feed(event(chunk(" d", [5], logprobs=logprobs_of([" d"], 0)))))
    assert sent["choices"][0]["logprobs"]["text_offset"] == [13]


def test_a_replay_takes_out_what_the_client_holds() -> None:
    book = ledger(wants_ids=True)
    book.feed(event(chunk(" a", [11], prompt_token_ids=[1])))
    book.feed(event(chunk(" b", [12])))
    book.cut(replay=True)
    out = book.feed(event(chunk(" a", [11])) + event(chunk(" b c", [12, 13])))
    out += book.feed(event(chunk(" d", [14], "length")))
    sent = parsed(out)
    assert [c["choices"][0]["text"] for c in sent] == [" c", " d"]
    assert [c["choices"][0]["token_ids"] for c in sent] == [[13], [14]]
    assert book.generated == [11, 12, 13, 14]


def test_a_stream_cut_after_its_last_token_is_closed_with_usage_and_done() -> None:
    book = ledger()
    book.feed(event(chunk(" a", [11], "length", prompt_token_ids=[1, 2])))
    assert book.finished and not book.done
    closing = parsed(book.closing())
    assert closing[0]["usage"]["completion_tokens"] == 1
    assert closing[0]["usage"]["prompt_tokens"] == 2
    assert closing[-1] == b"[DONE]" and book.done


def test_ids_whose_text_was_pending_are_generated_again_and_their_text_sent() -> None:
    book = ledger(wants_ids=True)
    book.feed(event(chunk(" a", [11], prompt_token_ids=[1])))
    book.feed(event(chunk("", [12])))  # a token ending inside a UTF-8 character: no text yet
    assert book.settled() == [11]
    book.cut(replay=False)
    out = book.feed(event(chunk("\u00e9", [12])) + event(chunk(" b", [13], "length")))
    sent = parsed(out)
    # The id the client has is not sent twice; the character it completes is sent once.
    assert [c["choices"][0]["text"] for c in sent] == ["\u00e9", " b"]
    assert [c["choices"][0]["token_ids"] for c in sent] == [[], [13]]
    assert book.generated == [11, 12, 13]


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_reasoning_makes_the_stream_unmigratable(field: str) -> None:
    book = ledger(chat=True)
    thought = chat_chunk("", [3])
    thought["choices"][0]["delta"] = {field: "hmm"}
    book.feed(event(thought))
    assert not book.migratable


def test_a_chunk_of_several_tokens_is_no_clean_cut_so_its_tokens_are_generated_again() -> None:
    # vLLM merges steps into one chunk when the reader lags: its last token may end inside a
    # UTF-8 character (no text yet), and a continuation whose prompt ends there would get its
    # whole prompt's text as its first text. So the cut goes back to the last one-token chunk.
    book = ledger(wants_ids=True)
    book.feed(event(chunk(" a", [11], logprobs=logprobs_of([" a"], 0), prompt_token_ids=[1])))
    merged = chunk(" b", [12, 13], logprobs=logprobs_of([" b", ""], 2))
    book.feed(event(merged))
    assert book.settled() == [11]
    book.cut(replay=False)
    again = [
        chunk(" b", [12], logprobs=logprobs_of([" b"], 0)),
        chunk("", [13], logprobs=logprobs_of([""], 2)),
        chunk("\u00e9 c", [14], "length", logprobs=logprobs_of(["\u00e9 c"], 2)),
    ]
    sent = parsed(book.feed(b"".join(event(c) for c in again)))
    # What the client has is not sent twice: its ids, its logprobs and its text.
    assert [c["choices"][0]["text"] for c in sent] == ["\u00e9 c"]
    assert [c["choices"][0]["token_ids"] for c in sent] == [[14]]
    assert sent[0]["choices"][0]["logprobs"]["text_offset"] == [4]
    assert book.generated == [11, 12, 13, 14] and book.chars_sent == 7


def test_a_replay_moves_the_clean_cut_only_past_what_the_client_has() -> None:
    book = ledger(wants_ids=True)
    book.feed(event(chunk(" a", [11], prompt_token_ids=[1])) + event(chunk(" b", [12])))
    book.cut(replay=True)
    book.feed(event(chunk(" a", [11])))  # regenerated: the clean cut is still after " b"
    assert book.settled() == [11, 12]
    book.feed(event(chunk(" b", [12])) + event(chunk(" c", [13])))
    assert book.settled() == [11, 12, 13] and book.chars_sent == 6


def test_a_stream_without_token_ids_is_relayed_as_it_comes_and_watched_for_done() -> None:
    # An upstream that ignores return_token_ids cannot be continued: its events are not read.
    book = ledger()
    plain = chunk(" a", [])
    del plain["choices"][0]["token_ids"]
    first, rest = event(plain), b'data: {"odd":  1}\n\n: comment\n\ndata: [DO'
    assert book.feed(first + rest) == first + rest  # byte for byte, a partial event included
    assert not book.migratable and book.prompt_ids is None and not book.done
    assert book.feed(b"NE]\n\n") == b"NE]\n\n" and book.done
    assert book.feed(b"data: x\n\n") == b"data: x\n\n" and not book.done


def whole_ledger(chat: bool = False, wants_ids: bool = False) -> StreamLedger:
    return StreamLedger(chat, wants_ids, False, 1 << 20, whole=True)


def usage_event(completion: int) -> bytes:
    return event({"id": "cmpl-B", "choices": [], "usage": {"completion_tokens": completion}})


def test_a_whole_answer_is_put_together_from_its_stream_and_its_continuation() -> None:
    book = whole_ledger()
    first = chunk(" a", [11], logprobs=logprobs_of([" a"], 0), prompt_token_ids=[1, 2])
    book.feed(event(first) + event(chunk(" b", [12], logprobs=logprobs_of([" b"], 2))))
    book.cut(replay=False)
    book.feed(event(chunk(" c", [13], "length", logprobs=logprobs_of([" c"], 0))))
    book.feed(usage_event(1) + SSE_DONE)
    assert book.done
    status, body = book.whole_answer()
    answer = json.loads(body)
    assert status == 200 and answer["id"] == "cmpl-A" and answer["created"] == 5
    assert answer["object"] == "text_completion"
    [choice] = answer["choices"]
    assert choice["text"] == " a b c" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == [" a", " b", " c"]
    assert choice["logprobs"]["text_offset"] == [0, 2, 4]
    assert choice["token_ids"] is None and choice["prompt_token_ids"] is None
    assert answer["usage"] == {
        "prompt_tokens": 2,
        "total_tokens": 5,
        "completion_tokens": 3,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    # vLLM 0.32's CompletionResponse, field for field (its nulls included).
    assert list(answer) == [
        *("id", "object", "created", "model", "choices", "service_tier", "system_fingerprint"),
        *("usage", "kv_transfer_params", "ec_transfer_params", "metrics"),
    ]
    assert list(choice) == [
        *("index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids"),
        *("prompt_logprobs", "prompt_token_ids", "routed_experts"),
    ]


def test_a_whole_chat_answer_has_its_message_reasoning_and_the_ids_asked_for() -> None:
    book = whole_ledger(chat=True, wants_ids=True)
    thought = chat_chunk("", [7], prompt_token_ids=[4, 5])
    thought["choices"][0]["delta"] = {"role": "assistant", "reasoning_content": "hmm"}
    book.feed(event(thought) + event(chat_chunk("Hi", [8])))
    stop = chat_chunk("!", [9])
    stop["choices"][0] |= {"finish_reason": "stop", "stop_reason": None}
    book.feed(event(stop) + SSE_DONE)
    status, body = book.whole_answer()
    answer = json.loads(body)
    assert status == 200 and answer["object"] == "chat.completion"
    [choice] = answer["choices"]
    message = {k: v for k, v in choice["message"].items() if v is not None}
    assert message == {"role": "assistant", "content": "Hi!", "reasoning_content": "hmm"}
    assert choice["finish_reason"] == "stop" and choice["token_ids"] == [7, 8, 9]
    assert answer["prompt_token_ids"] == [4, 5] and answer["usage"]["completion_tokens"] == 3
    # vLLM 0.32's ChatCompletionResponse, field for field.
    assert list(answer) == [
        *("id", "object", "created", "model", "choices", "service_tier", "system_fingerprint"),
        *("usage", "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params"),
        *("ec_transfer_params", "metrics"),
    ]
    assert list(choice["message"]) == [
        *("role", "content", "refusal", "annotations", "audio", "function_call"),
        "reasoning_content",
    ]
    assert not book.migratable  # reasoning went out: a failure now computes it again


def test_a_whole_answers_error_event_is_the_answer_with_its_status() -> None:
    book = whole_ledger()
    book.feed(event(chunk(" a", [11], prompt_token_ids=[1])))
    error = {"object": "error", "message": "engine died", "type": "InternalServerError"}
    book.feed(event({"error": error | {"code": 503}}) + SSE_DONE)
    status, body = book.whole_answer()
    assert status == 503 and json.loads(body)["error"]["message"] == "engine died"
    broken = whole_ledger()
    broken.feed(event({"error": error}) + SSE_DONE)
    assert broken.whole_answer()[0] == 500


def test_a_whole_answer_without_token_ids_is_still_put_together() -> None:
    book = whole_ledger()
    plain = chunk(" a", [])
    del plain["choices"][0]["token_ids"]
    book.feed(event(plain) + SSE_DONE)  # read, not handed through: the answer is built here
    assert not book.migratable and book.done
    assert json.loads(book.whole_answer()[1])["choices"][0]["text"] == " a"


def test_a_whole_answers_stream_is_bounded_like_a_whole_body() -> None:
    book = StreamLedger(False, False, False, 2048, whole=True)
    one = event(chunk(" a", [11], prompt_token_ids=[1]))
    with pytest.raises(MalformedStream):
        for _ in range(2048 // len(one) + 1):
            book.feed(one)
    assert not book.migratable  # computed again, not continued into the same bound
