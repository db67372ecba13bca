"""Text log lines cannot be forged through values that came from the network."""

from __future__ import annotations

import logging
import sys

from pdproxy.logs import FIELDS, TEXT_FORMAT, TextFormatter


def record(message: str, *args: object, exc: bool = False) -> logging.LogRecord:
    info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            info = sys.exc_info()
    return logging.LogRecord("pdproxy.registry", logging.INFO, "f", 1, message, args, info)


def test_control_characters_in_a_message_are_escaped() -> None:
    line = TextFormatter(TEXT_FORMAT).format(
        record("registered model %s", "m\n2026-11-21 00:00:00,000 WARNING pdproxy: forged\x1b[2J")
    )
    assert "\n" not in line and "\x1b" not in line
    assert "m\\n2026-11-21" in line and "\\x1b[2J" in line


def test_printable_messages_are_unchanged() -> None:
    line = TextFormatter("%(message)s").format(record("model %s ok", "llama-3 ✓"))
    assert line == "model llama-3 ✓ ok"


def test_a_traceback_keeps_its_lines() -> None:
    text = TextFormatter("%(message)s").format(record("failed", exc=True))
    assert text.startswith("failed\nTraceback")
    assert "ValueError: boom" in text


def access_record(fields: dict[str, object]) -> logging.LogRecord:
    made = logging.LogRecord("pdproxy.access", logging.INFO, "f", 1, "request", (), None)
    setattr(made, FIELDS, fields)
    return made


def test_an_access_line_carries_its_set_fields_as_key_value_pairs() -> None:
    line = TextFormatter("%(message)s").format(
        access_record({"endpoint": "/v1/completions", "status": 200, "prefill": None, "ok": True})
    )
    assert line == "request endpoint=/v1/completions status=200 ok=True"


def test_a_client_value_cannot_pass_for_other_fields_or_lines() -> None:
    line = TextFormatter("%(message)s").format(
        access_record({"client_request_id": 'x outcome=ok\n"', "model": ""})
    )
    # Quoted (JSON string rules), so it reads as one value; no raw line break.
    assert line == 'request client_request_id="x outcome=ok\\n\\"" model=""'
