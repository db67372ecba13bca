"""`pdproxy announce` as a real process: a stock-vLLM stand-in (an HTTP server in this test
serving vLLM-format /metrics) beside it, a real `pdproxy serve` receiving its v1 announcements.

Every process is stopped by PID in a fixture; every wait is a bounded poll.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from pdproxy.demo.fleet import LocalFleet
from pdproxy.demo.processes import (
    LOOPBACK,
    ManagedProcess,
    free_port,
    free_ports,
    http_get,
    http_json,
    pdproxy_command,
    wait_until,
)
from tests.conftest import FleetFactory
from tests.integration.support import post_json

MODEL = "tiny-llama"
INTERVAL = "0.2"
TRICKLE_PIECES = 20
WAIT = 10.0  # bound on every poll; the behaviour itself takes a few intervals

# A small Llama: 4 layers, 2 KV heads of 256 / 8 = 32 dims, float16 weights.
TINY_LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_attention_heads": 8,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "torch_dtype": "float16",
    "vocab_size": 32000,
}

EXPECTED_GEOMETRY = {
    "tp_size": 2,  # flags
    "block_size": 16,
    "kv_layout": "HND",
    "num_layers": 4,  # config.json
    "num_kv_heads": 2,
    "head_dim": 32,
    "kv_dtype": "float16",
    "is_mla": False,
}


def vllm_metrics(running: int, waiting: int, usage: float) -> str:
    """What vLLM 0.32's /metrics looks like for one engine (the parts that matter and some
    that must be ignored)."""
    labels = f'engine="0",model_name="{MODEL}"'
    return f"""\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{{generation="0"}} 3571.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{labels}}} {float(running)}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{{labels}}} {float(waiting)}
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{{labels}}} {usage}
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{{labels}}} 1024.0
# HELP vllm:prompt_tokens_created Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{{{labels}}} 1.7530123456789e+09
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{{{labels},le="1.0"}} 2.0
vllm:e2e_request_latency_seconds_bucket{{{labels},le="+Inf"}} 3.0
vllm:e2e_request_latency_seconds_count{{{labels}}} 3.0
vllm:e2e_request_latency_seconds_sum{{{labels}}} 4.5
"""


class FakeVllmServer:
    """GET /metrics answers whatever text the test set last, `delay` seconds late (a busy
    vLLM's API server), or in TRICKLE_PIECES pieces `trickle` seconds apart; GET /v1/models
    the model list it set (404 until then); stop() closes the port (so the sidecar's scrape is
    refused) and start() opens the same port again."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._text = vllm_metrics(0, 0, 0.0)
        self._lock = threading.Lock()
        self.scrapes = 0
        self.delay = 0.0
        self.trickle = 0.0
        self.models: dict[str, Any] | None = None
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def http_address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def set_text(self, text: str) -> None:
        with self._lock:
            self._text = text

    def _answer(self) -> bytes:
        with self._lock:
            self.scrapes += 1
            return self._text.encode()

    def start(self) -> FakeVllmServer:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/v1/models" and owner.models is not None:
                    body = json.dumps(owner.models).encode()
                elif self.path == "/metrics":
                    time.sleep(owner.delay)
                    body = owner._answer()
                else:
                    self.send_error(404)
                    return
                # The sidecar may have given up on a late answer: its write then fails.
                with contextlib.suppress(OSError):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    step = len(body) // TRICKLE_PIECES + 1 if owner.trickle else len(body)
                    for start in range(0, len(body), step):
                        self.wfile.write(body[start : start + step])
                        self.wfile.flush()
                        time.sleep(owner.trickle)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer((LOOPBACK, self.port), Handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None


@pytest.fixture
def vllm_server() -> Iterator[FakeVllmServer]:
    server = FakeVllmServer(free_port()).start()
    try:
        yield server
    finally:
        server.stop()


Starter = Callable[..., ManagedProcess]


@pytest.fixture
def announcers(tmp_path: Path) -> Iterator[Starter]:
    """Start `pdproxy announce` processes; each is stopped by PID at teardown."""
    started: list[ManagedProcess] = []

    def start(*args: str) -> ManagedProcess:
        name = f"announce{len(started)}"
        process = ManagedProcess(name, pdproxy_command("announce", *args), tmp_path / f"{name}.log")
        started.append(process)
        return process.start()

    yield start
    for process in reversed(started):
        process.stop()


def static_prefill() -> str:
    """A static prefill serving MODEL: with it, /ready depends on the announced decode."""
    http_port, zmq_port = free_ports(2)
    return f"http={LOOPBACK}:{http_port},zmq={LOOPBACK}:{zmq_port},model={MODEL}"


def start_proxy(fleet_factory: FleetFactory) -> LocalFleet:
    # A TTL far longer than any wait below: whatever removes the instance is not expiry. The
    # static prefill's geometry is unknown, so it may pair with the announced decode only if
    # unknown geometry is allowed.
    return fleet_factory(
        [],
        proxy_args=["--ttl", "60", "--prefill", static_prefill(), "--allow-unknown-geometry"],
    )


def write_model_config(directory: Path, config: object = TINY_LLAMA_CONFIG) -> Path:
    path = directory / "config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    return path


def announce_args(
    fleet: LocalFleet, server: FakeVllmServer, model_config: Path, zmq_port: int
) -> list[str]:
    return announce_args_for(fleet, server.http_address, model_config, zmq_port)


def announce_args_for(
    fleet: LocalFleet, http_address: str, model_config: Path, zmq_port: int
) -> list[str]:
    return [
        "--role",
        "D",
        "--http-address",
        http_address,
        "--zmq-address",
        f"{LOOPBACK}:{zmq_port}",
        "--registry",
        fleet.registry_address,
        "--model",
        MODEL,
        "--connector",
        "nixl",
        "--model-config",
        str(model_config),
        "--tp-size",
        "2",
        "--block-size",
        "16",
        "--kv-layout",
        "HND",
        "--interval",
        INTERVAL,
        "--scrape-timeout",
        "1",
    ]


def instance(fleet: LocalFleet, http_address: str) -> dict[str, Any] | None:
    data = http_json(fleet.proxy_url + "/v1/instances", timeout=5)
    for item in data["instances"]:
        if item["http_address"] == http_address:
            found: dict[str, Any] = item
            return found
    return None


def wait_instance(
    fleet: LocalFleet,
    http_address: str,
    predicate: Callable[[dict[str, Any] | None], bool],
    what: str,
    processes: list[ManagedProcess],
    timeout: float = WAIT,
) -> dict[str, Any] | None:
    seen: list[dict[str, Any] | None] = [None]

    def check() -> bool:
        seen[0] = instance(fleet, http_address)
        return predicate(seen[0])

    wait_until(check, timeout, f"{what} (last seen: {seen[0]})", processes)
    return seen[0]


def ready_status(fleet: LocalFleet) -> int:
    return http_get(fleet.proxy_url + "/ready", timeout=5)[0]


def completion_error_code(fleet: LocalFleet) -> tuple[int, str | None]:
    answer = post_json(
        fleet.proxy_url + "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    )
    code = answer.json().get("error", {}).get("code") if answer.status != 200 else None
    return answer.status, code


def test_announces_v1_identity_geometry_and_live_load(
    fleet_factory: FleetFactory,
    vllm_server: FakeVllmServer,
    announcers: Starter,
    tmp_path: Path,
) -> None:
    fleet = start_proxy(fleet_factory)
    vllm_server.set_text(vllm_metrics(3, 1, 0.25))
    zmq_port = free_port()
    sidecar = announcers(*announce_args(fleet, vllm_server, write_model_config(tmp_path), zmq_port))
    procs = [*fleet.processes(), sidecar]
    address = vllm_server.http_address

    item = wait_instance(
        fleet, address, lambda i: i is not None and i["load"] is not None, "registration", procs
    )
    assert item is not None
    assert item["source"] == "v1"
    assert item["role"] == "decode" and item["type"] == "D"
    assert item["zmq_address"] == f"{LOOPBACK}:{zmq_port}"
    assert item["model"] == MODEL
    assert item["connector"] == "nixl"
    assert item["geometry"] == EXPECTED_GEOMETRY
    assert item["load"] == {"running": 3, "waiting": 1, "kv_usage": 0.25}
    assert item["healthy"] is True
    assert ready_status(fleet) == 200
    models = http_json(fleet.proxy_url + "/v1/models")
    assert [m["id"] for m in models["data"]] == [MODEL]

    # The load follows the server's /metrics within a few periods.
    vllm_server.set_text(vllm_metrics(7, 12, 0.875))
    item = wait_instance(
        fleet,
        address,
        lambda i: i is not None and i["load"] == {"running": 7, "waiting": 12, "kv_usage": 0.875},
        "the new load",
        procs,
    )
    assert item is not None and item["healthy"] is True
    assert item["geometry"] == EXPECTED_GEOMETRY  # identity does not move with the load
    assert vllm_server.scrapes >= 2  # it scraped the default URL, http://HTTP_ADDRESS/metrics


def test_unreachable_server_is_listed_unhealthy_and_not_routed(
    fleet_factory: FleetFactory,
    vllm_server: FakeVllmServer,
    announcers: Starter,
    tmp_path: Path,
) -> None:
    fleet = start_proxy(fleet_factory)
    vllm_server.set_text(vllm_metrics(1, 0, 0.5))
    sidecar = announcers(
        *announce_args(fleet, vllm_server, write_model_config(tmp_path), free_port())
    )
    procs = [*fleet.processes(), sidecar]
    address = vllm_server.http_address
    wait_instance(fleet, address, lambda i: i is not None and i["healthy"], "registration", procs)
    wait_until(lambda: ready_status(fleet) == 200, WAIT, "/ready to answer 200", procs)

    vllm_server.stop()
    item = wait_instance(
        fleet, address, lambda i: i is not None and not i["healthy"], "healthy=false", procs
    )
    assert item is not None
    # Still known, with its identity; only its load is unknown now.
    assert item["source"] == "v1" and item["model"] == MODEL
    assert item["geometry"] == EXPECTED_GEOMETRY
    assert item["load"] is None
    # Routing treats it as absent.
    status, body = http_get(fleet.proxy_url + "/ready", timeout=5)
    assert status == 503
    reason = json.loads(body)["reason"]
    assert reason.startswith("no decode instance"), reason
    # And why, though it is registered.
    assert f"(taking no traffic: decode {address} announced healthy: false)" in reason
    assert completion_error_code(fleet) == (503, "no_instance")
    # Unhealthy announcements keep refreshing it: a second later it was seen just now.
    went_unhealthy_at_age = item["age_seconds"]
    wait_instance(
        fleet,
        address,
        lambda i: (
            i is not None
            and not i["healthy"]
            and i["age_seconds"] > went_unhealthy_at_age + 1.0
            and i["last_seen_seconds_ago"] < 1.0
        ),
        "unhealthy announcements to keep arriving",
        procs,
    )

    vllm_server.start()
    item = wait_instance(
        fleet, address, lambda i: i is not None and i["healthy"], "healthy again", procs
    )
    assert item is not None
    assert item["load"] == {"running": 1, "waiting": 0, "kv_usage": 0.5}
    wait_until(lambda: ready_status(fleet) == 200, WAIT, "/ready to answer 200 again", procs)
    # Routable again: the proxy now plans a pair and fails only on the static prefill, which
    # nothing serves in this test (a refused connect), instead of refusing for lack of a decode.
    assert completion_error_code(fleet) == (502, "prefill_connect")


def listed_with_load(
    fleet: LocalFleet,
    server: FakeVllmServer,
    announcers: Starter,
    tmp_path: Path,
    sidecar_args: tuple[str, ...],
) -> tuple[dict[str, Any], list[ManagedProcess]]:
    """A sidecar (with `sidecar_args`) announcing the fake server's load, until the proxy lists
    that load: the load, and the processes whose logs a failed wait shows."""
    load = {"running": 3, "waiting": 1, "kv_usage": 0.25}
    server.set_text(vllm_metrics(3, 1, 0.25))
    args = announce_args(fleet, server, write_model_config(tmp_path), free_port())
    procs = [*fleet.processes(), announcers(*args, *sidecar_args)]
    address = server.http_address
    wait_instance(fleet, address, lambda i: i is not None and i["load"] == load, "its load", procs)
    return load, procs


def test_a_slow_server_keeps_its_last_load_then_is_announced_unhealthy(
    fleet_factory: FleetFactory,
    vllm_server: FakeVllmServer,
    announcers: Starter,
    tmp_path: Path,
) -> None:
    """A busy vLLM's /metrics can take seconds: while its scrapes time out for less than
    --unhealthy-after, the sidecar announces the last load it read, healthy (the instance keeps
    its traffic); past that it is announced unhealthy, and healthy again once it answers."""
    fleet = start_proxy(fleet_factory)
    sidecar_args = ("--scrape-timeout", "0.2", "--unhealthy-after", "3")
    load, procs = listed_with_load(fleet, vllm_server, announcers, tmp_path, sidecar_args)
    address = vllm_server.http_address

    scrapes = vllm_server.scrapes
    vllm_server.delay = 1.0  # five times the scrape timeout
    slow_since = time.monotonic()
    while time.monotonic() - slow_since < 2.0:  # well inside --unhealthy-after
        item = instance(fleet, address)
        assert item is not None and item["healthy"] is True and item["load"] == load, item
        time.sleep(0.1)
    item = wait_instance(
        fleet, address, lambda i: i is not None and not i["healthy"], "healthy=false", procs
    )
    assert item is not None and item["load"] is None
    # The grace counts from the last scrape that answered, at most an interval before the delay.
    assert time.monotonic() - slow_since >= 3.0 - float(INTERVAL) - 0.2
    assert vllm_server.scrapes > scrapes  # it kept trying meanwhile

    vllm_server.delay = 0.0
    item = wait_instance(
        fleet, address, lambda i: i is not None and i["healthy"], "healthy again", procs
    )
    assert item is not None and item["load"] == load


def test_a_server_trickling_its_metrics_keeps_being_announced_every_period(
    fleet_factory: FleetFactory,
    vllm_server: FakeVllmServer,
    announcers: Starter,
    tmp_path: Path,
) -> None:
    """A server that sends its /metrics page a piece at a time, each piece in time for a
    per-read timeout, has the whole page seconds late. The scrape ends at --scrape-timeout, so the
    announcements keep their period and the registry (TTL 1.5 s here) keeps the instance, with
    the last load it read."""
    fleet = fleet_factory(
        [],
        proxy_args=["--ttl", "1.5", "--prefill", static_prefill(), "--allow-unknown-geometry"],
    )
    sidecar_args = ("--scrape-timeout", "0.3", "--unhealthy-after", "30")
    load, _ = listed_with_load(fleet, vllm_server, announcers, tmp_path, sidecar_args)
    address = vllm_server.http_address

    scrapes = vllm_server.scrapes
    vllm_server.trickle = 0.2  # 20 pieces: 4 s a page, against the 0.3 s a scrape may take
    trickling_since = time.monotonic()
    while time.monotonic() - trickling_since < 4.0:  # over twice the TTL
        item = instance(fleet, address)
        assert item is not None, "the registry expired the instance: its sidecar went silent"
        assert item["healthy"] is True and item["load"] == load, item
        time.sleep(0.1)
    assert vllm_server.scrapes >= scrapes + 4  # it kept scraping, each cut off at its deadline


def test_the_context_length_is_learned_from_the_servers_models_list(
    fleet_factory: FleetFactory,
    vllm_server: FakeVllmServer,
    announcers: Starter,
    tmp_path: Path,
) -> None:
    # What vLLM 0.32's /v1/models lists: the served name with the context it runs.
    card = {"id": MODEL, "object": "model", "root": "/models/tiny", "max_model_len": 256}
    vllm_server.models = {"object": "list", "data": [card]}
    fleet = start_proxy(fleet_factory)
    sidecar = announcers(
        *announce_args(fleet, vllm_server, write_model_config(tmp_path), free_port())
    )
    procs = [*fleet.processes(), sidecar]
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 257}
    url = fleet.proxy_url + "/v1/completions"
    # Until the announced decode is known and its context learned, the (unserved) static
    # prefill is tried: 503, then 502. Once learned, the proxy refuses in vLLM's words.
    wait_until(lambda: post_json(url, body).status == 400, WAIT, "the refusal", procs)
    error = post_json(url, body).json()["error"]
    assert error["param"] == "max_tokens" and "max_model_len=256" in error["message"]
    assert post_json(url, dict(body, max_tokens=256)).status == 502  # within: legs are sent


def test_sigterm_sends_leave_and_exits_zero(
    fleet_factory: FleetFactory,
    vllm_server: FakeVllmServer,
    announcers: Starter,
    tmp_path: Path,
) -> None:
    fleet = start_proxy(fleet_factory)
    sidecar = announcers(
        *announce_args(fleet, vllm_server, write_model_config(tmp_path), free_port())
    )
    procs = [*fleet.processes(), sidecar]
    address = vllm_server.http_address
    wait_instance(fleet, address, lambda i: i is not None, "registration", procs)

    signalled = time.monotonic()
    sidecar.signal(signal.SIGTERM)
    # Gone through `leave`: the proxy's TTL is 60 s, so expiry cannot be what removed it.
    wait_instance(fleet, address, lambda i: i is None, "leave", fleet.processes(), timeout=5)
    assert time.monotonic() - signalled < 5
    assert sidecar.process is not None
    assert sidecar.process.wait(timeout=10) == 0, sidecar.log_tail()
    assert fleet.proxy is not None and fleet.proxy.alive()
    assert ready_status(fleet) == 503


def run_announce(*args: str) -> subprocess.CompletedProcess[str]:
    """A run that must end on its own (bad arguments): bounded, killed on timeout."""
    return subprocess.run(
        pdproxy_command("announce", *args),
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
        check=False,
    )


GOOD = {
    "--role": "D",
    "--http-address": f"{LOOPBACK}:8200",
    "--zmq-address": f"{LOOPBACK}:22001",
    "--registry": f"{LOOPBACK}:30001",
}


def argv(**changes: str) -> list[str]:
    values = {**GOOD, **{"--" + k.replace("_", "-"): v for k, v in changes.items()}}
    return [item for pair in values.items() for item in pair]


@pytest.mark.parametrize(
    ("changes", "flag"),
    [
        ({"http_address": "bad host:80"}, "--http-address"),
        ({"http_address": "127.0.0.1"}, "--http-address"),
        ({"zmq_address": "[::1]:22001"}, "--zmq-address"),
        ({"registry": "127.0.0.1:0"}, "--registry"),
        ({"registry": "udp://127.0.0.1:30001"}, "--registry"),
        ({"registry": "fd00::1:30001"}, "--registry"),  # IPv6 goes in brackets
    ],
)
def test_bad_address_exits_2(changes: dict[str, str], flag: str) -> None:
    result = run_announce(*argv(**changes))
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"pdproxy announce: {flag}:"), result.stderr
    assert "Traceback" not in result.stderr


def test_missing_model_config_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "config.json"
    result = run_announce(*argv(), "--model-config", str(missing))
    assert result.returncode == 2, result.stderr
    assert f"--model-config {missing}" in result.stderr
    assert "No such file" in result.stderr
    assert "Traceback" not in result.stderr


def test_directory_as_model_config_exits_2(tmp_path: Path) -> None:
    result = run_announce(*argv(), "--model-config", str(tmp_path))
    assert result.returncode == 2, result.stderr
    assert f"--model-config {tmp_path}" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "--model-config"),
        ("[1, 2, 3]", "not a JSON object"),
        (json.dumps({**TINY_LLAMA_CONFIG, "num_hidden_layers": "4"}), "num_hidden_layers"),
        (json.dumps({**TINY_LLAMA_CONFIG, "hidden_size": 257}), "not a multiple"),
    ],
)
def test_bad_model_config_exits_2(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(content, encoding="utf-8")
    result = run_announce(*argv(), "--model-config", str(path))
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("pdproxy announce: "), result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--tp-size", "0"], "--tp-size"),
        (["--interval", "0"], "--interval"),
        (["--kv-layout", "LBHNC"], "--kv-layout"),
        (["--connector", "lmcache"], "--connector"),
    ],
)
def test_bad_flag_values_exit_2(extra: list[str], flag: str) -> None:
    result = run_announce(*argv(), *extra)
    assert result.returncode == 2, result.stderr
    assert flag in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_required_flag_exits_2() -> None:
    args = argv()
    index = args.index("--registry")
    result = run_announce(*(args[:index] + args[index + 2 :]))
    assert result.returncode == 2
    assert "--registry" in result.stderr


def test_the_sidecar_can_be_tried_on_a_fake_worker(
    fleet_factory: FleetFactory, announcers: Starter, tmp_path: Path
) -> None:
    """The fake worker serves /metrics in vLLM's names, so `pdproxy announce` reads its load
    as it reads a real server's."""
    fleet = start_proxy(fleet_factory)
    http_port, kv_port = free_port(), free_port()
    worker = ManagedProcess(
        "fake-worker",
        pdproxy_command(
            "fake-worker", "--role", "D", "--port", str(http_port), "--kv-port", str(kv_port)
        ),
        tmp_path / "fake-worker.log",
    ).start()
    try:
        url = f"http://{LOOPBACK}:{http_port}"
        wait_until(lambda: http_get(url + "/health")[0] == 200, WAIT, "the fake worker", [worker])
        forced = {"running": 5, "waiting": 2, "kv_usage": 0.375}
        assert post_json(url + "/_fake/load", forced).status == 200
        address = f"{LOOPBACK}:{http_port}"
        config = write_model_config(tmp_path)
        sidecar = announcers(*announce_args_for(fleet, address, config, kv_port))
        item = wait_instance(
            fleet,
            address,
            lambda i: i is not None and i["load"] == forced,
            "the fake worker's forced load, read from its /metrics",
            [*fleet.processes(), worker, sidecar],
        )
        assert item is not None and item["source"] == "v1" and item["healthy"] is True
    finally:
        assert worker.stop() == 0
