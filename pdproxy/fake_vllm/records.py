"""What the worker saw, kept in bounded rings for tests in other processes to read."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

RECORD_LIMIT = 1000  # each /_fake/ ring keeps the last this many entries
# kv_sent / kv_received: a p2p_nccl push left this prefill / reached this decode.
# kv_held / kv_served: a nixl/pdproxy prefill keeps a request's KV / a decode read it.
# kv_ok: a decode accepted a request's KV (entry: the request id); kv_failed: a handoff failed
# (entry: a map with one of KV_FAILURE_REASONS); computed_locally: a decode computed a prompt
# itself (no KV was asked for).
EVENT_NAMES = (
    "kv_sent",
    "kv_received",
    "kv_held",
    "kv_served",
    "kv_registered",  # nixl_push prefill: a decode registered for a request's KV
    "kv_ok",
    "kv_failed",
    "computed_locally",
    "aborted",
    "completed",
    "stream_error",  # a stream answered 200, then an injected error event (Behaviour)
)
KV_FAILURE_REASONS = (
    "send_timeout",  # p2p_nccl prefill: the push could not be queued in time
    "send_error",  # p2p_nccl prefill: ZMQ refused the push
    "timeout",  # decode: no KV (pushed or pulled) within --kv-timeout
    "wrong_sender",  # p2p_nccl decode: KV came from another prefill than the request id names
    "geometry_mismatch",  # decode: the prefill's connector or geometry does not fit this one's
    "payload_mismatch",  # decode: the KV was computed for another prompt
    "decode_tp_mismatch",  # pdproxy decode: the prefill split heads for another decode TP size
    "bad_params",  # kv_transfer_params are not what a prefill answers
    "wrong_role",  # nixl/pdproxy: a prefill asked to decode, or a decode asked to prefill
    "pull_error",  # nixl/pdproxy decode: ZMQ refused the pull
    "bad_reply",  # nixl/pdproxy decode: the prefill's answer was not a pull reply
    "engine_id_mismatch",  # the prefill reached is not remote_engine_id
    "missing_transfer",  # the prefill holds no such transfer (never, expired or already read)
    "block_ids_mismatch",  # the transfer is held under other block ids
    "register_error",  # nixl_push decode: its registration could not be sent to the prefill
)


def stamp() -> dict[str, float]:
    return {"time": time.monotonic(), "wall": time.time()}


@dataclass(slots=True)
class RecordedRequest:
    """One completion request as the records know it."""

    record_id: str  # X-Request-Id, or the response id when the header is absent
    path: str
    aborted: bool = False


class Records:
    """What the worker saw, for GET /_fake/requests and /_fake/events (bounded rings)."""

    def __init__(self) -> None:
        self.requests: deque[dict[str, Any]] = deque(maxlen=RECORD_LIMIT)
        self.events: dict[str, deque[Any]] = {n: deque(maxlen=RECORD_LIMIT) for n in EVENT_NAMES}

    def add(self, event: str, entry: Any) -> None:
        self.events[event].append(entry)

    def kv_failed(self, reason: str, **entry: Any) -> None:
        assert reason in KV_FAILURE_REASONS, reason
        self.add("kv_failed", {**entry, "reason": reason, **stamp()})

    def add_abort(self, recorded: RecordedRequest) -> None:
        # Both a reset connection and the handler's cancellation may report one abort.
        if not recorded.aborted:
            recorded.aborted = True
            self.add(
                "aborted", {"request_id": recorded.record_id, "path": recorded.path, **stamp()}
            )

    def events_snapshot(self) -> dict[str, list[Any]]:
        return {name: list(entries) for name, entries in self.events.items()}

    def clear(self) -> None:
        self.requests.clear()
        for entries in self.events.values():
            entries.clear()
