"""`pdproxy announce`: the registry sidecar for a stock vLLM server, which itself sends only v0.

It announces v1 for one server: its role, addresses, connector kind, model and geometry (from
flags or the model's config.json), its context length (a flag, else the server's /v1/models),
with the load scraped each period from the server's own /metrics. While the server does not
answer it keeps announcing, marked unhealthy, so the proxy stops routing there without
forgetting the instance; on SIGTERM or SIGINT it sends `leave`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

from pdproxy.base.endpoints import EndpointError, parse_endpoint
from pdproxy.base.roles import WIRE_LETTERS, Role
from pdproxy.base.secret_file import SECRET_ENV, read_secret_file, secret_from_text
from pdproxy.ids import AddressError, parse_address
from pdproxy.registry.messages import (
    MAX_DTYPE_NAME,
    MAX_ENGINE_ID,
    Connector,
    Geometry,
    KvCoordinates,
    known_fields,
    missing_coordinates,
)
from pdproxy.vllm_side.announcement import WorkerIdentity, context_length
from pdproxy.vllm_side.announcer import DEFAULT_INTERVAL_S, Announcer, LoadSample
from pdproxy.vllm_side.bounded_get import get_within
from pdproxy.vllm_side.fanout import FanOutClient, announce_resolver
from pdproxy.vllm_side.model_config import ModelConfigError, geometry_from_model_config
from pdproxy.vllm_side.vllm_metrics import MetricsFormatError, load_from_metrics

log = logging.getLogger("pdproxy.announce")

# Every kind the registry knows: a kind added there is announceable without a change here.
CONNECTOR_KINDS = tuple(kind.value for kind in Connector)
MAX_METRICS_BYTES = 8 * 1024 * 1024  # a /metrics page larger than this is not vLLM's
MAX_MODELS_BYTES = 1024 * 1024  # nor a /v1/models list larger than this
DEFAULT_UNHEALTHY_AFTER_S = 30.0


class MetricsScraper:
    """The load from the server's /metrics. A server that refuses the connection or answers
    something else is announced unhealthy at once. One that is only slow (a busy vLLM's API
    server can take seconds for /metrics) keeps its last load, healthy, for `unhealthy_after`
    seconds of timed-out scrapes: taking a busy instance out of the rotation would pile its
    traffic onto the others (the proxy's own probes and outlier ejection judge its answers)."""

    def __init__(
        self,
        url: str,
        timeout_s: float,
        unhealthy_after_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._url = url
        self._timeout = timeout_s
        self._unhealthy_after = unhealthy_after_s
        self._clock = clock
        self._was_healthy: bool | None = None
        self._last: LoadSample | None = None  # the last scrape that answered
        self._last_at = 0.0
        self._slow = False

    def __call__(self) -> LoadSample:
        try:
            page = get_within(self._url, self._timeout, MAX_METRICS_BYTES)
            sample = LoadSample(load_from_metrics(page.decode("utf-8", "replace")))
        except (OSError, MetricsFormatError, ValueError) as exc:
            sample = self._failed(exc)
        else:
            self._last, self._last_at = sample, self._clock()
            if self._slow and self._was_healthy is not False:
                log.info("%s answers in time again", self._url)
            self._slow = False
        if sample.healthy and self._was_healthy is False:
            log.info("%s answers again", self._url)
        self._was_healthy = sample.healthy
        return sample

    def _failed(self, exc: Exception) -> LoadSample:
        last = self._last
        if scrape_timed_out(exc) and last is not None:
            slow_for = self._clock() - self._last_at
            if slow_for < self._unhealthy_after:
                if not self._slow:
                    log.warning(
                        "%s slow (%s): announcing its last load, healthy, for up to %gs",
                        self._url,
                        exc,
                        self._unhealthy_after,
                    )
                self._slow = True
                return LoadSample(last.load)
        if self._was_healthy is not False:
            log.warning("%s unreachable (%s): announcing it unhealthy", self._url, exc)
        return LoadSample(None, healthy=False)


def scrape_timed_out(exc: Exception) -> bool:
    """A scrape that ran out of time (the server is there but slow), not a refusal."""
    return isinstance(exc, TimeoutError)


def context_length_from_models(body: bytes, model: str | None) -> int | None:
    """The max_model_len vLLM's /v1/models lists for `model` (None: its first model), if it
    lists a valid one."""
    try:
        listing = json.loads(body)
    except ValueError:
        return None
    entries = listing.get("data") if isinstance(listing, dict) else None
    for entry in entries if isinstance(entries, list) else ():
        if isinstance(entry, dict) and (model is None or entry.get("id") == model):
            return context_length(entry.get("max_model_len"))
    return None


class ContextLengthProbe:
    """The server's context length, read from its /v1/models until known, and again after
    the server was unreachable (it may have come back with another --max-model-len)."""

    def __init__(self, url: str, model: str | None, timeout_s: float) -> None:
        self._url = url
        self._model = model
        self._timeout = timeout_s
        self._known: int | None = None
        self._stale = True

    def __call__(self, healthy: bool) -> int | None:
        if not healthy:
            self._stale = True
        elif self._stale:
            fetched = self._fetch()
            if fetched is not None:
                if fetched != self._known:
                    log.info("%s: max_model_len %d", self._url, fetched)
                self._known, self._stale = fetched, False
        return self._known

    def _fetch(self) -> int | None:
        try:
            body = get_within(self._url, self._timeout, MAX_MODELS_BYTES)
        except (OSError, ValueError) as exc:
            log.debug("%s: %s", self._url, exc)
            return None
        return context_length_from_models(body, self._model)


def add_cli(commands: Any) -> None:
    parser = commands.add_parser(
        "announce",
        help="announce a stock vLLM server to the registry (sidecar)",
        description="Announce one vLLM server to a pdproxy registry (v1: model, connector, "
        "geometry, load scraped from its /metrics) until SIGTERM, then send 'leave'.",
    )
    parser.add_argument(
        "--role", choices=WIRE_LETTERS, required=True, help="prefill (P) or decode (D)"
    )
    parser.add_argument("--http-address", required=True, help="the server's HOST:PORT")
    parser.add_argument(
        "--zmq-address", required=True, help="the KV endpoint of TP rank 0, HOST:PORT"
    )
    parser.add_argument(
        "--registry",
        required=True,
        help="the pdproxy registry, [tcp://]HOST:PORT; a HOST that resolves to several "
        "addresses (a headless Service) gets the announcements at each, looked up again every "
        "period",
    )
    parser.add_argument("--model", help="the served model name (default: what its /v1/models says)")
    parser.add_argument(
        "--connector",
        choices=CONNECTOR_KINDS,
        default="p2p_nccl",
        help="the server's KV connector (default: %(default)s)",
    )
    coordinates = parser.add_argument_group(
        "where a prefill's connector is reached (mooncake: --bootstrap; nixl_push: --engine-id "
        "and --side-channel)"
    )
    coordinates.add_argument(
        "--bootstrap", help="mooncake: the prefill's bootstrap server, HOST:PORT"
    )
    coordinates.add_argument("--engine-id", help="nixl_push: the prefill's NIXL engine id")
    coordinates.add_argument(
        "--side-channel", help="nixl_push: the prefill's NIXL side channel, HOST:PORT"
    )
    geometry = parser.add_argument_group(
        "KV geometry (pairing needs it: --model-config gives the model's part, the flags the "
        "rest, and a flag overrides the file)"
    )
    geometry.add_argument(
        "--model-config", type=Path, help="the model's config.json (layers, KV heads, head_dim)"
    )
    geometry.add_argument("--tp-size", type=_positive_int, help="vLLM's tensor parallel size")
    geometry.add_argument("--block-size", type=_positive_int, help="vLLM's --block-size")
    geometry.add_argument("--num-layers", type=_positive_int, help="attention layers")
    geometry.add_argument(
        "--num-kv-heads", type=_positive_int, help="KV heads, total over all ranks"
    )
    geometry.add_argument("--head-dim", type=_positive_int, help="size of one attention head")
    geometry.add_argument("--kv-dtype", help="the KV cache's dtype, e.g. bfloat16 or fp8")
    geometry.add_argument(
        "--kv-layout", choices=["NHD", "HND"], help="the KV cache's memory layout"
    )
    geometry.add_argument(
        "--mla", action="store_true", default=None, help="an MLA (latent) KV cache"
    )
    parser.add_argument(
        "--max-model-len",
        type=_positive_int,
        help="the server's context length (default: what its /v1/models says)",
    )
    parser.add_argument(
        "--metrics-url",
        help="where the load is scraped from (default: http://HTTP_ADDRESS/metrics)",
    )
    parser.add_argument(
        "--interval",
        type=_positive_float,
        default=DEFAULT_INTERVAL_S,
        help="seconds between announcements (default: %(default)s)",
    )
    parser.add_argument(
        "--scrape-timeout",
        type=_positive_float,
        default=2.0,
        help="seconds one scrape of the server may take (default: %(default)s)",
    )
    parser.add_argument(
        "--unhealthy-after",
        type=_positive_float,
        default=DEFAULT_UNHEALTHY_AFTER_S,
        help="seconds of scrapes timing out before a slow server is announced unhealthy; "
        "until then its last load is (a refused connection counts at once; default: "
        "%(default)s)",
    )
    parser.add_argument(
        "--registry-secret-file",
        type=Path,
        help="file holding the registry secret to sign messages with (or set "
        f"{SECRET_ENV}); never passed as a flag value, which `ps` would show",
    )
    parser.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default="info",
        help="(default: %(default)s)",
    )
    parser.set_defaults(func=run)


def build_identity(args: argparse.Namespace) -> WorkerIdentity:
    for name in ("http_address", "zmq_address", "bootstrap", "side_channel"):
        text = getattr(args, name, None)
        if text is None:
            continue
        try:
            parse_address(text)
        except AddressError as exc:
            raise ValueError(f"--{name.replace('_', '-')}: {exc}") from None
    try:
        parse_endpoint(args.registry)
    except EndpointError as exc:
        raise ValueError(f"--registry: {exc}") from None
    geometry = _geometry(args)
    coordinates = _coordinates(args)
    if args.max_model_len is not None and context_length(args.max_model_len) is None:
        # The registry would refuse every announcement: say so now.
        raise ValueError(f"--max-model-len {args.max_model_len} is beyond any real context")
    return WorkerIdentity(
        role=Role.from_wire(args.role),
        http_address=args.http_address,
        zmq_address=args.zmq_address,
        model=args.model,
        connector=args.connector,
        geometry=geometry,
        max_model_len=args.max_model_len,
        coordinates=coordinates,
    )


def _coordinates(args: argparse.Namespace) -> KvCoordinates | None:
    """Where the prefill's connector is reached; refused now when its kind needs more (the
    registry would refuse every announcement)."""
    bootstrap, engine_id, side_channel = args.bootstrap, args.engine_id, args.side_channel
    if engine_id is not None and not 0 < len(engine_id) <= MAX_ENGINE_ID:
        raise ValueError(f"--engine-id must be 1 to {MAX_ENGINE_ID} characters")
    given = (bootstrap, engine_id, side_channel)
    coordinates = (
        None
        if all(value is None for value in given)
        else KvCoordinates(
            bootstrap=None if bootstrap is None else parse_address(bootstrap),
            engine_id=engine_id,
            side_channel=None if side_channel is None else parse_address(side_channel),
        )
    )
    if Role.from_wire(args.role) is Role.PREFILL:
        missing = missing_coordinates(Connector(args.connector), coordinates)
        if missing:
            flags = ", ".join(f"--{name.replace('_', '-')}" for name in missing.split(", "))
            raise ValueError(f"a {args.connector} prefill needs {flags}")
    return coordinates


def registry_secret(args: argparse.Namespace, environ: Mapping[str, str]) -> bytes | None:
    """From --registry-secret-file, else the environment; None: messages go unsigned."""
    if args.registry_secret_file is not None:
        return read_secret_file(args.registry_secret_file)
    text = environ.get(SECRET_ENV)
    if text is None:
        return None
    return secret_from_text(text.encode(), SECRET_ENV)


def _geometry(args: argparse.Namespace) -> Geometry:
    if args.model_config is not None:
        try:
            config = json.loads(args.model_config.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"--model-config {args.model_config}: {exc}") from None
        if not isinstance(config, dict):
            raise ValueError(f"--model-config {args.model_config}: not a JSON object")
        try:
            base = geometry_from_model_config(config)
        except ModelConfigError as exc:
            raise ValueError(str(exc)) from None
    else:
        base = Geometry()
    # Flags win over config.json: they describe how this server runs the model.
    flags = {
        "tp_size": args.tp_size,
        "block_size": args.block_size,
        "num_layers": args.num_layers,
        "num_kv_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "kv_dtype": args.kv_dtype,
        "is_mla": args.mla,
        "kv_layout": args.kv_layout,
    }
    fields = known_fields(base) | {key: value for key, value in flags.items() if value is not None}
    dtype = fields.get("kv_dtype")
    if dtype is not None and len(dtype) > MAX_DTYPE_NAME:
        # The registry would refuse every announcement: say so now, not in the proxy's log.
        raise ValueError(f"kv dtype {dtype[:40]!r}... is longer than {MAX_DTYPE_NAME} characters")
    return Geometry(**fields)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        # Timed, as the proxy's own lines: an announcement gap shows up against its registry.
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        identity = build_identity(args)
        secret = registry_secret(args, os.environ)
    except ValueError as exc:
        print(f"pdproxy announce: {exc}", file=sys.stderr)
        return 2
    client = FanOutClient(args.registry, args.zmq_address, announce_resolver(args.interval))
    announcer = Announcer(client, identity, _sampler(args), args.interval, secret=secret)

    def stop(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: leaving the registry", signum)
        announcer.request_stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info(
        "announcing %s (%s) to %s%s",
        args.http_address,
        args.role,
        args.registry,
        ", signed" if secret is not None else "",
    )
    try:
        announcer.run()
    finally:
        client.close()
    return 0


def _sampler(args: argparse.Namespace) -> Callable[[], LoadSample]:
    """Each period: the load from /metrics, and the context length from /v1/models unless
    --max-model-len gave it."""
    scraper = MetricsScraper(
        args.metrics_url or f"http://{args.http_address}/metrics",
        args.scrape_timeout,
        args.unhealthy_after,
    )
    if args.max_model_len is not None:
        return scraper
    probe = ContextLengthProbe(
        f"http://{args.http_address}/v1/models", args.model, args.scrape_timeout
    )

    def sample() -> LoadSample:
        taken = scraper()
        taken.max_model_len = probe(taken.healthy)
        return taken

    return sample


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be a positive integer")
    return value


MAX_SECONDS = 3600.0  # an announce period or scrape timeout beyond an hour is a typo


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"must be in (0, {MAX_SECONDS:g}] seconds")
    return value
