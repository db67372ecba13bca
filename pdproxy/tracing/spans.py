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

from pdproxy.tracing.context import TraceContext
from pdproxy.tracing.w3c import W3cTracing

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


class TracingUnavailable(RuntimeError):
    """--otel-exporter was set but OpenTelemetry is not installed."""


def check_available(exporter: OtelExporter) -> None:
    """Raise TracingUnavailable unless everything `exporter` needs imports."""
    if exporter == "none":
        return
    modules = ["pdproxy.tracing.otel"]
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
    from pdproxy.tracing.otel import OtelTracing

    return OtelTracing(exporter)
