"""W3C trace context for the legs (pdproxy.tracing.context) and JSON log lines. Pure."""

from __future__ import annotations

import json
import logging
import queue
import sys

import pytest

from pdproxy.logs import FIELDS, DroppingQueueHandler, JsonFormatter
from pdproxy.tracing.context import MAX_TRACESTATE, trace_context

NEW = "f" * 32
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


def test_a_valid_traceparent_is_continued() -> None:
    context = trace_context(f"00-{TRACE}-{PARENT}-01", "vendor=x", NEW)
    assert (context.trace_id, context.parent_id, context.flags) == (TRACE, PARENT, "01")
    headers = context.child("1" * 16)
    assert headers == {"traceparent": f"00-{TRACE}-{'1' * 16}-01", "tracestate": "vendor=x"}


def test_flags_are_kept_unsampled_too() -> None:
    context = trace_context(f"00-{TRACE}-{PARENT}-00", None, NEW)
    assert context.child("2" * 16) == {"traceparent": f"00-{TRACE}-{'2' * 16}-00"}


@pytest.mark.parametrize(
    "bad",
    [
        None,
        "",
        "garbage",
        f"01-{TRACE}-{PARENT}-01",  # unknown version: we only speak 00
        f"00-{'0' * 32}-{PARENT}-01",  # all-zero trace id
        f"00-{TRACE}-{'0' * 16}-01",  # all-zero parent id
        f"00-{TRACE.upper()}-{PARENT}-01",  # uppercase is invalid
        f"00-{TRACE}-{PARENT}-1",
        f"00-{TRACE}-{PARENT}-01-extra",
        f"00-{TRACE[:-1]}-{PARENT}-01",
    ],
)
def test_an_invalid_traceparent_starts_a_new_sampled_trace(bad: str | None) -> None:
    context = trace_context(bad, "vendor=x", NEW)
    assert (context.trace_id, context.parent_id, context.flags) == (NEW, None, "01")
    assert context.tracestate is None  # the spec: restart drops tracestate
    assert context.child("3" * 16) == {"traceparent": f"00-{NEW}-{'3' * 16}-01"}


def test_an_oversized_or_unprintable_tracestate_is_dropped() -> None:
    valid = f"00-{TRACE}-{PARENT}-01"
    assert trace_context(valid, "a" * (MAX_TRACESTATE + 1), NEW).tracestate is None
    assert trace_context(valid, "a=b\r\nx: y", NEW).tracestate is None
    assert trace_context(valid, " a=b ", NEW).tracestate == "a=b"


def _record(message: str) -> logging.LogRecord:
    return logging.LogRecord("pdproxy.test", logging.INFO, __file__, 1, message, (), None)


def test_json_lines_carry_fields_at_top_level() -> None:
    record = _record("request")
    setattr(record, FIELDS, {"status": 200, "prefill": "10.0.0.1:8100", "odd": object()})
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "request" and line["level"] == "info"
    assert line["logger"] == "pdproxy.test"
    assert line["status"] == 200 and line["prefill"] == "10.0.0.1:8100"
    assert isinstance(line["odd"], str)  # never raises on a value JSON cannot hold
    assert line["ts"].endswith("Z") and "T" in line["ts"]


def test_json_lines_include_exceptions() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord(
            "x", logging.ERROR, __file__, 1, "failed %s", ("here",), sys.exc_info()
        )
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "failed here"
    assert "ValueError: boom" in line["exception"]
    assert "\n" not in JsonFormatter().format(record)  # one line, whatever the traceback


def test_a_non_ascii_tracestate_is_dropped() -> None:
    assert trace_context(f"00-{TRACE}-{PARENT}-01", "a=é", NEW).tracestate is None


def test_the_log_queue_never_blocks_and_counts_what_it_drops() -> None:
    records: queue.Queue[logging.LogRecord] = queue.Queue(2)
    handler = DroppingQueueHandler(records)
    for n in range(5):
        handler.handle(_record(f"line {n}"))
    assert records.qsize() == 2 and handler.dropped == 3
    assert [records.get_nowait().getMessage() for _ in range(2)] == ["line 0", "line 1"]


def test_queued_records_keep_their_arguments_fields_and_exception() -> None:
    records: queue.Queue[logging.LogRecord] = queue.Queue(4)
    handler = DroppingQueueHandler(records)
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord(
            "x", logging.ERROR, __file__, 1, "failed %s", ("here",), sys.exc_info()
        )
    setattr(record, FIELDS, {"status": 500})
    handler.handle(record)
    line = json.loads(JsonFormatter().format(records.get_nowait()))
    assert line["message"] == "failed here" and line["status"] == 500
    assert "ValueError: boom" in line["exception"]
