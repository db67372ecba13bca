"""Running/waiting counts, and a prefill's work, as the scheduler-side connector sees them. Pure.

The connector is told when a request arrives (on_new_request), when it gets KV blocks (it is
being scheduled), how far each scheduled request's prompt has been computed (every step's
scheduler output) and when it finishes; that is enough for the load a router needs. A request
preempted back to the queue still counts as running until it finishes: an overestimate that
steers new work away, which is the safe side.

Prefill work is the prompt tokens not computed yet (queued, or part-way through a chunked
prefill), cached ones counting as computed once the request is scheduled. Proxy replicas read
it to see the work the others placed on a prefill (pairing/scoreboard.py); its total is kept
as one number, which the announcer's thread reads while the scheduler's thread changes it.
"""

from __future__ import annotations

from pdproxy.registry.messages import Load


class LoadTracker:
    def __init__(self, counts_prefill_work: bool = False) -> None:
        self._waiting: set[str] = set()
        self._running: set[str] = set()
        self._counts_prefill_work = counts_prefill_work
        self._prompt: dict[str, int] = {}  # request id -> prompt tokens, until its prefill ends
        self._left: dict[str, int] = {}  # request id -> prompt tokens not computed yet
        self._prefill_tokens = 0  # the sum of _left

    def arrived(self, request_id: str, prompt_tokens: int = 0) -> None:
        if request_id not in self._running:
            self._waiting.add(request_id)
        if self._counts_prefill_work and request_id not in self._prompt and prompt_tokens > 0:
            self._prompt[request_id] = prompt_tokens
            self._left[request_id] = prompt_tokens
            self._prefill_tokens += prompt_tokens

    def scheduled(self, request_id: str) -> None:
        self._waiting.discard(request_id)
        self._running.add(request_id)

    def computed(self, request_id: str, tokens: int) -> None:
        """`tokens` of the request's prompt are computed, cached, or being computed this step."""
        prompt = self._prompt.get(request_id)
        if prompt is None:
            return
        left = max(0, prompt - tokens)
        self._prefill_tokens += left - self._left[request_id]
        if left:
            self._left[request_id] = left
        else:
            self._forget(request_id)

    def finished(self, request_id: str) -> None:
        self._waiting.discard(request_id)
        self._running.discard(request_id)
        if request_id in self._prompt:
            self._prefill_tokens -= self._left[request_id]
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        del self._prompt[request_id]
        del self._left[request_id]

    def load(self, kv_usage: float | None = None) -> Load:
        return Load(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_usage=kv_usage,
            prefill_tokens=self._prefill_tokens if self._counts_prefill_work else None,
        )
