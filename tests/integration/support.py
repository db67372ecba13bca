"""Plain HTTP helpers for the integration tests (raw bytes in, status/headers/body out)."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self
from urllib.parse import urlsplit

from pdproxy.demo.fleet import LocalFleet, Worker, WorkerSpec
from pdproxy.demo.processes import ManagedProcess, http_get


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
    """The value of one sample in /metrics, 0.0 when the sample is absent. A label the
    family's samples never carry is an error, not a silent 0 (a misspelt or renamed label)."""
    status, body = http_get(proxy_url + "/metrics", timeout=5)
    assert status == 200
    wanted = labels or {}
    total = 0.0
    found = False
    carried: set[str] = set()
    named = False
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
        named = True
        carried |= set(pairs)
        if all(pairs.get(k) == v for k, v in wanted.items()):
            total += float(value)
            found = True
    unknown = set(wanted) - carried
    assert not named or not unknown, f"{name} has no label {sorted(unknown)}"
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


def closed_by_peer(sock: socket.socket, timeout: float = 5.0) -> bool:
    """Whether the other end closes (or resets) the connection within `timeout`; no data
    is expected meanwhile."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


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


class LoopbackServer:
    """An asyncio TCP server on 127.0.0.1 and a thread of its own, for a `with` block:
    `serve` handles each connection; leaving the block stops the server and its tasks."""

    stream_limit = 1 << 16  # the readers' buffer bound (asyncio's default)

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.port = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        async def start() -> asyncio.Server:
            return await asyncio.start_server(self.serve, "127.0.0.1", 0, limit=self.stream_limit)

        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(start(), self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


class ScriptedUpstream(LoopbackServer):
    """A tiny HTTP server answering with exactly the bytes a test scripts, to stand in for an
    instance that misbehaves in ways a fake worker cannot."""

    def __init__(self, script: Callable[[asyncio.StreamWriter], Awaitable[None]]) -> None:
        super().__init__()
        self._script = script

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            await reader.readexactly(length)
            await self._script(writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


def hang_up_mid_stream_aborts(decode: Worker, sock: socket.socket) -> None:
    """Close a client connection whose stream is flowing: the decode instance must see its
    request aborted within a second, and never complete it."""
    read_until(sock, b"data: ", timeout=10)  # the stream is flowing
    hung_up = time.monotonic()
    sock.close()
    deadline = time.monotonic() + 5
    aborted: list[dict[str, Any]] = []
    while not aborted and time.monotonic() < deadline:
        aborted = decode.events()["aborted"]
        time.sleep(0.05)
    assert len(aborted) == 1, decode.events()
    assert aborted[0]["time"] - hung_up < 1.0
    assert decode.events()["completed"] == []


def json_answer(body: bytes) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


@contextmanager
def one_pair_fleet(log_dir: Path) -> Iterator[LocalFleet]:
    """A started proxy with one prefill and one decode (KV addressed by the request-id tag) and
    JSON logs, stopped on the way out (a start that fails half-way included)."""
    fleet = LocalFleet(log_dir, [WorkerSpec("P"), WorkerSpec("D")], ["--log-format", "json"])
    try:
        yield fleet.start()
    finally:
        fleet.stop()


def stopped_for(process: ManagedProcess, seconds: float) -> None:
    """SIGSTOP `process` for `seconds` (as a descheduled VM or a CPU-throttled cgroup stops
    it); it runs again even if this is interrupted."""
    os.kill(process.pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(process.pid, signal.SIGCONT)
