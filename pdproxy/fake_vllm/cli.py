"""`pdproxy fake-worker` and `python -m pdproxy.fake_vllm`: flags in, exit code out."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from pdproxy.base.secret_file import SecretError
from pdproxy.fake_vllm.arguments import add_arguments, config_from_args
from pdproxy.ids import AddressError

# aiohttp serves the fake worker and nothing else in pdproxy, so a plain install goes without it.
EXTRA_MISSING = "the fake worker needs aiohttp: pip install 'pdproxy[fake-worker]'"

DESCRIPTION = (
    "Run a fake vLLM prefill or decode worker: OpenAI endpoints with deterministic text, "
    "P2pNcclConnector-style (push by request id) or NixlConnector-style (kv_transfer_params, "
    "decode reads) KV handoff over ZMQ with a geometry check, registry announcements, and "
    "/_fake/ control endpoints for tests. Needs the fake-worker extra: "
    "pip install 'pdproxy[fake-worker]'."
)


def aiohttp_missing() -> bool:
    """True when the fake-worker extra is not installed (`pdproxy demo` asks too)."""
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        return True
    return False


def run_from_args(args: argparse.Namespace) -> int:
    """Entry point for `pdproxy fake-worker`; returns the process exit code."""
    if aiohttp_missing():
        print(f"fake-worker: {EXTRA_MISSING}", file=sys.stderr)
        return 2
    from pdproxy.fake_vllm.server import run_worker

    try:
        cfg = config_from_args(args)
    except AddressError as err:
        print(f"fake-worker: bad KV address: {err}", file=sys.stderr)
        return 2
    except SecretError as err:
        print(f"fake-worker: {err}", file=sys.stderr)
        return 2
    return asyncio.run(run_worker(cfg))


def add_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `fake-worker` subcommand; its `func` default runs the worker."""
    parser = subparsers.add_parser(
        "fake-worker", help="run a fake vLLM worker (tests, demo)", description=DESCRIPTION
    )
    add_arguments(parser)
    parser.set_defaults(func=run_from_args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdproxy.fake_vllm", description=DESCRIPTION)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))
