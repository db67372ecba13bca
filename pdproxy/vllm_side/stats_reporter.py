"""Reports one TP rank's KV transfer statistics to the registry (the v1 "stats" op).

`report()` runs on the worker's hot path, from any thread: it checks the entry with the
registry's own decoder (one bad entry would make the proxy refuse the whole message) and puts it
on a bounded queue without ever blocking; when the queue is full the entry is dropped and
counted. A daemon thread sends what has piled up as few messages as the limits allow (at most
MAX_TRANSFERS entries and MAX_MESSAGE_BYTES each), signed like the announcements, through a
FanOutClient, as the announcer does: every proxy replica the registry's name resolves to gets
every entry (each counts KV transfers in its own /metrics), the name is looked up again every
`refresh_s`, and a replica that is away loses its own messages (counted here too) without
delaying the others.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import msgpack

from pdproxy.base.roles import Role
from pdproxy.registry.auth import new_nonce, signed
from pdproxy.registry.messages import MAX_TRANSFERS
from pdproxy.vllm_side.announcement import TransferStat, stats_message
from pdproxy.vllm_side.announcer import DEFAULT_INTERVAL_S
from pdproxy.vllm_side.fanout import FanOutClient, announce_resolver

log = logging.getLogger("pdproxy.vllm_side")

DEFAULT_QUEUE = 4096
# Below the proxy's default registry_max_message_bytes (65,536), with room for the envelope and
# the signature: larger frames are dropped by ZMQ on the proxy's side.
MAX_MESSAGE_BYTES = 60_000
_POLL_S = 0.2  # how often the idle sender thread looks at the stop flag


class Sender(Protocol):
    """What the reporter sends through: a FanOutClient (a stub in tests)."""

    def refresh(self) -> None: ...

    def send(self, message: dict[str, Any]) -> bool: ...

    def close(self) -> None: ...


def stats_identity(http_address: str, rank: int) -> str:
    """A DEALER identity of its own: a ROUTER ignores a second peer with an identity in use
    (the announcer's), and a restarted rank must not collide with its predecessor."""
    return f"{http_address}/stats/{rank}/{uuid.uuid4().hex[:8]}"


class StatsReporter:
    def __init__(
        self,
        client: Sender,
        role: Role,
        http_address: str,
        rank: int,
        ranks: int,
        secret: bytes | None = None,
        queue_size: int = DEFAULT_QUEUE,
        wall_clock: Callable[[], float] = time.time,
        refresh_s: float = DEFAULT_INTERVAL_S,
    ) -> None:
        stats_message(role, http_address, rank, ranks, [])  # raises ValueError on a bad rank
        if queue_size < 1:
            raise ValueError("queue_size must be at least 1")
        if refresh_s <= 0:
            raise ValueError("refresh_s must be positive")
        self._client = client
        self._refresh_s = refresh_s
        self._envelope = (role, http_address, rank, ranks)
        self._secret = secret
        self._wall_clock = wall_clock
        self._queue: queue.Queue[TransferStat] = queue.Queue(queue_size)
        self._lock = threading.Lock()  # guards the counters: report() runs on any thread
        self._dropped = 0
        self._invalid = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def connect(
        cls,
        registry_address: str,
        role: Role,
        http_address: str,
        rank: int,
        ranks: int,
        secret: bytes | None = None,
        refresh_s: float = DEFAULT_INTERVAL_S,
    ) -> StatsReporter:
        """A reporter with a FanOutClient of its own (one per rank process), started.
        `registry_address` may be a name with several addresses (a headless Service)."""
        client = FanOutClient(
            registry_address, stats_identity(http_address, rank), announce_resolver(refresh_s)
        )
        reporter = cls(client, role, http_address, rank, ranks, secret, refresh_s=refresh_s)
        reporter.start()
        return reporter

    @property
    def dropped(self) -> int:
        """Entries lost: the queue was full, or a replica (at least one) could not take their
        message, or the registry's name had no address yet."""
        return self._dropped

    @property
    def invalid(self) -> int:
        """Entries refused by report() because the registry would refuse them."""
        return self._invalid

    def report(self, stat: TransferStat) -> bool:
        """Queue one entry; never blocks. False if it was refused or dropped (and counted)."""
        try:
            stat.report()
        except ValueError as exc:
            with self._lock:
                self._invalid += 1
                first = self._invalid == 1
            if first:  # a connector bug repeats on every transfer: say it once
                log.warning("pdproxy stats: refusing an entry the registry would refuse: %s", exc)
            return False
        try:
            self._queue.put_nowait(stat)
        except queue.Full:
            self._lose(1)
            return False
        return True

    def flush(self) -> int:
        """Send everything queued now; the number of entries handed to the client. Only from
        the sender thread, or when it is not running (a ZMQ socket is not thread-safe)."""
        return self._send_queued(None)

    def _send_queued(self, first: TransferStat | None) -> int:
        sent = 0
        batch: list[TransferStat] = []
        size = 0
        for stat in self._queued(first):
            entry_size = len(msgpack.packb(stat.as_map()))
            if batch and (len(batch) == MAX_TRANSFERS or size + entry_size > MAX_MESSAGE_BYTES):
                sent += self._send(batch)
                batch, size = [], 0
            batch.append(stat)
            size += entry_size
        if batch:
            sent += self._send(batch)
        return sent

    def _queued(self, first: TransferStat | None) -> Iterator[TransferStat]:
        if first is not None:
            yield first
        while True:
            try:
                yield self._queue.get_nowait()
            except queue.Empty:
                return

    def _send(self, batch: list[TransferStat]) -> int:
        message = stats_message(*self._envelope, batch)
        if self._client.send(self._seal(message)):
            return len(batch)
        self._lose(len(batch))
        return 0

    def _seal(self, message: dict[str, Any]) -> dict[str, Any]:
        if self._secret is None:
            return message
        return signed(message, self._secret, self._wall_clock(), new_nonce())

    def _lose(self, count: int) -> None:
        with self._lock:
            self._dropped += count

    def run(self, clock: Callable[[], float] = time.monotonic) -> None:
        """Send as entries arrive (whatever piled up meanwhile goes along), until stop(); look
        the registry's name up again every refresh_s (here: the thread that owns the sockets)."""
        next_refresh = -math.inf
        while not self._stop.is_set():
            if clock() >= next_refresh:
                self._client.refresh()  # bounded by refresh_s (announce_resolver)
                next_refresh = clock() + self._refresh_s
            try:
                first = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            self._send_queued(first)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="pdproxy-stats", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the thread, send what is left, close the client."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():  # never expected: its waits are bounded
                log.warning("pdproxy stats: sender thread did not stop; unsent entries lost")
                return
        self.flush()
        self._client.close()
