"""Real vLLM (CPU build) servers on loopback, as prefill and decode instances.

Each server runs vLLM's own OpenAI server from the cached venv (tests.harness.vllm_env) on a
tiny random-weight Llama written here (no download of any kind), with pdproxy's KV connector
loaded through `kv_connector_module_path`. The connector announces the instance to a pdproxy
registry and records the engine-internal request ids it is shown.

Every server runs in its own session and is stopped by PID, also when starting it failed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pdproxy
from pdproxy.demo.processes import LOOPBACK, ManagedProcess, http_get, wait_until
from pdproxy.vllm_side.request_log import read_request_log
from tests.harness import tiny_model
from tests.harness.vllm_env import VllmEnv

MODEL_NAME = "tiny-llama"
READY_TIMEOUT_S = 240.0  # measured 24-33 s alone; two starting side by side share 2 cores
STOP_GRACE_S = 10.0
MODEL_WRITE_TIMEOUT_S = 120.0
MAX_MODEL_LEN = 2048
KV_CACHE_BYTES = 64 * 1024 * 1024  # the tiny model needs 1 KiB per token: 64 Ki tokens

KvRole = Literal["kv_producer", "kv_consumer", "kv_both"]


def import_root(base: Path) -> Path:
    """A directory to put on vLLM's PYTHONPATH that holds this pdproxy package and nothing else
    (putting site-packages there would mix our venv's libraries into vLLM's)."""
    root = base / "pdproxy-import-root"
    root.mkdir(parents=True, exist_ok=True)
    link = root / "pdproxy"
    if not link.exists():
        link.symlink_to(Path(pdproxy.__file__).resolve().parent, target_is_directory=True)
    return root


def tiny_model_dir(env: VllmEnv) -> Path:
    """The tiny model, written once per version of tiny_model.py and reused across runs."""
    source = Path(tiny_model.__file__).read_bytes()
    directory = env.root / "models" / f"tiny-{hashlib.sha256(source).hexdigest()[:12]}"
    if (directory / "config.json").exists():
        return directory
    staging = directory.with_name(directory.name + f".tmp{os.getpid()}")
    # By file path: vLLM's Python has neither the tests nor this venv's libraries on its path,
    # and tiny_model.py imports nothing of either.
    outer_path_dropped = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run(
        [str(env.python), str(Path(tiny_model.__file__).resolve()), str(staging)],
        env=outer_path_dropped,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=MODEL_WRITE_TIMEOUT_S,
        check=True,
    )
    with contextlib.suppress(OSError):  # another run wrote it first; theirs is identical
        staging.rename(directory)
    return directory


@dataclass
class VllmServer:
    """One real vLLM OpenAI server with pdproxy's connector."""

    name: str
    kv_role: KvRole
    http_port: int
    kv_port: int
    work: Path
    registry: str | None = None  # "host:port" of the pdproxy registry to announce to
    cpu: str = "0"  # VLLM_CPU_OMP_THREADS_BIND ("0|1": rank 0 on core 0, rank 1 on core 1)
    announce_interval_s: float = 1.0
    # kv_connector_extra_config: pdproxy's (kv_timeout, on_missing_kv...) or NIXL's
    connector_extra: dict[str, Any] = field(default_factory=dict)
    block_size: int | None = None  # vLLM's own default (128 on CPU) when None
    tp_size: int = 1  # ranks in worker processes; `cpu` then names one core list per rank
    # None: the connector picks the address itself (the local end of its route to the registry).
    advertise_host: str | None = LOOPBACK
    # "PdproxyConnector" (pdproxy's, announcing itself), or vLLM's "NixlConnector" (pull) or
    # "NixlPushConnector", on host memory: `kv_port` is then the NIXL side-channel port, and
    # nothing announces the server. None: no KV connector at all (a pooling model).
    kv_connector: Literal["PdproxyConnector", "NixlConnector", "NixlPushConnector"] | None = (
        "PdproxyConnector"
    )
    # vLLM's NIXL engine id (kv_transfer_config.engine_id); None: vLLM draws a random one. A
    # NIXL push decode must be told its prefill's engine id up front, so a test fixes it.
    engine_id: str | None = None
    extra_args: tuple[str, ...] = ()  # further `vllm serve` flags ("--enable-scale-out")
    process: ManagedProcess | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}"

    @property
    def http_address(self) -> str:
        return f"{LOOPBACK}:{self.http_port}"

    @property
    def zmq_address(self) -> str:
        return f"{LOOPBACK}:{self.kv_port}"

    @property
    def record_path(self) -> Path:
        return self.work / f"{self.name}.requests.jsonl"

    @property
    def log_path(self) -> Path:
        return self.work / f"{self.name}.log"

    @property
    def uses_nixl(self) -> bool:
        return self.kv_connector in ("NixlConnector", "NixlPushConnector")

    def kv_transfer_config(self) -> dict[str, Any]:
        if self.uses_nixl:
            config: dict[str, Any] = {
                "kv_connector": self.kv_connector,
                "kv_role": self.kv_role,
                "kv_buffer_device": "cpu",
            }
            if self.engine_id is not None:
                config["engine_id"] = self.engine_id
            if self.connector_extra:
                config["kv_connector_extra_config"] = dict(self.connector_extra)
            return config
        extra: dict[str, Any] = {
            "http_port": self.http_port,
            "record_path": str(self.record_path),
            "announce_interval": self.announce_interval_s,
        }
        if self.advertise_host is not None:
            extra["advertise_host"] = self.advertise_host
        if self.registry is not None:
            host, port = self.registry.rsplit(":", 1)
            extra |= {"proxy_ip": host, "proxy_port": int(port)}
        extra |= self.connector_extra
        return {
            "kv_connector": "PdproxyConnector",
            "kv_connector_module_path": "pdproxy.vllm_side.connector",
            "kv_role": self.kv_role,
            "kv_port": self.kv_port,
            "kv_connector_extra_config": extra,
        }

    def argv(self, env: VllmEnv, model: Path) -> list[str]:
        return [
            str(env.python),
            "-m",
            "vllm.entrypoints.openai.api_server",  # the `vllm` script fails in this wheel
            "--model",
            str(model),
            "--served-model-name",
            MODEL_NAME,
            "--load-format",
            "safetensors",
            "--dtype",
            "float32",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-num-batched-tokens",
            str(MAX_MODEL_LEN),
            "--max-num-seqs",
            "8",
            "--kv-cache-memory-bytes",
            str(KV_CACHE_BYTES),
            "--enforce-eager",
            "--host",
            LOOPBACK,
            "--port",
            str(self.http_port),
            *self._kv_args(),
            *([] if self.block_size is None else ["--block-size", str(self.block_size)]),
            *self._parallel_args(),
            *self.extra_args,
        ]

    def _kv_args(self) -> list[str]:
        if self.kv_connector is None:
            return []
        return ["--kv-transfer-config", json.dumps(self.kv_transfer_config())]

    def _parallel_args(self) -> list[str]:
        if self.tp_size == 1:
            return []
        return [
            "--tensor-parallel-size",
            str(self.tp_size),
            "--distributed-executor-backend",
            "mp",
        ]

    def environment(self) -> dict[str, str]:
        # No temporary directory of its own per server, though vLLM leaves a dozen IPC sockets
        # and file stores in the shared one per server: NIXL push's first transfer through the
        # proxy then stalled for the client's whole timeout in 4 of 5 full runs with a TMPDIR
        # per server, 1 of 2 with only VLLM_RPC_BASE_PATH moved, 0 of 2 without. A known leak.
        env = {
            "PYTHONPATH": str(import_root(self.work)),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_CPU_OMP_THREADS_BIND": self.cpu,
            "VLLM_CACHE_ROOT": str(self.work / f"{self.name}.vllm-cache"),
            "VLLM_LOGGING_LEVEL": "INFO",
        }
        if self.uses_nixl:
            # NIXL's handshake listens here (one side channel per server on a shared host).
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = LOOPBACK
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.kv_port)
        return env

    def start(self, env: VllmEnv, model: Path) -> VllmServer:
        self.work.mkdir(parents=True, exist_ok=True)
        self.process = ManagedProcess(
            self.name,
            self.argv(env, model),
            self.log_path,
            self.environment(),
            # Whole GiB, overriding --kv-cache-memory-bytes (and tripling memory): never inherit it.
            unset=("VLLM_CPU_KVCACHE_SPACE",),
        ).start()
        return self

    def ready(self) -> bool:
        return http_get(f"{self.url}/health", 1.0)[0] == 200

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        assert self.process is not None
        wait_until(self.ready, timeout, f"{self.name} to serve", [self.process], interval=0.5)

    def stop(self) -> int | None:
        return None if self.process is None else self.process.stop(STOP_GRACE_S)

    def alive(self) -> bool:
        return self.process is not None and self.process.alive()

    def records(self, event: str | None = None) -> list[dict[str, Any]]:
        rows = read_request_log(self.record_path)
        return [row for row in rows if event is None or row.get("event") == event]

    def metrics_text(self) -> str:
        # A loaded engine can take seconds to answer between steps; this is a read, not a probe.
        status, body = http_get(f"{self.url}/metrics", 15.0)
        if status != 200:
            raise RuntimeError(f"{self.name} /metrics answered {status}")
        return body.decode()


@contextmanager
def running_servers(
    env: VllmEnv, model: Path, servers: Sequence[VllmServer], timeout: float = READY_TIMEOUT_S
) -> Iterator[Sequence[VllmServer]]:
    """Start servers side by side, wait until all serve, stop all of them (by PID) on exit."""
    with ExitStack() as stack:
        for server in servers:
            stack.callback(server.stop)
            server.start(env, model)
        deadline = time.monotonic() + timeout
        for server in servers:
            server.wait_ready(max(1.0, deadline - time.monotonic()))
        yield servers


# vLLM 0.32 no longer ships P2pNcclConnector; its MoRIIO connector reads the same
# ___prefill_addr_..___decode_addr_.._{hex} scheme with these regexes of its own.
_ID_PATTERNS_SCRIPT = """
import json
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_common as m
print(json.dumps({"prefill": m._PREFILL_ZMQ_RE.pattern, "decode": m._DECODE_ZMQ_RE.pattern}))
"""
ID_PATTERNS_TIMEOUT_S = 120.0


def vllm_id_patterns(env: VllmEnv) -> dict[str, str]:
    """The regexes the installed vLLM itself uses to find the P and D addresses in a request id,
    read from vLLM's own module (not restated here)."""
    done = subprocess.run(
        [str(env.python), "-c", _ID_PATTERNS_SCRIPT],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=ID_PATTERNS_TIMEOUT_S,
        check=True,
        env={**os.environ, "VLLM_NO_USAGE_STATS": "1"},
    )
    patterns: dict[str, str] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return patterns
