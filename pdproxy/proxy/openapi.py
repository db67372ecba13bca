"""The proxy's OpenAPI 3.1 description (GET /openapi.json), written out by hand.

The disaggregated endpoints bypass FastAPI (the lean hot path), so FastAPI cannot describe
them; one hand-kept document covers every endpoint instead, and the schemathesis test holds it
to what the proxy really answers.
"""

from __future__ import annotations

from typing import Any

from pdproxy import __version__

_ERROR = {"$ref": "#/components/schemas/Error"}
_ANTHROPIC_ERROR = {"$ref": "#/components/schemas/AnthropicError"}
_JSON = "application/json"


def _answer(description: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"description": description, "content": {_JSON: {"schema": schema or _ERROR}}}


def _errors(*statuses: int, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    meanings = {
        400: "invalid request (OpenAI-shaped error)",
        401: "API key or admin token missing or wrong",
        403: "admin endpoints disabled (no admin token configured)",
        404: "not found (for a completion: a model no registered instance serves)",
        405: "method not allowed",
        408: "the request body was not received in time",
        409: "not registered (registry full, or a conflicting static instance)",
        413: "request body too large",
        422: "instance refused the request (its own error, relayed)",
        429: "too many requests waiting (Retry-After)",
        502: "an instance failed (after retries)",
        503: "no compatible pair, instances busy, queue timeout or draining (Retry-After)",
        504: "the request took longer than request_timeout",
    }
    return {str(status): _answer(meanings[status], schema) for status in statuses}


_COMPLETION_STATUSES = (400, 401, 404, 408, 413, 422, 429, 502, 503, 504)
_INSTANCE_PATH = {
    "name": "name",
    "in": "path",
    "required": True,
    "description": "the instance's http address, host:port",
    "schema": {"type": "string"},
}


def _completion(
    summary: str,
    request: str,
    ends: str = "data: [DONE]",
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A disaggregated endpoint; `ends`: its stream's last event; `error`: its error body
    (OpenAI's unless given)."""
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {_JSON: {"schema": {"$ref": f"#/components/schemas/{request}"}}},
            },
            "responses": {
                "200": {
                    "description": "the decode instance's answer, relayed (JSON, or an SSE "
                    f"stream ending with {ends})",
                    "content": {_JSON: {"schema": {"type": "object"}}, "text/event-stream": {}},
                },
                **_errors(*_COMPLETION_STATUSES, schema=error),
            },
        }
    }


def _get(summary: str, schema: dict[str, Any], *statuses: int) -> dict[str, Any]:
    return {
        "get": {
            "summary": summary,
            "responses": {"200": _answer(summary, schema), **_errors(401, *statuses)},
        }
    }


def _admin(
    method: str, summary: str, ok: str, *statuses: int, body: bool = False
) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "summary": summary,
        "security": [{"adminToken": []}],
        "responses": {ok: _answer(summary, {"type": "object"}), **_errors(401, 403, *statuses)},
    }
    if body:
        operation["requestBody"] = {
            "required": True,
            "content": {_JSON: {"schema": {"$ref": "#/components/schemas/Registration"}}},
        }
    return {method: operation}


_PROMPT = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}},
        {"type": "array", "items": {"type": "integer"}},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
    ]
}
_SAMPLING = {
    "max_tokens": {"type": ["integer", "null"]},
    "max_completion_tokens": {"type": ["integer", "null"]},
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {"type": ["object", "null"]},
    "temperature": {"type": ["number", "null"]},
    "top_p": {"type": ["number", "null"]},
    "n": {"type": ["integer", "null"]},
    "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "seed": {"type": ["integer", "null"]},
}


def openapi_document() -> dict[str, Any]:
    text = {"type": "object"}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "pdproxy",
            "version": __version__,
            "description": "OpenAI-compatible front door for prefill/decode-disaggregated vLLM.",
        },
        "paths": {
            "/v1/completions": _completion("text completion, disaggregated", "Completion"),
            "/v1/chat/completions": _completion("chat completion, disaggregated", "Chat"),
            "/inference/v1/generate": _completion(
                "vLLM's token-in/token-out generation, disaggregated", "Generate"
            ),
            "/v1/responses": _completion(
                "OpenAI Responses API, disaggregated", "Responses", "event: response.completed"
            ),
            "/v1/messages": _completion(
                "Anthropic Messages API, disaggregated",
                "Messages",
                "event: message_stop",
                _ANTHROPIC_ERROR,
            ),
            "/v1/models": _get("served models", text, 502),
            "/health": _get("the process is up", text),
            "/ready": _get("a healthy compatible pair exists", text, 503),
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {
                        "200": {"description": "text format", "content": {"text/plain": {}}},
                        **_errors(401),
                    },
                }
            },
            "/v1/instances": {
                **_get("registered instances", text),
                **_admin("post", "register a static instance", "201", 400, 409, 413, body=True),
            },
            "/v1/instances/pairs": _get("compatible pairs", text),
            "/v1/instances/{name}": {
                "parameters": [_INSTANCE_PATH],
                **_admin("delete", "remove an instance", "200", 400, 404),
            },
            "/v1/instances/{name}/drain": {
                "parameters": [_INSTANCE_PATH],
                **_admin("post", "take an instance out of rotation", "200", 404),
                **_admin("delete", "put a drained instance back", "200", 404),
            },
        },
        "components": {
            "securitySchemes": {
                "apiKey": {"type": "http", "scheme": "bearer"},
                "adminToken": {"type": "http", "scheme": "bearer"},
            },
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "required": ["message", "type", "param", "code"],
                            "properties": {
                                "message": {"type": "string"},
                                "type": {"type": "string"},
                                "param": {"type": ["string", "null"]},
                                "code": {"type": ["string", "integer", "null"]},
                            },
                        }
                    },
                },
                "AnthropicError": {
                    "type": "object",
                    "required": ["type", "error"],
                    "properties": {
                        "type": {"const": "error"},
                        "error": {
                            "type": "object",
                            "required": ["type", "message"],
                            "properties": {
                                "type": {"type": "string"},
                                "message": {"type": "string"},
                            },
                        },
                    },
                },
                "Generate": {
                    "type": "object",
                    "required": ["model", "token_ids", "sampling_params"],
                    "properties": {
                        "model": {"type": "string"},
                        "token_ids": {"type": "array", "items": {"type": "integer"}},
                        "sampling_params": {"type": "object"},
                        "stream": {"type": ["boolean", "null"]},
                    },
                },
                "Responses": {
                    "type": "object",
                    "required": ["model", "input"],
                    "properties": {
                        "model": {"type": "string"},
                        "input": {"anyOf": [{"type": "string"}, {"type": "array"}]},
                        "instructions": {"type": ["string", "null"]},
                        "max_output_tokens": {"type": ["integer", "null"]},
                        "stream": {"type": ["boolean", "null"]},
                        "store": {"type": ["boolean", "null"]},
                        "temperature": {"type": ["number", "null"]},
                    },
                },
                "Messages": {
                    "type": "object",
                    "required": ["model", "messages", "max_tokens"],
                    "properties": {
                        "model": {"type": "string"},
                        "max_tokens": {"type": "integer"},
                        "system": {"type": "string"},
                        "messages": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["role", "content"],
                                "properties": {
                                    "role": {"enum": ["user", "assistant"]},
                                    "content": {"type": "string"},
                                },
                            },
                        },
                        "stream": {"type": ["boolean", "null"]},
                        "temperature": {"type": ["number", "null"]},
                    },
                },
                "Completion": {
                    "type": "object",
                    "required": ["model", "prompt"],
                    "properties": {"model": {"type": "string"}, "prompt": _PROMPT, **_SAMPLING},
                },
                "Chat": {
                    "type": "object",
                    "required": ["model", "messages"],
                    "properties": {
                        "model": {"type": "string"},
                        "messages": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["role", "content"],
                                "properties": {
                                    "role": {"enum": ["system", "user", "assistant"]},
                                    "content": {"type": "string"},
                                },
                            },
                        },
                        **_SAMPLING,
                    },
                },
                "Registration": {
                    "type": "object",
                    "required": ["role", "http_address", "zmq_address"],
                    "additionalProperties": False,
                    "properties": {
                        "role": {"enum": ["prefill", "decode"]},
                        "http_address": {"type": "string"},
                        "zmq_address": {"type": "string"},
                        "model": {"type": ["string", "null"]},
                    },
                },
            },
        },
    }
