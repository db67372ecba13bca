"""Registry announcements over ZMQ DEALERs, one per address the registry's name resolves to
(pdproxy.vllm_side.fanout, as the connector and `pdproxy announce`): v0 exactly as stock vLLM,
or v1 with model, geometry and load, and a v1 "leave" to every replica on shutdown.

As the vLLM-side announcer: the name is looked up and everything announced every period, and
a load that changed is announced within LOAD_REPORT_S (a prefill's, with its work, within
PREFILL_WORK_REPORT_S)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from pdproxy.base.roles import Role
from pdproxy.fake_vllm.asyncio_helpers import cancel_task
from pdproxy.fake_vllm.config import WorkerConfig
from pdproxy.registry.auth import new_nonce, signed
from pdproxy.registry.messages import Geometry, KvCoordinates, Load
from pdproxy.vllm_side.announcement import WorkerIdentity, leave_message, v0_message
from pdproxy.vllm_side.announcement import announce_message as worker_announce_message
from pdproxy.vllm_side.announcer import LOAD_REPORT_S, PREFILL_WORK_REPORT_S
from pdproxy.vllm_side.fanout import FanOutClient, announce_resolver

log = logging.getLogger("pdproxy.fake_vllm")


def unsigned_message(cfg: WorkerConfig, op: str, load: Load) -> dict[str, Any]:
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
    return leave_message(identity) if op == "leave" else worker_announce_message(identity, load)


def seal(cfg: WorkerConfig, message: dict[str, Any]) -> dict[str, Any]:
    # v0 stays stock vLLM's bytes: a registry takes it unsigned or not at all.
    if cfg.registry_secret is not None and cfg.announce == "v1":
        return signed(message, cfg.registry_secret, time.time(), new_nonce())
    return message


def announce_message(cfg: WorkerConfig, op: str, load: Load) -> dict[str, Any]:
    return seal(cfg, unsigned_message(cfg, op, load))


def _coordinates(cfg: WorkerConfig) -> KvCoordinates | None:
    # A mooncake prefill serves its bootstrap /query on its own HTTP port.
    if cfg.connector == "mooncake" and cfg.role is Role.PREFILL:
        return KvCoordinates(bootstrap=cfg.http)
    # A nixl_push prefill's side channel, where decodes register, is its KV port.
    if cfg.connector == "nixl_push" and cfg.role is Role.PREFILL:
        return KvCoordinates(engine_id=cfg.engine_id, side_channel=cfg.kv)
    return None


async def announce_forever(
    cfg: WorkerConfig, client: FanOutClient, load: Callable[[], Load]
) -> None:
    loop = asyncio.get_running_loop()
    report_s = PREFILL_WORK_REPORT_S if cfg.role is Role.PREFILL else LOAD_REPORT_S
    tick = min(cfg.announce_interval_s, report_s)
    next_period = 0.0
    announced: dict[str, Any] | None = None
    while True:
        message = unsigned_message(cfg, "announce", load())
        if loop.time() >= next_period:
            next_period = loop.time() + cfg.announce_interval_s
            # The lookup (bounded) on a thread; the sockets stay on this one.
            client.use(await asyncio.to_thread(client.resolve))
        elif message == announced:
            await asyncio.sleep(tick)
            continue
        client.send(seal(cfg, message))  # never waits: a full queue drops it for that replica
        announced = message
        await asyncio.sleep(tick)


async def start_announcing(
    stack: contextlib.AsyncExitStack, cfg: WorkerConfig, load: Callable[[], Load]
) -> None:
    assert cfg.proxy is not None
    # The registry's ROUTER sees this identity frame; stock vLLM uses its zmq_address.
    client = FanOutClient(str(cfg.proxy), str(cfg.kv), announce_resolver(cfg.announce_interval_s))
    stack.callback(client.close)  # after `leave`: it lingers to get out

    def leave() -> None:
        if cfg.announce == "v1":
            client.send(announce_message(cfg, "leave", load()))

    stack.callback(leave)  # runs after the loop below is cancelled
    stack.push_async_callback(
        cancel_task, asyncio.get_running_loop().create_task(announce_forever(cfg, client, load))
    )
