"""W3C Trace Context (https://www.w3.org/TR/trace-context/) for the two legs. Pure.

Each leg is a child of the client's span (or of a new trace): the same trace id, a span id of
its own, so vLLM's traces (it reads `traceparent`) join the client's, and the access log names
the trace.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# version 00: "00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>", lowercase, ids not zero
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16
_SAMPLED = "01"
MAX_TRACESTATE = 512  # the spec's recommended minimum a vendor must propagate


@dataclass(slots=True, init=False, unsafe_hash=True)
class TraceContext:
    trace_id: str
    parent_id: str | None  # the client's span, if it sent one
    flags: str
    tracestate: str | None

    # Why a hand-written __init__ (not frozen): docs/performance.md, "Dataclass constructors".
    def __init__(
        self, trace_id: str, parent_id: str | None, flags: str, tracestate: str | None = None
    ) -> None:
        self.trace_id = trace_id
        self.parent_id = parent_id
        self.flags = flags
        self.tracestate = tracestate

    def child(self, span_id: str) -> dict[str, str]:
        """Headers for a leg whose span is `span_id` (16 lowercase hex)."""
        headers = {"traceparent": f"00-{self.trace_id}-{span_id}-{self.flags}"}
        if self.tracestate:
            headers["tracestate"] = self.tracestate
        return headers


def trace_context(
    traceparent: str | None, tracestate: str | None, new_trace_id: str
) -> TraceContext:
    """The client's context if its traceparent is valid (else a new sampled trace, as the spec
    says: an invalid traceparent restarts the trace and drops tracestate)."""
    match = _TRACEPARENT.match(traceparent.strip()) if traceparent else None
    if match is None or match[1] == _ZERO_TRACE or match[2] == _ZERO_SPAN:
        return TraceContext(new_trace_id, None, _SAMPLED)
    state = tracestate.strip() if tracestate else None
    if state is not None and (
        len(state) > MAX_TRACESTATE or not (state.isascii() and state.isprintable())
    ):
        state = None
    return TraceContext(match[1], match[2], match[3], state)
