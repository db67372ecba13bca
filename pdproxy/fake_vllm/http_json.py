"""JSON over HTTP the way vLLM does it: compact bodies in and out, OpenAI-shaped errors."""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from aiohttp import web


def json_response(body: Any, status: int = 200) -> web.Response:
    # body= (not text=) so the Content-Type is plain "application/json", as vLLM sends it.
    payload = json.dumps(body, separators=(",", ":")).encode()
    return web.Response(status=status, body=payload, content_type="application/json")


def error_type(status: int) -> str:
    """vLLM / OpenAI error type for a status: 400 -> BadRequestError, 500 -> InternalServerError."""
    try:
        name = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
    except ValueError:
        return "APIError"
    return name if name.endswith("Error") else f"{name}Error"


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": error_type(status), "param": param, "code": status}
    }


class ApiError(Exception):
    """A request vLLM would refuse; becomes an OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def response(self) -> web.Response:
        return json_response(error_body(self.status, self.message, self.param), self.status)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"Invalid JSON in request body: {err}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "Request body must be a JSON object")
    return body
