"""Running the decode leg at the same time as the prefill leg.

For a connector that loads KV asynchronously (pdproxy's own), the decode instance can take the
request before the prefill finished: it holds the request until the KV arrived, without
stalling its other requests. Sending both legs at once then saves the decode leg's way in
(a round trip, the instance's parsing, tokenising and scheduling) from the time to first token.

What must not change: a prefill that fails or refuses a request before the decode answered
anything still decides the outcome (the decode would only wait for KV that never comes), so the
decode leg is cancelled (its connection closed, which aborts the request on vLLM) and the
failure goes to the retry loop, or the refusal to the client, as in the sequential flow.

The decode's bound (`DecodeBound`): it may wait for the prefill, so until the prefill answered
it is the prefill's limit plus its own; once the prefill answered, the KV is computed and only
its transfer is left, so from then on the decode has its own limit. A transfer the connector
drops (vLLM's NixlPushConnector gives up a push whose handshake timed out, and its decode then
waits for good) fails the leg after that limit, and the retry loop takes it, instead of the
client waiting out the prefill's limit as well.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from pdproxy.http.deadline import Deadline
from pdproxy.http.upstream import Reply
from pdproxy.proxy.lease import LegLease

log = logging.getLogger("pdproxy.dispatch")


class DecodeBound:
    """The bound of a decode leg sent beside its prefill (module docstring). The decode leg says
    when it starts waiting (`waiting`) and when its answer began or it ended (`release`); the
    prefill leg says when it answered (`prefill_answered`), in either order."""

    __slots__ = ("_deadline", "_leg", "_limit", "_prefilled_at", "prefill_wait")

    def __init__(self, prefill_wait: float) -> None:
        self.prefill_wait = prefill_wait  # added to the decode's own limit at first
        self._deadline: Deadline | None = None
        self._leg: LegLease | None = None
        self._limit = 0.0
        self._prefilled_at: float | None = None

    def waiting(self, deadline: Deadline, leg: LegLease, limit: float) -> None:
        """The decode leg waits (for what `leg.waiting` says) under `deadline`; `limit`: its
        own, without the prefill's."""
        self._deadline, self._leg, self._limit = deadline, leg, limit
        if self._prefilled_at is not None:
            self._tighten(self._prefilled_at)

    def release(self) -> None:
        """The decode's answer began, or its leg ended: its bound is no longer this one's to
        move."""
        self._deadline = self._leg = None

    def prefill_answered(self, now: float) -> None:
        """The prefill answered (2xx) at loop time `now`."""
        self._prefilled_at = now
        if self._deadline is not None:
            self._tighten(now)

    def _tighten(self, since: float) -> None:
        deadline, leg = self._deadline, self._leg
        assert deadline is not None and leg is not None
        bound = since + self._limit
        when = deadline.when()
        if deadline.expired() or (when is not None and when <= bound):
            return
        deadline.reschedule(bound)
        leg.watch(f"{leg.waiting} after the prefill answered", self._limit)


async def decode_beside_prefill(
    prefill: Coroutine[Any, Any, Reply],
    decode: Coroutine[Any, Any, None],
    answered: Callable[[], bool],
    loop: asyncio.AbstractEventLoop,
) -> Reply | None:
    """Run both legs at once; `answered()` says whether the client got any of the decode's
    answer. Returns the prefill's 4xx answer when the client must get it instead of the
    decode's (the decode was cancelled); None when the decode answered. Raises the prefill's
    failure if it came first, else the decode's. Both tasks are done when this returns or
    raises, also when it is cancelled."""
    prefill_task = loop.create_task(prefill)
    decode_task = loop.create_task(decode)
    try:
        await asyncio.wait((prefill_task, decode_task), return_when=asyncio.FIRST_COMPLETED)
        if prefill_task.done() and not answered():
            failure = prefill_task.exception()
            if failure is not None or prefill_task.result().status >= 400:
                await _stop(decode_task)
                if failure is not None:
                    raise failure
                return prefill_task.result()
        await decode_task
        # The client has its answer; the prefill's KV arrived, so its own answer follows
        # (bounded by the prefill leg's timeout). Its failure now only matters to the logs
        # and the outlier detector, which the leg itself already told.
        await asyncio.wait((prefill_task,))
        if not prefill_task.cancelled() and prefill_task.exception() is not None:
            log.info("prefill leg failed after the decode answered: %s", prefill_task.exception())
        return None
    finally:
        await _stop(prefill_task, decode_task)


async def _stop(*tasks: asyncio.Task[Any]) -> None:
    """Cancel those of `tasks` still running, wait until all ended, consume their outcomes."""
    running = [task for task in tasks if not task.done()]
    for task in running:
        task.cancel()
    if running:
        # Shielded from another cancellation of our own task: a leg ends (its connection
        # closed, its slot released) before the request does, promptly once cancelled.
        await asyncio.shield(asyncio.wait(running))
    for task in tasks:
        if not task.cancelled():
            task.exception()
