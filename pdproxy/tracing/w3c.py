"""Trace context propagation without OpenTelemetry (the default): each leg gets a
`traceparent` of its own under the client's trace; nothing is recorded or exported.

Classes with their own __enter__/__exit__, not generator context managers nor
contextlib's (a request enters three of them), and apart from tracing.py so that the compiled
build compiles them.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

from pdproxy.tracing.context import TraceContext


class _NothingToUndo:
    """A context manager whose exit has nothing to undo."""

    __slots__ = ()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        return None


class LegHeaders(_NothingToUndo):
    """`with request.leg(...) as headers:` the trace headers one leg sends."""

    __slots__ = ("_headers",)

    def __init__(self, headers: dict[str, str]) -> None:
        self._headers = headers

    def __enter__(self) -> dict[str, str]:
        return self._headers


class W3cRequest(_NothingToUndo):
    """One request's trace context."""

    __slots__ = ("_context", "_new_span_id", "trace_id")

    def __init__(self, context: TraceContext, new_span_id: Callable[[], str]) -> None:
        self.trace_id = context.trace_id
        self._context = context
        self._new_span_id = new_span_id

    def __enter__(self) -> W3cRequest:
        return self

    def leg(self, role: str, instance: str) -> LegHeaders:
        return LegHeaders(self._context.child(self._new_span_id()))


class W3cTracing:
    def __init__(self, new_span_id: Callable[[], str]) -> None:
        self._new_span_id = new_span_id

    def request(self, context: TraceContext, endpoint: str) -> W3cRequest:
        return W3cRequest(context, self._new_span_id)

    def shutdown(self) -> None:
        pass
