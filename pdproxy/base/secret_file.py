"""The registry secret that v1 messages are signed with (pdproxy.registry.auth), read from a
file: by a worker (or, for `pdproxy announce`, from the PDPROXY_REGISTRY_SECRET variable) and by
the proxy (`registry_secret_file`), never from a command-line value, which `ps` would show.
Surrounding whitespace (a trailing newline) is dropped."""

from __future__ import annotations

from pathlib import Path

SECRET_ENV = "PDPROXY_REGISTRY_SECRET"
MIN_SECRET_BYTES = 16
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
