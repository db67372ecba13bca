"""`pdproxy serve | announce | demo | fake-worker`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from pdproxy import __version__
from pdproxy.compiled import build_description
from pdproxy.config import ConfigError, Settings, add_settings_arguments, load_settings
from pdproxy.logs import configure_logging
from pdproxy.tracing.spans import TracingUnavailable, check_available


def serve(settings: Settings) -> int:
    from pdproxy.proxy.credentials import Credentials, CredentialsError

    configure_logging(settings.log_level, settings.log_format)
    logging.getLogger("pdproxy").info("pdproxy %s, %s", __version__, build_description())
    from pdproxy.single_process import raise_descriptor_limit, serve_single

    raise_descriptor_limit()
    try:
        # Read before anything binds: a missing key file fails the start, not a request.
        credentials = Credentials.from_settings(settings)
    except CredentialsError as exc:
        print(f"pdproxy serve: {exc}", file=sys.stderr)
        return 2
    if settings.workers > 1:
        # The supervisor stays small: the web stack is imported by the workers only.
        from pdproxy.multiworker.supervisor import serve_workers

        return serve_workers(settings)
    return serve_single(settings, credentials)


def _run_serve(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args)
    except ConfigError as exc:
        print(f"pdproxy serve: {exc}", file=sys.stderr)
        return 2
    try:
        check_available(settings.otel_exporter)
    except TracingUnavailable as exc:
        print(f"pdproxy serve: {exc}", file=sys.stderr)
        return 2
    return serve(settings)


def build_parser() -> argparse.ArgumentParser:
    from pdproxy import fake_vllm
    from pdproxy.demo import run as demo
    from pdproxy.vllm_side import announce

    parser = argparse.ArgumentParser(
        prog="pdproxy",
        description="Front door for prefill/decode-disaggregated vLLM fleets.",
    )
    parser.add_argument(
        "--version", action="version", version=f"pdproxy {__version__} ({build_description()})"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve_parser = commands.add_parser(
        "serve",
        help="run the proxy and its registry",
        description="Run the OpenAI-compatible P/D proxy and the ZMQ registry. Every option "
        "can also be set as PDPROXY_<NAME> in the environment or in the YAML file given with "
        "--config; flags win over the environment, which wins over the file.",
    )
    add_settings_arguments(serve_parser)
    serve_parser.set_defaults(func=_run_serve)
    announce.add_cli(commands)
    demo.add_cli(commands)
    fake_vllm.add_cli(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func = args.func
    del args.func, args.command
    result: int = func(args)
    return result
