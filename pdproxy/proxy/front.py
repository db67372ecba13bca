"""The front door: the ASGI callable the HTTP server runs: the API key check, then the completion
endpoints (and generate, Responses, Messages) straight, then the passed-through paths (vLLM's
other endpoints, looked up only when the path is no completion path: completions pay nothing for
them), everything else through FastAPI (and counted).

Apart from `PdproxyApp` (proxy/app.py, which builds it and runs the lifespan) so that the
compiled build compiles it: the server's task awaits this for every request, and each time the
task resumes it passes through here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pdproxy.metrics import Metrics
from pdproxy.proxy.api_bodies import MESSAGES_PATH, RESPONSES_PATH
from pdproxy.proxy.completions import CompletionsEndpoint
from pdproxy.proxy.credentials import Credentials
from pdproxy.proxy.error_shapes import anthropic_error_body
from pdproxy.proxy.errors import error_body
from pdproxy.proxy.exchange import Scope
from pdproxy.proxy.passthrough import PassThroughEndpoint, is_own_path
from pdproxy.proxy.request import GENERATE_PATH

# Disaggregated: completions, chat, vLLM's token-in/token-out generate, OpenAI's Responses and
# Anthropic's Messages.
COMPLETION_PATHS = (
    "/v1/completions",
    "/v1/chat/completions",
    GENERATE_PATH,
    RESPONSES_PATH,
    MESSAGES_PATH,
)
COUNTED_PATHS = frozenset(
    (
        "/health",
        "/ready",
        "/metrics",
        "/v1/models",
        "/v1/instances",
        "/v1/instances/pairs",
        "/openapi.json",
    )
)  # any other path is counted as "other": client-chosen paths must not grow label sets

Asgi = Callable[[Scope, Any, Any], Awaitable[None]]


class FrontDoor:
    """`hot`, `passthrough`, `unknown` and `metrics` are set for the lifespan (PdproxyApp's),
    empty and None outside. `unknown`: the endpoint for paths nobody knows, when they are
    passed through (passthrough_unknown_paths)."""

    def __init__(self, api: Asgi, credentials: Credentials) -> None:
        self._api = api
        self._credentials = credentials
        self.hot: dict[str, CompletionsEndpoint] = {}
        self.passthrough: dict[str, PassThroughEndpoint] = {}
        self.unknown: PassThroughEndpoint | None = None
        self.metrics: Metrics | None = None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self._api(scope, receive, send)
            return
        path: str = scope["path"]
        authorization = _authorization(scope)
        if authorization is _AMBIGUOUS:
            await self._refuse(
                scope, send, 400, _AMBIGUOUS_MESSAGE, "invalid_request", (), _AMBIGUOUS_REASON
            )
            return
        if (
            self._credentials.needs_key(path)
            and not _is_admin(scope)
            and not self._credentials.client_allowed(authorization)
        ):
            await self._refuse(
                scope,
                send,
                401,
                _UNAUTHORIZED_MESSAGE,
                "invalid_api_key",
                _CHALLENGE,
                "unauthorized",
            )
            return
        endpoint = self.hot.get(path)
        if endpoint is not None:
            await endpoint(scope, receive, send)
            return
        passed = self.passthrough.get(path)
        if passed is None and self.unknown is not None and not is_own_path(path):
            passed = self.unknown
        if passed is not None:
            await passed(scope, receive, send)
            return
        await self._counted(scope, receive, send)

    async def _counted(self, scope: Scope, receive: Any, send: Any) -> None:
        recorder = _StatusRecorder(send)
        try:
            await self._api(scope, receive, recorder)
        finally:
            if self.metrics is not None:
                path = scope["path"] if scope["path"] in COUNTED_PATHS else "other"
                self.metrics.count_request(path, str(recorder.status))

    async def _refuse(
        self,
        scope: Scope,
        send: Any,
        status: int,
        message: str,
        code: str,
        headers: tuple[tuple[bytes, bytes], ...],
        reason: str,
    ) -> None:
        """Answer before the request reaches an endpoint (its body is never read)."""
        if scope["path"] == MESSAGES_PATH:
            body = anthropic_error_body(status, message)
        else:
            body = error_body(status, message, code=code)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    *headers,
                ],
            }
        )
        await send({"type": "http.response.body", "body": body, "more_body": False})
        if self.metrics is not None:
            self.metrics.refused.labels(reason).inc()
            path = scope["path"]
            known = path in COMPLETION_PATHS or path in COUNTED_PATHS or path in self.passthrough
            self.metrics.count_request(path if known else "other", str(status))


class _StatusRecorder:
    """An ASGI `send` that notes the response's status (500 until one is sent)."""

    def __init__(self, send: Any) -> None:
        self._send = send
        self.status = 500

    async def __call__(self, message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self._send(message)


_UNAUTHORIZED_MESSAGE = "a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY)"
_CHALLENGE = ((b"www-authenticate", b'Bearer realm="pdproxy"'),)
# Several Authorization headers: which one a check reads and which one is forwarded could
# differ, so the request is refused whatever they say.
_AMBIGUOUS = "several"
_AMBIGUOUS_MESSAGE = (
    "a request may carry one Authorization header and one x-api-key header, not several"
)
_AMBIGUOUS_REASON = "ambiguous_authorization"


def _authorization(scope: Scope) -> str | None:
    """The Authorization header, None without one, `_AMBIGUOUS` with several. Anthropic's
    clients send their key as `x-api-key`: without an Authorization header it is taken as
    that key's bearer (it is never forwarded: only Authorization may be)."""
    found: str | None = None
    api_key: bytes | None = None
    for name, value in scope["headers"]:
        if name == b"authorization":
            if found is not None:
                return _AMBIGUOUS
            found = value.decode("latin-1")
        elif name == b"x-api-key":
            if api_key is not None:
                return _AMBIGUOUS
            api_key = value
    if found is None and api_key is not None:
        return "Bearer " + api_key.decode("latin-1")
    return found


def _is_admin(scope: Scope) -> bool:
    """Admin endpoints answer to the admin token, not to client keys."""
    path: str = scope["path"]
    return path.startswith("/v1/admin/") or (
        path.startswith("/v1/instances") and scope["method"] not in ("GET", "HEAD")
    )
