"""Registry announcements over a ZMQ DEALER: v0 exactly as stock vLLM, or v1 with model,
geometry and load, and a v1 "leave" on shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from pdproxy.testing.fake_worker.asyncio_helpers import cancel_task
from pdproxy.testing.fake_worker.config import WorkerConfig

log = logging.getLogger("pdproxy.testing.fake_worker")

ANNOUNCE_SNDHWM = 16  # a dead registry must not make stale announcements pile up
ANNOUNCE_LINGER_MS = 500  # long enough for a final "leave" to get out, short enough to exit fast
LEAVE_SEND_TIMEOUT_S = 0.5


def announce_message(cfg: WorkerConfig, op: str, running: int) -> dict[str, Any]:
    base = {"type": cfg.role, "http_address": str(cfg.http), "zmq_address": str(cfg.kv)}
    if cfg.announce == "v0":
        return base  # byte-for-byte what stock vLLM's P2pNcclEngine sends
    message: dict[str, Any] = {"v": 1, "op": op, **base}
    if op == "announce":
        geometry = cfg.geometry
        message |= {
            "model": cfg.model,
            "connector": cfg.connector,
            "geometry": {
                "tp_size": geometry.tp_size,
                "block_size": geometry.block_size,
                "num_layers": geometry.num_layers,
                "num_kv_heads": geometry.num_kv_heads,
                "head_dim": geometry.head_dim,
                "kv_dtype": geometry.kv_dtype,
                "is_mla": geometry.is_mla,
                "kv_layout": geometry.kv_layout,
            },
            "load": {"running": running, "waiting": 0, "kv_usage": 0.0},
        }
    return message


async def send_frame(sock: zmq.asyncio.Socket, message: dict[str, Any], timeout_s: float) -> bool:
    try:
        await asyncio.wait_for(sock.send(msgpack.packb(message)), timeout_s)
    except TimeoutError:
        log.debug("fake worker: registry not reachable, %s dropped", message.get("op", "announce"))
        return False
    return True


async def announce_forever(
    cfg: WorkerConfig, sock: zmq.asyncio.Socket, running: Callable[[], int]
) -> None:
    while True:
        message = announce_message(cfg, "announce", running())
        await send_frame(sock, message, cfg.announce_interval_s)
        await asyncio.sleep(cfg.announce_interval_s)


def registry_socket(ctx: zmq.asyncio.Context, cfg: WorkerConfig) -> zmq.asyncio.Socket:
    assert cfg.proxy is not None
    sock = ctx.socket(zmq.DEALER)
    # The registry's ROUTER sees this identity frame; stock vLLM uses its zmq_address.
    sock.setsockopt(zmq.IDENTITY, str(cfg.kv).encode())
    sock.setsockopt(zmq.LINGER, ANNOUNCE_LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, ANNOUNCE_SNDHWM)
    sock.connect(f"tcp://{cfg.proxy}")
    return sock


async def start_announcing(
    stack: contextlib.AsyncExitStack,
    ctx: zmq.asyncio.Context,
    cfg: WorkerConfig,
    running: Callable[[], int],
) -> None:
    sock = registry_socket(ctx, cfg)
    stack.callback(sock.close, ANNOUNCE_LINGER_MS)

    async def leave() -> None:
        if cfg.announce == "v1":
            await send_frame(sock, announce_message(cfg, "leave", 0), LEAVE_SEND_TIMEOUT_S)

    stack.push_async_callback(leave)  # runs after the loop below is cancelled
    stack.push_async_callback(
        cancel_task, asyncio.get_running_loop().create_task(announce_forever(cfg, sock, running))
    )
