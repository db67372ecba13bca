"""An append-only JSON-lines record of what the engine showed the connector.

Tests read it to see the engine-internal request ids and token counts real vLLM produced. Off
unless `record_path` is configured. Several processes of one instance (scheduler and workers)
may append to the same file: each record is one short write to an O_APPEND file, so lines never
interleave.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class RequestLog:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "pid": os.getpid(), **fields}, default=str) + "\n"
        os.write(self._fd, line.encode())

    def close(self) -> None:
        os.close(self._fd)


def read_request_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]
