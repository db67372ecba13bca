"""Registry announcements over a ZMQ DEALER: v0 exactly as stock vLLM, or v1 with model,
geometry and load, and a v1 "leave" on shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from pdproxy.base.roles import Role
from pdproxy.fake_vllm.asyncio_helpers import cancel_task
from pdproxy.fake_vllm.config import WorkerConfig
from pdproxy.registry.auth import new_nonce, signed
from pdproxy.registry.messages import Geometry, KvCoordinates, Load
from pdproxy.vllm_side.announcement import WorkerIdentity, leave_message, v0_message
from pdproxy.vllm_side.announcement import announce_message as worker_announce_message

log = logging.getLogger("pdproxy.fake_vllm")

ANNOUNCE_SNDHWM = 16  # a dead registry must not make stale announcements pile up
ANNOUNCE_LINGER_MS = 500  # long enough for a final "leave" to get out, short enough to exit fast
LEAVE_SEND_TIMEOUT_S = 0.5


def announce_message(cfg: WorkerConfig, op: str, load: Load) -> dict[str, Any]:
    identity = WorkerIdentity(
        role=cfg.role,
        http_address=str(cfg.http),
        zmq_address=str(cfg.kv),
        model=cfg.model,
        connector=cfg.connector,
        geometry=Geometry(**asdict(cfg.geometry)),
        max_model_len=cfg.max_model_len,
        coordinates=_coordinates(cfg),
    )
    if cfg.announce == "v0":
        return v0_message(identity)  # byte-for-byte what stock vLLM's P2pNcclEngine sends
    message = leave_message(identity) if op == "leave" else worker_announce_message(identity, load)
    if cfg.registry_secret is not None:
        return signed(message, cfg.registry_secret, time.time(), new_nonce())
    return message


def _coordinates(cfg: WorkerConfig) -> KvCoordinates | None:
    # A mooncake prefill serves its bootstrap /query on its own HTTP port.
    if cfg.connector == "mooncake" and cfg.role is Role.PREFILL:
        return KvCoordinates(bootstrap=cfg.http)
    return None


async def send_frame(sock: zmq.asyncio.Socket, message: dict[str, Any], timeout_s: float) -> bool:
    try:
        await asyncio.wait_for(sock.send(msgpack.packb(message)), timeout_s)
    except TimeoutError:
        log.debug("fake worker: registry not reachable, %s dropped", message.get("op", "announce"))
        return False
    return True


async def announce_forever(
    cfg: WorkerConfig, sock: zmq.asyncio.Socket, load: Callable[[], Load]
) -> None:
    while True:
        message = announce_message(cfg, "announce", load())
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
    load: Callable[[], Load],
) -> None:
    sock = registry_socket(ctx, cfg)
    stack.callback(sock.close, ANNOUNCE_LINGER_MS)

    async def leave() -> None:
        if cfg.announce == "v1":
            await send_frame(sock, announce_message(cfg, "leave", load()), LEAVE_SEND_TIMEOUT_S)

    stack.push_async_callback(leave)  # runs after the loop below is cancelled
    stack.push_async_callback(
        cancel_task, asyncio.get_running_loop().create_task(announce_forever(cfg, sock, load))
    )
