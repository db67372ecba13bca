"""Small asyncio helpers shared by the request path and the background tasks."""

from __future__ import annotations

import asyncio
import contextlib
import logging

log = logging.getLogger("pdproxy.fake_vllm")


async def sleep(seconds: float | None) -> None:
    if seconds:
        await asyncio.sleep(seconds)


async def cancel_task(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    if not task.cancelled() and task.exception() is not None:
        log.error("fake worker: background task failed", exc_info=task.exception())
