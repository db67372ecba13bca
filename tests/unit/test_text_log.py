"""Text log lines cannot be forged through values that came from the network."""

from __future__ import annotations

import logging
import sys

from pdproxy.logs import TEXT_FORMAT, TextFormatter


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
