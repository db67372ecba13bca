"""Plain HTTP helpers for the integration tests (raw bytes in, status/headers/body out)."""

from __future__ import annotations

import http.client
import json
import socket
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from pdproxy.testing.processes import http_get


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def request(
    url: str,
    method: str = "POST",
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> Answer:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
    try:
        sent = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, parts.path, body=body, headers=sent)
        response = conn.getresponse()
        return Answer(
            response.status,
            {k.lower(): v for k, v in response.getheaders()},
            response.read(),
        )
    finally:
        conn.close()


def post_json(url: str, payload: Any, headers: dict[str, str] | None = None) -> Answer:
    return request(url, body=json.dumps(payload).encode(), headers=headers)


def set_behaviour(worker_url: str, **behaviour: Any) -> None:
    """Make a fake worker answer every later completion with this status/delay (none: normal)."""
    answer = request(worker_url + "/_fake/behaviour", body=json.dumps(behaviour).encode())
    assert answer.status == 200, answer.body


def metric_value(proxy_url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """The value of one sample in /metrics, 0.0 when the sample is absent."""
    status, body = http_get(proxy_url + "/metrics", timeout=5)
    assert status == 200
    wanted = labels or {}
    total = 0.0
    found = False
    for line in body.decode().splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        sample, _, value = line.rpartition(" ")
        metric, _, label_text = sample.partition("{")
        if metric != name:
            continue
        pairs = dict(
            item.split("=", 1) for item in label_text.rstrip("}").split(",") if "=" in item
        )
        pairs = {k: v.strip('"') for k, v in pairs.items()}
        if all(pairs.get(k) == v for k, v in wanted.items()):
            total += float(value)
            found = True
    return total if found else 0.0


def open_raw_request(url: str, payload: Any) -> socket.socket:
    """Send a POST on a raw socket and return the socket, so a test can hang up at will."""
    parts = urlsplit(url)
    body = json.dumps(payload).encode()
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    head = (
        f"POST {parts.path} HTTP/1.1\r\nHost: {parts.hostname}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body)
    return sock


def read_until(sock: socket.socket, marker: bytes, timeout: float) -> bytes:
    deadline = time.monotonic() + timeout
    data = b""
    while marker not in data:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{marker!r} not seen; got {data[:500]!r}")
        sock.settimeout(remaining)
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data
