"""Process logging: human-readable lines, or one JSON object per line for log pipelines.

Records go through a bounded queue to a writer thread, so the event loop never waits on a slow
log pipe; past the bound, records are dropped and counted rather than stalling requests.
"""

from __future__ import annotations

import atexit
import copy
import logging
import queue
import sys
import time
from logging.handlers import QueueHandler, QueueListener
from typing import Any, Literal

import orjson

LogFormat = Literal["text", "json"]
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ACCESS_LOGGER = "pdproxy.access"
FIELDS = "fields"  # the `extra` key whose dict a JSON line carries as top-level fields


class JsonFormatter(logging.Formatter):
    """`{"ts", "level", "logger", "pid", "message", ...fields}`; never raises on odd field
    values. The pid tells apart the processes of a multi-worker proxy."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": _iso(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        fields = getattr(record, FIELDS, None)
        if isinstance(fields, dict):
            line.update(fields)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        return orjson.dumps(line, default=str).decode()


class TextFormatter(logging.Formatter):
    """One line per record: control characters in the message (a model name or a client id
    from the network) are escaped, so nobody can forge log lines. Tracebacks, added after the
    message, keep their lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        fields = getattr(record, FIELDS, None)
        if isinstance(fields, dict):  # an access line: its fields as key=value, set ones only
            line += "".join(
                f" {key}={_text_value(value)}" for key, value in fields.items() if value is not None
            )
        if line.isprintable():
            return line
        return "".join(c if c.isprintable() else repr(c)[1:-1] for c in line)


def _text_value(value: Any) -> str:
    text = str(value)
    # Quoted when it would not read as one value (a client's id may hold anything).
    if not text or any(c.isspace() or c in '="' for c in text):
        return orjson.dumps(text).decode()
    return text


def _iso(created: float) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created))
    return f"{seconds}.{int(created % 1 * 1000):03d}Z"


MAX_QUEUED_RECORDS = 10_000


class DroppingQueueHandler(QueueHandler):
    """Hands records to the writer thread; never blocks, drops (and counts) when full."""

    def __init__(self, records: queue.Queue[logging.LogRecord]) -> None:
        super().__init__(records)
        self.dropped = 0

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        # Resolve everything that must be read now (arguments, the live exception), keep the
        # rest (extra fields) for the writer thread's formatter.
        prepared = copy.copy(record)
        prepared.msg = record.getMessage()
        prepared.args = None
        if record.exc_info:
            prepared.exc_text = logging.Formatter().formatException(record.exc_info)
            prepared.exc_info = None
        return prepared

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1


def configure_logging(level: str, log_format: LogFormat) -> DroppingQueueHandler:
    """Set up the root logger. uvicorn's own loggers propagate to it (start it with
    log_config=None), so every line has the same format."""
    writer = logging.StreamHandler(sys.stderr)
    formatter = JsonFormatter() if log_format == "json" else TextFormatter(TEXT_FORMAT)
    writer.setFormatter(formatter)
    records: queue.Queue[logging.LogRecord] = queue.Queue(MAX_QUEUED_RECORDS)
    handler = DroppingQueueHandler(records)
    listener = QueueListener(records, writer)
    listener.start()
    atexit.register(_stop, listener, handler)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
    return handler


def _stop(listener: QueueListener, handler: DroppingQueueHandler) -> None:
    listener.stop()  # writes what is still queued
    if handler.dropped:
        print(
            f"pdproxy: {handler.dropped} log records dropped (log output too slow)", file=sys.stderr
        )
