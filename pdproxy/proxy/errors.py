"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, never a traceback."""

from __future__ import annotations

import orjson

_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class ProxyError(Exception):
    """A request failed in a way the client must hear about, with this status and body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers

    def body(self) -> bytes:
        return error_body(self.status, self.message, code=self.code, param=self.param)


def error_body(
    status: int, message: str, *, code: str | None = None, param: str | None = None
) -> bytes:
    return orjson.dumps(
        {
            "error": {
                "message": message,
                "type": _TYPES.get(
                    status, "upstream_error" if status >= 500 else "invalid_request_error"
                ),
                "param": param,
                "code": code if code is not None else status,
            }
        }
    )


class VllmBadRequest(ProxyError):
    """A 400 for a body vLLM itself would refuse as invalid, in the shape of vLLM 0.32's
    validation errors (serve/exception_handling/handlers/validation.py: type "Bad Request",
    param the field's path from the body, "body.token_ids"); the message is pdproxy's."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(400, message, code="invalid_request", param=f"body.{field}")

    def body(self) -> bytes:
        return orjson.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": "Bad Request",
                    "param": self.param,
                    "code": 400,
                }
            }
        )


def vllm_bad_request(message: str, param: str | None = None) -> bytes:
    """A 400 as vLLM itself writes it (its ErrorResponse for a validation error), for a
    refusal pdproxy makes on the instance's behalf: the client cannot tell the two apart."""
    return orjson.dumps(
        {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}
    )
