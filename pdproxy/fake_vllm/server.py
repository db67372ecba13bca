"""Running one fake worker: bind its HTTP and KV ports, announce, serve until a signal."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys

import zmq
import zmq.asyncio
from aiohttp import web

from pdproxy.fake_vllm.announce import start_announcing
from pdproxy.fake_vllm.asyncio_helpers import cancel_task
from pdproxy.fake_vllm.config import WorkerConfig
from pdproxy.fake_vllm.kv_transport import kv_socket, serve_kv
from pdproxy.fake_vllm.worker import FakeWorker

HTTP_SHUTDOWN_TIMEOUT_S = 1.0


def zmq_bind_host(host: str) -> str:
    """ZMQ binds to an interface or IP, not a DNS name: resolve names such as "localhost"."""
    try:
        socket.inet_aton(host)
    except OSError:
        return socket.gethostbyname(host)
    return host


async def run_worker(cfg: WorkerConfig) -> int:
    """Serve until SIGTERM/SIGINT (exit 0); 1 if a port cannot be bound."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    ctx = zmq.asyncio.Context()
    worker = FakeWorker(cfg, ctx)
    async with contextlib.AsyncExitStack() as stack:
        # Unwound in reverse order; the context goes last, after every socket is closed.
        stack.callback(ctx.term)
        stack.callback(worker.kv_stats.stop)  # sends what is still queued (own ZMQ contexts)
        stack.callback(worker.kv_sender.close)
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
            stack.callback(loop.remove_signal_handler, signum)

        # One ROUTER serves every flow: pushes arrive here, pulls are answered, nixl_push
        # decodes register.
        kv_router = kv_socket(ctx, zmq.ROUTER)
        stack.callback(kv_router.close, 0)
        runner = web.AppRunner(
            worker.build_app(),
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=HTTP_SHUTDOWN_TIMEOUT_S,
        )
        try:
            kv_router.bind(f"tcp://{zmq_bind_host(cfg.kv.host)}:{cfg.kv.port}")
            await runner.setup()
            stack.push_async_callback(runner.cleanup)
            site = web.TCPSite(runner, cfg.http.host, cfg.http.port, backlog=cfg.http_backlog)
            await site.start()
        except (OSError, zmq.ZMQError) as err:
            print(f"fake-worker: cannot bind: {err}", file=sys.stderr)
            return 1

        serving = serve_kv(
            kv_router,
            worker.kv_store,
            worker.kv_held,
            worker.records,
            worker.kv_stats,
            worker.nixl_push.registered,
        )
        stack.push_async_callback(cancel_task, loop.create_task(serving))
        if cfg.proxy is not None:
            await start_announcing(stack, cfg, worker.load.announced)
        print(
            f"fake-worker ready: role={cfg.role} http={cfg.http} kv={cfg.kv} model={cfg.model} "
            f"connector={cfg.connector} engine_id={worker.engine_id}",
            flush=True,
        )
        await stop.wait()
    return 0
