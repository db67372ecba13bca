"""`pdproxy demo`: a proxy and a fake 2P x 2D fleet on loopback, two sample requests through the
official `openai` client, then serve until Ctrl-C (or exit at once with --once)."""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from pdproxy.demo.fleet import LocalFleet, WorkerSpec
from pdproxy.fake_vllm.cli import aiohttp_missing

DEMO_MODEL = "demo-model"
PROMPT = "Explain prefill/decode disaggregation in one line."


def add_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run the proxy with a fake 2P x 2D fleet on loopback",
        description="Start pdproxy plus two fake prefill and two fake decode workers on "
        "127.0.0.1 (one of each announcing like stock vLLM, v0; the other with pdproxy's v1), "
        "send a streaming and a non-streaming request with the openai client, then keep "
        "serving until Ctrl-C.",
    )
    parser.add_argument("--port", type=int, default=8000, help="proxy HTTP port (default 8000)")
    parser.add_argument(
        "--registry-port",
        type=int,
        default=None,
        help="registry port (default: a free one; workers are told where it is)",
    )
    parser.add_argument(
        "--token-latency-ms", type=float, default=20.0, help="fake per-token latency (default 20)"
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="where process logs go and stay (default: a temporary directory, removed on exit)",
    )
    parser.add_argument(
        "--once", action="store_true", help="exit after the sample requests (for scripts)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        from openai import OpenAI
    except ImportError:
        print("pdproxy demo needs the openai client: pip install 'pdproxy[demo]'", file=sys.stderr)
        return 2
    if aiohttp_missing():  # checked here: the fake workers would each fail on their own
        print(
            "pdproxy demo needs aiohttp for its workers: pip install 'pdproxy[demo]'",
            file=sys.stderr,
        )
        return 2
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdproxy-demo-"))
    code = _run_fleet(args, log_dir, OpenAI)
    if args.log_dir is None and code == 0:
        shutil.rmtree(log_dir, ignore_errors=True)  # kept when something failed: read them
    elif code != 0:
        print(f"the processes' logs are in {log_dir}", file=sys.stderr)
    return code


def _run_fleet(args: argparse.Namespace, log_dir: Path, openai_client: Any) -> int:
    specs = [
        WorkerSpec(role, announce, DEMO_MODEL, token_latency_ms=args.token_latency_ms)
        for role in ("P", "D")
        for announce in ("v0", "v1")
    ]
    fleet = LocalFleet(log_dir, specs, proxy_port=args.port, registry_port=args.registry_port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"starting pdproxy on 127.0.0.1:{args.port} with 2 prefill + 2 decode fake workers")
    try:
        fleet.start()
        print(f"registry on {fleet.registry_address}")
        for worker in fleet.workers:
            print(
                f"  {worker.spec.role} {worker.http_address} kv {worker.zmq_address} "
                f"announces {worker.spec.announce}"
            )
        client = openai_client(
            base_url=fleet.proxy_url + "/v1", api_key="demo", timeout=30, max_retries=0
        )
        _sample_requests(client)
        if args.once:
            return 0
        print(_curl(fleet.proxy_url))
        kept = "" if args.log_dir else " (removed on exit)"
        print(f"the processes' logs are in {log_dir}{kept}")
        print("serving; press Ctrl-C to stop")
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    except Exception as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    finally:
        print("stopping the fleet")
        fleet.stop()
    return 0


def _sample_requests(client: Any) -> None:
    print("\n--- non-streaming /v1/completions")
    completion = client.completions.create(model=DEMO_MODEL, prompt=PROMPT, max_tokens=12)
    print(f"id:   {completion.id}")
    print(f"text: {completion.choices[0].text!r}")
    print("\n--- streaming /v1/chat/completions")
    stream = client.chat.completions.create(
        model=DEMO_MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    print("text: ", end="", flush=True)
    usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage is not None:
            usage = chunk.usage
    print(f"\nusage: {usage}")


def _curl(url: str) -> str:
    return (
        "\nTry it yourself:\n"
        f"  curl -s {url}/v1/completions -H 'Content-Type: application/json' \\\n"
        f'    -d \'{{"model": "{DEMO_MODEL}", "prompt": "Hello", "max_tokens": 8}}\'\n'
        f"  curl -sN {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f'    -d \'{{"model": "{DEMO_MODEL}", "messages": [{{"role": "user", '
        f'"content": "Hi"}}], "stream": true}}\'\n'
        f"  curl -s {url}/v1/instances; curl -s {url}/metrics | grep pdproxy_\n"
    )
