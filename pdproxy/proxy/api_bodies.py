"""The two chat APIs besides OpenAI's chat completions that the proxy disaggregates, as vLLM
0.32 serves them: OpenAI's Responses API (POST /v1/responses) and Anthropic's Messages API
(POST /v1/messages). What the proxy refuses in their bodies, and how their prefill leg is
written. Pure.

Both take `kv_transfer_params` at the top level of the body, like chat (vLLM copies it into the
engine's extra arguments; a non-streamed answer carries the prefill's back). Messages runs on
vLLM's chat completions inside, so its engine id comes from the X-Request-Id header like chat's.
Responses does not read that header: its engine id is the body's `request_id` (default
`resp_` and a random uuid) plus `_0`, so the proxy writes the tagged id there on both legs, and
a client may not set it (the two legs would not meet).

Stored responses live in the instance that answered, and a pair's decode is not chosen by who
stored what: `previous_response_id` and `background` (which needs the store) are refused
rather than answered from the wrong instance.
"""

from __future__ import annotations

from typing import Any

from pdproxy.proxy.error_shapes import ANTHROPIC_SHAPE, OPENAI_SHAPE, RESPONSES_SHAPE, ErrorShape
from pdproxy.proxy.errors import ProxyError

RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"
# Where vLLM's Responses API takes its engine id from (ResponsesRequest.request_id).
RESPONSES_ID_FIELD = "request_id"
RESPONSES_ID_PREFIX = "resp_"


def error_shape(path: str) -> ErrorShape:
    """How errors on `path` are written."""
    if path == MESSAGES_PATH:
        return ANTHROPIC_SHAPE
    if path == RESPONSES_PATH:
        return RESPONSES_SHAPE
    return OPENAI_SHAPE


def responses_leg_id(request_id: str) -> str:
    """The body's `request_id` for a leg tagged `request_id`: also the response's `id`."""
    return RESPONSES_ID_PREFIX + request_id


def check_responses(payload: dict[str, Any]) -> None:
    """400 for what the proxy cannot serve right on /v1/responses."""
    if payload.get("previous_response_id") is not None:
        raise ProxyError(
            400,
            "'previous_response_id' is not supported through pdproxy: a response is stored "
            "on the instance that answered it, which the next request's pair need not "
            "include; send the conversation so far in 'input' instead",
            param="previous_response_id",
            code="unsupported_parameter",
        )
    if payload.get("background"):
        raise ProxyError(
            400,
            "'background' is not supported through pdproxy: a background response is kept "
            "and fetched on the instance that runs it, which pdproxy does not track",
            param="background",
            code="unsupported_parameter",
        )
    if RESPONSES_ID_FIELD in payload:
        raise ProxyError(
            400,
            f"'{RESPONSES_ID_FIELD}' is set by pdproxy, not by clients (the prefill and decode "
            "legs meet by it)",
            param=RESPONSES_ID_FIELD,
            code="invalid_request",
        )


def check_messages(payload: dict[str, Any]) -> None:
    """400 (written in Anthropic's shape by the endpoint) without the one field the prefill
    leg rewrites: with it missing, the prefill would run and the decode refuse."""
    value = payload.get("max_tokens")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ProxyError(
            400,
            "max_tokens: a positive integer is required",
            param="max_tokens",
            code="invalid_request",
        )


def responses_prefill(payload: dict[str, Any]) -> None:
    """`payload` (a copy of the client's) made into a Responses prefill leg: one output token,
    answered whole, not stored (the decode's answer is the one the client gets)."""
    payload["max_output_tokens"] = 1
    payload["stream"] = False
    payload["store"] = False
    payload.pop("stream_options", None)


def messages_prefill(payload: dict[str, Any]) -> None:
    """`payload` made into a Messages prefill leg: one token, answered whole. Extended
    thinking with a budget goes: vLLM refuses a budget not below max_tokens (unless a NIXL-style
    `do_remote_decode` is set), and the budget bounds only the sampling (vLLM's
    thinking_token_budget), not the prompt, so the prefill computes the same KV without it."""
    payload["max_tokens"] = 1
    payload["stream"] = False
    thinking = payload.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        del payload["thinking"]


def responses_text(payload: dict[str, Any]) -> tuple[str, Any]:
    """(instructions, input) of a Responses body, for the prompt's features: `input` is a
    string or a list of items shaped like chat messages."""
    instructions = payload.get("instructions")
    return (instructions if isinstance(instructions, str) else ""), payload.get("input")
