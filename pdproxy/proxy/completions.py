"""POST /v1/completions, /v1/chat/completions, /inference/v1/generate, /v1/responses and
/v1/messages: the hot path, as a lean ASGI endpoint.

Reads and validates the body, hands it to the Dispatcher under the whole-request deadline,
and guarantees exactly one complete answer whatever happens: errors in the API's own shape
(Anthropic's on /v1/messages, OpenAI's elsewhere), no tracebacks, and a client that leaves
cancels everything it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from pdproxy.config import Settings
from pdproxy.http.alarms import Alarms
from pdproxy.http.deadline import Deadline
from pdproxy.logs import ACCESS_LOGGER, FIELDS
from pdproxy.metrics import Metrics
from pdproxy.proxy.admission import Admission
from pdproxy.proxy.api_bodies import error_shape
from pdproxy.proxy.dispatch import Dispatcher
from pdproxy.proxy.errors import ProxyError
from pdproxy.proxy.exchange import ClientGone, ClientHeaders, Exchange, Scope
from pdproxy.proxy.request import max_values, parse_completion

log = logging.getLogger("pdproxy.proxy")
access = logging.getLogger(ACCESS_LOGGER)

SHUTTING_DOWN = ProxyError(503, "pdproxy is shutting down", code="shutting_down")
CLIENT_CLOSED = 499  # nginx's convention: the client went away before the answer was complete
_MAX_ECHO_ID = 256
_MAX_TRACE_HEADER = 1024


class CompletionsEndpoint:
    def __init__(
        self,
        path: str,
        settings: Settings,
        dispatcher: Dispatcher,
        admission: Admission,
        metrics: Metrics,
        alarms: Alarms,
    ) -> None:
        self._path = path
        self._settings = settings
        self._dispatcher = dispatcher
        self._admission = admission
        self._metrics = metrics
        self._alarms = alarms
        self._access_log = settings.access_log
        self._max_values = max_values(settings.max_body_bytes)
        self._shape = error_shape(path)
        # Built in the lifespan, on the loop that serves: current_task(loop) is then a dict
        # lookup, where current_task() first looks the loop up (docs/performance.md, "Loop and
        # task lookups").
        self._loop = asyncio.get_running_loop()

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        started = time.perf_counter()
        client = read_client_headers(scope["headers"])
        client_id = client.request_id
        task = asyncio.current_task(self._loop)
        assert task is not None
        exchange = Exchange(scope, receive, send, client_id, task, started, self._shape)
        try:
            if scope["method"] != "POST":
                raise ProxyError(405, f"method {scope['method']} not allowed; use POST")
            # Admitted before the body is read: waiting requests hold no bodies in memory.
            with Deadline(self._alarms, task, self._settings.request_timeout) as deadline:
                exchange.deadline = deadline.when() or exchange.deadline
                admission = self._admission
                if not admission.try_enter():
                    await admission.enter()
                try:
                    body = await read_body(exchange, client, self._settings, self._alarms)
                    request = parse_completion(self._path, body, self._max_values)
                    exchange.notes.model, exchange.notes.stream = request.model, request.stream
                    exchange.watch_disconnect()
                    dispatcher = self._dispatcher
                    with dispatcher.trace(request, client) as trace:
                        await dispatcher.serve(request, exchange, client.authorization, trace)
                finally:
                    admission.leave()
        except ProxyError as exc:
            exchange.notes.error = exc.code
            self._log_failure(exc, client_id, exchange.request_id)
            await exchange.fail(exc)
        except TimeoutError:
            error = timed_out(exchange, self._settings.request_timeout)
            exchange.notes.error = error.code
            await exchange.fail(error)
        except ClientGone:
            exchange.client_gone = True
        except asyncio.CancelledError:
            # Our own disconnect watch cancelled the legs: the request ends here, quietly.
            # Any other cancellation (the server shutting down) goes on up, after the client
            # heard why its answer ends here.
            if not exchange.client_gone or task.uncancel() > 0:
                exchange.notes.error = "shutting_down"
                with contextlib.suppress(Exception):
                    await exchange.fail(SHUTTING_DOWN)
                raise
        except Exception:
            log.exception("unexpected error serving %s (client id %r)", self._path, client_id)
            exchange.notes.error = "internal"
            await exchange.fail(ProxyError(500, "internal error in pdproxy", code="internal"))
        finally:
            exchange.stop_watching()
            status = CLIENT_CLOSED if exchange.client_gone else exchange.status
            elapsed = time.perf_counter() - started
            self._metrics.request_answered(
                self._path, _STATUS_TEXT.get(status) or str(status), elapsed
            )
            if self._access_log and access.isEnabledFor(logging.INFO):
                self._log_access(exchange, status, elapsed, client_id)
            elif log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "%s %d in %.1f ms (client id %r, request id %s)",
                    self._path,
                    status,
                    elapsed * 1000,
                    client_id.decode("latin-1") if client_id else None,
                    exchange.request_id or "-",
                )

    def _log_access(
        self, exchange: Exchange, status: int, elapsed: float, client_id: bytes | None
    ) -> None:
        notes = exchange.notes
        fields = {
            "endpoint": self._path,
            "status": status,
            "duration_ms": _ms(elapsed),
            "request_id": exchange.request_id or None,
            "client_request_id": client_id.decode("latin-1") if client_id else None,
            "trace_id": notes.trace_id,
            "model": notes.model,
            "stream": notes.stream,
            "prefill": notes.prefill,
            "decode": notes.decode,
            "direct": notes.direct,
            "concurrent": notes.concurrent,
            "prefill_ms": _ms(notes.prefill_seconds),
            "decode_first_byte_ms": _ms(notes.decode_first_byte_seconds),
            "attempts": notes.attempts,
            "migrations": notes.migrations,
            "outcome": _outcome(exchange, status),
        }
        access.info("request", extra={FIELDS: fields})

    @staticmethod
    def _log_failure(exc: ProxyError, client_id: bytes | None, request_id: str) -> None:
        log.warning(
            "%d %s (client id %r, request id %s)",
            exc.status,
            exc.message,
            client_id.decode("latin-1") if client_id else None,
            request_id or "-",
        )


async def read_body(
    exchange: Exchange, client: ClientHeaders, settings: Settings, alarms: Alarms
) -> bytes:
    """The body, within `body_timeout`: a client trickling it must not hold its admission
    slot for the whole request timeout. A body that came whole with the head, nearly every one,
    is read with no bound armed: there is nothing to wait for."""
    if exchange.body_received():
        return await exchange.read_body(settings.max_body_bytes, client.content_length)
    limit = settings.body_timeout
    try:
        with Deadline(alarms, exchange.task, limit):
            return await exchange.read_body(settings.max_body_bytes, client.content_length)
    except TimeoutError:
        raise ProxyError(
            408, f"request body not received within {limit:g}s", code="timeout"
        ) from None


def timed_out(exchange: Exchange, limit: float) -> ProxyError:
    """What a client hears when the whole request outlived `limit` (request_timeout)."""
    if not exchange.body_read:  # the client was too slow to send its request
        return ProxyError(408, f"request body not received within {limit:g}s", code="timeout")
    return ProxyError(504, f"request took longer than {limit:g}s", code="request_timeout")


def _outcome(exchange: Exchange, status: int) -> str:
    if exchange.client_gone:
        return "client_gone"
    if exchange.notes.error:
        return exchange.notes.error
    # No error of ours: a 4xx is the instance's own refusal, relayed.
    return "instance_refused" if status >= 400 else "ok"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


_STATUS_TEXT = {code: str(code) for code in (200, 400, 401, 404, 408, 413, 429, 499, 502, 503, 504)}


def read_client_headers(raw: list[tuple[bytes, bytes]]) -> ClientHeaders:
    client_id = authorization = traceparent = tracestate = None
    length = None
    for name, value in raw:
        if name == b"x-request-id":
            client_id = value[:_MAX_ECHO_ID]
        elif name == b"authorization":
            authorization = value.decode("latin-1")
        elif name == b"content-length" and value.isdigit():
            length = int(value)
        elif name == b"traceparent":
            # Several traceparent headers make the context invalid (W3C): a new trace.
            text = value[:_MAX_TRACE_HEADER].decode("latin-1")
            traceparent = text if traceparent is None else ""
        elif name == b"tracestate":
            # Several tracestate headers are one list (W3C): joined, still bounded below.
            text = value[:_MAX_TRACE_HEADER].decode("latin-1")
            tracestate = text if tracestate is None else f"{tracestate},{text}"
    return ClientHeaders(client_id, authorization, length, traceparent, tracestate)
