"""The registry secret a worker signs its v1 messages with (pdproxy.registry.auth).

Read from a file (or, for `pdproxy announce`, the PDPROXY_REGISTRY_SECRET variable), never from a
command-line value, so it does not show in `ps`. Surrounding whitespace (a trailing newline) is
dropped, as the proxy's own setting is a plain string.
"""

from __future__ import annotations

from pathlib import Path

from pdproxy.registry.auth import MIN_SECRET_BYTES

SECRET_ENV = "PDPROXY_REGISTRY_SECRET"
MAX_SECRET_FILE_BYTES = 4096


class SecretError(ValueError):
    pass


def secret_from_text(text: bytes, where: str) -> bytes:
    secret = text.strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(f"registry secret from {where} is shorter than {MIN_SECRET_BYTES} bytes")
    return secret


def read_secret_file(path: Path) -> bytes:
    try:
        with path.open("rb") as file:
            data = file.read(MAX_SECRET_FILE_BYTES + 1)
    except OSError as exc:
        raise SecretError(f"registry secret file {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise SecretError(f"registry secret file {path} is larger than {MAX_SECRET_FILE_BYTES} B")
    return secret_from_text(data, str(path))
