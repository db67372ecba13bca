"""Stopping a background task: the one way the proxy's loops end theirs."""

from __future__ import annotations

import asyncio
import contextlib


async def stop_task(task: asyncio.Task[None] | None) -> None:
    """Cancel `task` (nothing if None) and wait until it has ended; its cancellation stays
    here, and a failure it ended with is raised."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
