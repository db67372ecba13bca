"""One GET whose whole exchange, from connect to the last byte, fits a deadline.

urllib's timeout bounds each socket operation, not the exchange: a server that sends its
/metrics page a piece at a time, each piece in time, keeps one scrape going without end, and
the sidecar, which announces between scrapes, goes silent until the registry expires a healthy
instance.
"""

from __future__ import annotations

import http.client
import time
from urllib.parse import urlsplit

READ_CHUNK = 64 * 1024


class HttpStatusError(ValueError):
    """The server answered, with a status other than 2xx."""


class MalformedAnswer(ValueError):
    """What the server sent is not an HTTP answer (or was cut short)."""


def get_within(url: str, timeout_s: float, limit: int) -> bytes:
    """The body of `url`'s 2xx answer, its first `limit` bytes. Raises TimeoutError when the
    exchange is not over within `timeout_s`; OSError when the connection fails; HttpStatusError
    for another status; MalformedAnswer for what is not HTTP; ValueError for a URL that is not
    http(s). The one place http.client's errors are mapped: callers catch OSError and
    ValueError."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    deadline = time.monotonic() + timeout_s
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = kind(parts.hostname, parts.port, timeout=timeout_s)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        connection.request("GET", target)
        _time_left(connection, deadline, timeout_s)
        response = connection.getresponse()
        if not 200 <= response.status < 300:
            raise HttpStatusError(f"{url}: HTTP {response.status}")
        body = bytearray()
        while len(body) < limit:
            _time_left(connection, deadline, timeout_s)
            chunk = response.read1(min(READ_CHUNK, limit - len(body)))
            if not chunk:
                if response.length:  # read1 ends a body cut short quietly
                    raise MalformedAnswer(f"{url}: the answer ended {response.length} bytes short")
                break
            body += chunk
        return bytes(body)
    except OSError:
        raise  # a refused, reset or timed-out connection (RemoteDisconnected among them)
    except http.client.HTTPException as exc:
        raise MalformedAnswer(f"{url}: {exc!r}") from exc
    finally:
        connection.close()


def _time_left(connection: http.client.HTTPConnection, deadline: float, timeout_s: float) -> None:
    """Give the socket's next wait what is left of the exchange's time."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"no whole answer within {timeout_s:g}s")
    if connection.sock is not None:
        connection.sock.settimeout(left)
