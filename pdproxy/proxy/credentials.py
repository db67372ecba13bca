"""Client API keys and the admin token, checked in constant time.

Keys are compared as SHA-256 digests with hmac.compare_digest against every configured key
(no early exit), so neither a key's length nor how much of it matched shows in the timing.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from pathlib import Path

from pdproxy.config import Settings

_BEARER = "bearer "


class CredentialsError(ValueError):
    """A key file could not be read or holds no usable key."""


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).digest()


def _bearer(authorization: str | None) -> str | None:
    if authorization is None or authorization[: len(_BEARER)].lower() != _BEARER:
        return None
    return authorization[len(_BEARER) :].strip()


class Credentials:
    def __init__(
        self,
        client_keys: Iterable[str],
        admin_token: str | None,
        open_paths: Iterable[str] = (),
    ) -> None:
        self._client_digests = tuple(_digest(key) for key in client_keys)
        self._admin_digest = None if admin_token is None else _digest(admin_token)
        self.open_paths = frozenset(open_paths)

    @classmethod
    def from_settings(cls, settings: Settings) -> Credentials:
        keys = [key.get_secret_value() for key in settings.api_key]
        if settings.api_key_file is not None:
            keys.extend(_key_lines(settings.api_key_file))
        admin = None if settings.admin_token is None else settings.admin_token.get_secret_value()
        if settings.admin_token_file is not None:
            lines = _key_lines(settings.admin_token_file)
            admin = lines[0]
        return cls(keys, admin, settings.open_paths)

    @property
    def keys_required(self) -> bool:
        return bool(self._client_digests)

    @property
    def admin_enabled(self) -> bool:
        return self._admin_digest is not None

    def needs_key(self, path: str) -> bool:
        return bool(self._client_digests) and path not in self.open_paths

    def client_allowed(self, authorization: str | None) -> bool:
        presented = _bearer(authorization)
        if presented is None:
            return False
        digest = _digest(presented)
        matched = False
        for known in self._client_digests:
            matched |= hmac.compare_digest(digest, known)
        return matched

    def admin_allowed(self, authorization: str | None) -> bool:
        presented = _bearer(authorization)
        if presented is None or self._admin_digest is None:
            return False
        return hmac.compare_digest(_digest(presented), self._admin_digest)


def _key_lines(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CredentialsError(f"cannot read {path}: {exc}") from None
    keys = []
    for line in text.splitlines():
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if any(c.isspace() for c in key):
            raise CredentialsError(f"{path}: a key must contain no whitespace")
        keys.append(key)
    if not keys:
        raise CredentialsError(f"{path} holds no key")
    return keys
