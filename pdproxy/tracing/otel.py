"""OpenTelemetry spans for a request and its two legs (imported only with --otel-exporter).

`pdproxy.request` (kind SERVER) is a child of the client's span when it sent a valid
traceparent; `pdproxy.prefill` and `pdproxy.decode` (kind CLIENT) are its children, and each
leg's `traceparent` names its own span, so vLLM's spans nest under the leg that called it.
The OTLP exporter reads the standard OTEL_EXPORTER_OTLP_* environment variables.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
)
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from pdproxy import __version__
from pdproxy.tracing.context import TraceContext


def _one_line(span: ReadableSpan) -> str:
    return str(span.to_json(indent=None)) + "\n"


class _OtelRequest:
    def __init__(self, tracer: trace.Tracer, span: Span, tracestate: str | None) -> None:
        self._tracer = tracer
        self._span = span
        self._tracestate = tracestate
        self.trace_id = f"{span.get_span_context().trace_id:032x}"

    @contextlib.contextmanager
    def leg(self, role: str, instance: str) -> Iterator[dict[str, str]]:
        span = self._tracer.start_span(
            f"pdproxy.{role}",
            context=trace.set_span_in_context(self._span),
            kind=SpanKind.CLIENT,
            attributes={"pdproxy.role": role, "server.address": instance},
        )
        with _ended(span):
            context = span.get_span_context()
            flags = f"{int(context.trace_flags):02x}"
            headers = {"traceparent": f"00-{self.trace_id}-{context.span_id:016x}-{flags}"}
            if self._tracestate:
                headers["tracestate"] = self._tracestate
            yield headers


@contextlib.contextmanager
def _ended(span: Span) -> Iterator[None]:
    """End `span` however the block ends; a failure marks it as an error. (Spans are passed
    explicitly, never made current: requests interleave on one event loop.)"""
    try:
        yield
    except BaseException as exc:
        span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        raise
    finally:
        span.end()


class OtelTracing:
    def __init__(self, exporter: Literal["otlp", "console"]) -> None:
        provider = TracerProvider(
            resource=Resource.create({"service.name": "pdproxy", "service.version": __version__})
        )
        processor: SpanProcessor
        if exporter == "console":
            # One JSON line per span, written as each span ends (tests and local debugging).
            processor = SimpleSpanProcessor(ConsoleSpanExporter(formatter=_one_line))
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            processor = BatchSpanProcessor(OTLPSpanExporter())
        provider.add_span_processor(processor)
        self._provider = provider
        self._tracer = provider.get_tracer("pdproxy")

    @contextlib.contextmanager
    def request(self, context: TraceContext, endpoint: str) -> Iterator[_OtelRequest]:
        parent = None
        if context.parent_id is not None:
            remote = trace.SpanContext(
                int(context.trace_id, 16),
                int(context.parent_id, 16),
                is_remote=True,
                trace_flags=trace.TraceFlags(int(context.flags, 16)),
            )
            parent = trace.set_span_in_context(trace.NonRecordingSpan(remote))
        span = self._tracer.start_span(
            "pdproxy.request",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.route": endpoint},
        )
        with _ended(span):
            yield _OtelRequest(self._tracer, span, context.tracestate)

    def shutdown(self) -> None:
        self._provider.shutdown()  # flushes what is still batched
