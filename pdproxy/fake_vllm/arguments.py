"""The `fake-worker` command-line flags, checked by argparse and turned into a WorkerConfig."""

from __future__ import annotations

import argparse
from pathlib import Path

from pdproxy.base.endpoints import Endpoint, EndpointError, parse_endpoint
from pdproxy.base.roles import WIRE_LETTERS, Role
from pdproxy.base.secret_file import read_secret_file
from pdproxy.fake_vllm.config import (
    CONNECTOR_KINDS,
    DEFAULT_HTTP_BACKLOG,
    Geometry,
    WorkerConfig,
)
from pdproxy.ids import Address, make_address


def port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is outside 1..65535")
    return value


def non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def parse_proxy(text: str) -> Endpoint:
    try:
        return parse_endpoint(text)
    except EndpointError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--role", choices=WIRE_LETTERS, required=True, help="prefill (P) or decode (D) worker")
    add(
        "--host",
        default="127.0.0.1",
        help="HTTP bind host, also the announced http_address host (default: %(default)s)",
    )
    add("--port", type=port, required=True, help="HTTP port")
    add(
        "--backlog",
        type=positive_int,
        default=DEFAULT_HTTP_BACKLOG,
        help="HTTP accept queue length, uvicorn's (and so vLLM's) default; the kernel caps it "
        "at net.core.somaxconn (default: %(default)s)",
    )
    add(
        "--kv-port",
        type=port,
        required=True,
        help="KV (ZMQ) port; the worker's zmq_address is KV_HOST:KV_PORT",
    )
    add("--kv-host", default=None, help="KV (ZMQ) bind host (default: --host)")
    add(
        "--proxy",
        type=parse_proxy,
        default=None,
        metavar="[tcp://]HOST:PORT",
        help="registry address; when given, announce to it",
    )
    add(
        "--announce",
        choices=("v0", "v1"),
        default="v0",
        help="announcement format: v0 as stock vLLM, v1 with model/geometry/load; the v1 load is "
        "measured (running requests, waiting 0, kv_usage from --kv-capacity-tokens, and for a "
        "prefill prefill_tokens, the prompt tokens in flight) unless a test forces it with POST "
        '/_fake/load {"running": N, "waiting": N, "kv_usage": 0..1, "prefill_tokens": N} (a '
        "null or absent field stays measured; GET /_fake/load shows both) "
        "(default: %(default)s)",
    )
    add(
        "--announce-interval",
        type=positive,
        default=3.0,
        metavar="SECONDS",
        help="seconds between announcements (default: %(default)s)",
    )
    add(
        "--registry-secret-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="file holding the registry secret; when given, v1 messages are signed",
    )
    add("--model", default="fake-model", help="served model name (default: %(default)s)")
    add(
        "--token-latency-ms",
        type=non_negative,
        default=0.0,
        metavar="MS",
        help="sleep per generated token (default: %(default)s)",
    )
    add(
        "--prefill-latency-ms",
        type=non_negative,
        default=0.0,
        metavar="MS",
        help="sleep before the first token, simulating prompt processing (default: %(default)s)",
    )
    add(
        "--kv-timeout",
        type=positive,
        default=5.0,
        metavar="SECONDS",
        help="how long a decode worker waits for a request's KV payload, and how long a nixl "
        "or pdproxy prefill holds one for its decode to read (default: %(default)s)",
    )
    add(
        "--max-model-len",
        type=positive_int,
        default=4096,
        help="context length, announced: max_tokens may not exceed it, a prompt may not exceed it, "
        "the output is cut to what it leaves (vLLM 0.32; default: %(default)s)",
    )
    add(
        "--kv-capacity-tokens",
        type=positive_int,
        default=65536,
        metavar="TOKENS",
        help="KV cache size: the announced kv_usage is the in-flight prompt and generated "
        "tokens over this, at most 1 (default: %(default)s)",
    )
    geometry = parser.add_argument_group(
        "KV connector and geometry (announced in v1, carried with the KV and checked by a decode)"
    )
    add = geometry.add_argument
    add(
        "--connector",
        choices=CONNECTOR_KINDS,
        default="p2p_nccl",
        help="p2p_nccl: the prefill pushes KV to the decode named in X-Request-Id; nixl and "
        "pdproxy: the decode reads it from the prefill named in kv_transfer_params; "
        "nixl_push: the decode registers with the prefill named there, which writes the KV "
        "into it (default: %(default)s)",
    )
    add(
        "--engine-id",
        help="the KV connector's engine id (default: a fresh uuid per start, as vLLM's); a "
        "nixl_push prefill announces it with its side channel (its KV port)",
    )
    add(
        "--tp-size",
        type=positive_int,
        default=1,
        help="tensor-parallel size (default: %(default)s)",
    )
    add("--block-size", type=positive_int, default=16, help="KV block size (default: %(default)s)")
    add("--num-layers", type=positive_int, default=2, help="layers (default: %(default)s)")
    add(
        "--num-kv-heads", type=positive_int, default=2, help="total KV heads (default: %(default)s)"
    )
    add("--head-dim", type=positive_int, default=32, help="head dimension (default: %(default)s)")
    add("--kv-dtype", default="float16", help="KV cache dtype (default: %(default)s)")
    add("--mla", action="store_true", help="announce an MLA (latent) KV cache")
    add(
        "--kv-layout",
        choices=("NHD", "HND"),
        default="NHD",
        help="KV layout (default: %(default)s)",
    )


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """Raises AddressError when the KV address could not be carried in a request id, and
    SecretError when the registry secret file cannot be read."""
    secret_file = args.registry_secret_file
    kv_host = args.kv_host if args.kv_host is not None else args.host
    return WorkerConfig(
        role=Role.from_wire(args.role),
        http=Address(args.host, args.port),
        kv=make_address(kv_host, args.kv_port),
        proxy=args.proxy,
        announce=args.announce,
        announce_interval_s=args.announce_interval,
        model=args.model,
        token_latency_s=args.token_latency_ms / 1000.0,
        prefill_latency_s=args.prefill_latency_ms / 1000.0,
        kv_timeout_s=args.kv_timeout,
        max_model_len=args.max_model_len,
        kv_capacity_tokens=args.kv_capacity_tokens,
        connector=args.connector,
        geometry=Geometry(
            tp_size=args.tp_size,
            block_size=args.block_size,
            num_layers=args.num_layers,
            num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            kv_dtype=args.kv_dtype,
            is_mla=args.mla,
            kv_layout=args.kv_layout,
        ),
        registry_secret=None if secret_file is None else read_secret_file(secret_file),
        http_backlog=args.backlog,
        **({} if args.engine_id is None else {"engine_id": args.engine_id}),
    )
