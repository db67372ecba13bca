"""proxy/stream_opening.py: the verdict on a stream's first bytes, before any reaches a client."""

from __future__ import annotations

import json

import pytest

from pdproxy.proxy.stream_opening import MAX_OPENING_BYTES, Opening, read_opening

ROLE = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
)
TOKEN = b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" hi"}]}\n\n'
CHAT_TOKEN = b'data: {"id":"chatcmpl-1","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'


def error_event(code: object, message: object = "Internal server error") -> bytes:
    # json.dumps with its spaces, as vLLM writes the event.
    body = {"error": {"message": message, "type": "InternalServerError", "param": None}}
    body["error"]["code"] = code
    return f"data: {json.dumps(body)}\n\n".encode()


@pytest.mark.parametrize("held", [TOKEN, TOKEN + TOKEN, ROLE + CHAT_TOKEN, b"data: [DONE]\n\n"])
def test_a_first_token_or_the_end_is_relayed(held: bytes) -> None:
    assert read_opening(held) == (Opening.RELAY, "")


@pytest.mark.parametrize("held", [b"", b"data: {", ROLE, ROLE + ROLE, ROLE + CHAT_TOKEN[:20]])
def test_without_a_whole_event_past_the_role_events_it_reads_on(held: bytes) -> None:
    assert read_opening(held) == (Opening.MORE, "")


@pytest.mark.parametrize("opening", [b"", ROLE, ROLE + ROLE])
@pytest.mark.parametrize("code", [500, 503, None, "500"])
def test_a_server_error_before_the_first_token_fails_the_leg(opening: bytes, code: object) -> None:
    held = opening + error_event(code) + b"data: [DONE]\n\n"
    assert read_opening(held) == (Opening.FAILED, "Internal server error")


@pytest.mark.parametrize("code", [400, 404, 422])
def test_an_error_the_instance_blames_on_the_request_is_its_answer(code: int) -> None:
    assert read_opening(ROLE + error_event(code)) == (Opening.RELAY, "")


def test_an_error_after_the_first_token_is_the_relays_business() -> None:
    assert read_opening(TOKEN + error_event(500)) == (Opening.RELAY, "")


def test_an_unreadable_error_event_still_fails_the_leg() -> None:
    assert read_opening(b'data: {"error": oops}\n\n') == (
        Opening.FAILED,
        "an unreadable error event",
    )
    assert read_opening(b'data: {"error": "busy"}\n\n') == (Opening.FAILED, "busy")


def test_events_framed_with_crlf_are_read_alike() -> None:
    assert read_opening(ROLE.replace(b"\n", b"\r\n") + TOKEN) == (Opening.RELAY, "")
    assert read_opening(ROLE.replace(b"\n", b"\r\n")) == (Opening.MORE, "")
    failed = ROLE.replace(b"\n", b"\r\n") + error_event(500).replace(b"\n", b"\r\n")
    assert read_opening(failed) == (Opening.FAILED, "Internal server error")


def test_a_long_message_is_cut() -> None:
    verdict, detail = read_opening(error_event(500, "x" * 5000))
    assert verdict is Opening.FAILED and detail == "x" * 200


def test_reading_ahead_is_bounded() -> None:
    endless = ROLE * (MAX_OPENING_BYTES // len(ROLE) + 1)
    assert read_opening(endless[: MAX_OPENING_BYTES - 1]) == (Opening.MORE, "")
    assert read_opening(endless) == (Opening.RELAY, "")  # role events alone, past the bound
    unfinished = b"data: " + b"x" * MAX_OPENING_BYTES
    assert read_opening(unfinished) == (Opening.RELAY, "")
