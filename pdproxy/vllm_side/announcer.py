"""Announce one worker to the registry every period, from a background thread.

Every period the registry's name is looked up again and the whole announcement goes to every
address it has (FanOutClient: each proxy replica keeps its own table). Between periods the load
is sampled every `load_report_s` and announced as soon as it changed, so that every replica sees
the legs the others placed within a second (LOAD_REPORT_S), not a period (stock vLLM's 3 s)
later; a prefill's work within PREFILL_WORK_REPORT_S (docs/performance.md, "Several
replicas": replicas place prompts well only on work a few milliseconds old).

The thread never blocks on the registry (see FanOutClient) and every wait is bounded by the
period, so stopping takes at most one period plus the ZMQ linger.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from pdproxy.registry.auth import new_nonce, signed
from pdproxy.registry.messages import Load
from pdproxy.vllm_side.announcement import WorkerIdentity, announce_message, leave_message

log = logging.getLogger("pdproxy.vllm_side")

DEFAULT_INTERVAL_S = 3.0  # what stock vLLM's P2pNcclEngine uses
# A load that changed is announced at most this long after: replicas route on each other's legs.
LOAD_REPORT_S = 1.0
# A prefill's work (Load.prefill_tokens) changes with every engine step, and the replicas'
# choices are only as good as its age: reported this often while it changes.
PREFILL_WORK_REPORT_S = 0.01


class RegistrySender(Protocol):
    """Where announcements go: a FanOutClient (a stub in tests)."""

    def refresh(self) -> None: ...

    def send(self, message: dict[str, Any]) -> bool: ...

    def close(self) -> None: ...


class LoadSample:
    """What a load source reports each period: the load (None if unknown), whether the
    instance can serve at all, and the context length it learned from the server, if any
    (None: the identity's is announced)."""

    __slots__ = ("healthy", "load", "max_model_len")

    def __init__(
        self, load: Load | None, healthy: bool = True, max_model_len: int | None = None
    ) -> None:
        self.load = load
        self.healthy = healthy
        self.max_model_len = max_model_len

    def key(self) -> tuple[Load | None, bool, int | None]:
        """What an announcement carries of the sample: equal keys, equal announcements."""
        return (self.load, self.healthy, self.max_model_len)


class Announcer:
    def __init__(
        self,
        client: RegistrySender,
        identity: WorkerIdentity,
        sample: Callable[[], LoadSample],
        interval_s: float = DEFAULT_INTERVAL_S,
        secret: bytes | None = None,
        wall_clock: Callable[[], float] = time.time,
        load_report_s: float = LOAD_REPORT_S,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("the announce interval must be positive")
        if load_report_s <= 0:
            raise ValueError("the load report period must be positive")
        self._client = client
        self._identity = identity
        self._sample = sample
        self._interval = interval_s
        self._secret = secret  # signs every message when set (announce and leave)
        self._wall_clock = wall_clock
        self._load_report_s = load_report_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def announce_once(self) -> bool:
        return self._announce(self._take_sample())

    def _take_sample(self) -> LoadSample:
        try:
            return self._sample()
        except Exception as exc:  # a failing load source must not silence the announcements
            log.warning("pdproxy announcer: load source failed: %r", exc)
            return LoadSample(None, healthy=False)

    def _announce(self, sample: LoadSample) -> bool:
        identity = self._identity
        if sample.max_model_len is not None:
            identity = replace(identity, max_model_len=sample.max_model_len)
        message = announce_message(identity, sample.load, sample.healthy)
        return self._client.send(self._seal(message))

    def _seal(self, message: dict[str, Any]) -> dict[str, Any]:
        if self._secret is None:
            return message
        return signed(message, self._secret, self._wall_clock(), new_nonce())

    def run(self, clock: Callable[[], float] = time.monotonic) -> None:
        """Announce until stop(); then say goodbye to every replica."""
        tick = min(self._interval, self._load_report_s)
        next_period = -math.inf
        announced: tuple[Load | None, bool, int | None] | None = None
        while not self._stop.is_set():
            sample = self._take_sample()
            if clock() >= next_period:
                next_period = clock() + self._interval
                self._client.refresh()  # a new replica gets the whole announcement now
                self._announce(sample)
                announced = sample.key()
            elif sample.key() != announced:
                self._announce(sample)
                announced = sample.key()
            self._stop.wait(tick)
        self._client.send(self._seal(leave_message(self._identity)))

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="pdproxy-announcer", daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Make run() send `leave` and return within one period (safe from a signal handler)."""
        self._stop.set()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the background thread started by start(), then close the client."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._client.close()
