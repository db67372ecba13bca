"""Tracing of one request and its legs: W3C trace context always, OpenTelemetry spans when
asked for (`--otel-exporter`, the `otel` extra).

Without OpenTelemetry each leg still gets a `traceparent` of its own under the client's trace,
so vLLM's spans (vLLM reads the header) join the client's trace and the access log names it.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from typing import Literal, Protocol

from pdproxy.proxy.trace_context import TraceContext

OtelExporter = Literal["none", "otlp", "console"]


class RequestTrace(Protocol):
    trace_id: str

    def leg(self, role: str, instance: str) -> contextlib.AbstractContextManager[dict[str, str]]:
        """Around one leg; yields the trace headers that leg sends."""
        ...


class Tracing(Protocol):
    def request(
        self, context: TraceContext, endpoint: str
    ) -> contextlib.AbstractContextManager[RequestTrace]: ...

    def shutdown(self) -> None: ...


class _W3cRequest(contextlib.AbstractContextManager["_W3cRequest"]):
    """One request's trace context; a class, as are its legs' (nullcontext), rather than
    generator context managers: these run for every request."""

    __slots__ = ("_context", "_new_span_id", "trace_id")

    def __init__(self, context: TraceContext, new_span_id: Callable[[], str]) -> None:
        self.trace_id = context.trace_id
        self._context = context
        self._new_span_id = new_span_id

    def __exit__(self, *exc: object) -> None:
        return None

    def leg(self, role: str, instance: str) -> contextlib.nullcontext[dict[str, str]]:
        return contextlib.nullcontext(self._context.child(self._new_span_id()))


class W3cTracing:
    """Trace context propagation only: nothing is recorded or exported."""

    def __init__(self, new_span_id: Callable[[], str]) -> None:
        self._new_span_id = new_span_id

    def request(self, context: TraceContext, endpoint: str) -> _W3cRequest:
        return _W3cRequest(context, self._new_span_id)

    def shutdown(self) -> None:
        pass


class TracingUnavailable(RuntimeError):
    """--otel-exporter was set but OpenTelemetry is not installed."""


def check_available(exporter: OtelExporter) -> None:
    """Raise TracingUnavailable unless everything `exporter` needs imports."""
    if exporter == "none":
        return
    modules = ["pdproxy.proxy.otel"]
    if exporter == "otlp":
        modules.append("opentelemetry.exporter.otlp.proto.http.trace_exporter")
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise TracingUnavailable(
                f"--otel-exporter {exporter} needs OpenTelemetry: pip install 'pdproxy[otel]' "
                f"({exc})"
            ) from None


def build_tracing(exporter: OtelExporter, new_span_id: Callable[[], str]) -> Tracing:
    check_available(exporter)
    if exporter == "none":
        return W3cTracing(new_span_id)
    from pdproxy.proxy.otel import OtelTracing

    return OtelTracing(exporter)
