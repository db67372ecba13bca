"""A local fleet on loopback: a real `pdproxy serve` plus fake P and D workers, each its own
process. Used by the demo and the tests."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pdproxy.demo.processes import (
    LOOPBACK,
    ManagedProcess,
    free_ports,
    http_get,
    http_json,
    pdproxy_command,
    wait_http_ok,
    wait_until,
)

# static: configured on the proxy's command line; none: neither (Kubernetes discovery finds it).
Announce = Literal["v0", "v1", "static", "none"]
START_TIMEOUT = 30.0
# The disaggregated paths (pdproxy.proxy.front's), whose legs the workers record.
COMPLETION_PATHS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/inference/v1/generate",
    "/v1/responses",
    "/v1/messages",
)


@dataclass(frozen=True)
class WorkerSpec:
    role: Literal["P", "D"]
    announce: Announce = "v1"
    model: str = "fake-model"
    token_latency_ms: float = 0.0
    prefill_latency_ms: float = 0.0
    extra_args: tuple[str, ...] = ()
    # A static worker's further spec keys ("connector=nixl", "tp_size=2"...), after http and zmq.
    static_keys: tuple[str, ...] = ()


@dataclass
class Worker:
    spec: WorkerSpec
    index: int
    http_port: int
    kv_port: int
    process: ManagedProcess

    @property
    def http_address(self) -> str:
        return f"{LOOPBACK}:{self.http_port}"

    @property
    def zmq_address(self) -> str:
        return f"{LOOPBACK}:{self.kv_port}"

    @property
    def url(self) -> str:
        return f"http://{self.http_address}"

    def static_flag(self) -> list[str]:
        flag = "--prefill" if self.spec.role == "P" else "--decode"
        spec = ",".join(
            (f"http={self.http_address}", f"zmq={self.zmq_address}", *self.spec.static_keys)
        )
        return [flag, spec]

    def requests(self) -> list[dict[str, Any]]:
        data: list[dict[str, Any]] = http_json(self.url + "/_fake/requests")
        return data

    def events(self) -> dict[str, Any]:
        data: dict[str, Any] = http_json(self.url + "/_fake/events")
        return data


@dataclass
class LocalFleet:
    log_dir: Path
    workers_spec: Sequence[WorkerSpec]
    proxy_args: Sequence[str] = ()
    proxy_port: int | None = None
    registry_port: int | None = None
    announce_interval: float = 0.5
    api_key: str | None = None  # when the proxy demands client keys
    proxy_env: dict[str, str] | None = None  # set for the proxy process only
    proxy_unset: tuple[str, ...] = ()  # inherited variables the proxy must not see
    workers: list[Worker] = field(default_factory=list, init=False)
    proxy: ManagedProcess | None = field(default=None, init=False)

    @property
    def proxy_url(self) -> str:
        return f"http://{LOOPBACK}:{self.proxy_port}"

    @property
    def registry_address(self) -> str:
        return f"{LOOPBACK}:{self.registry_port}"

    def role(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.spec.role == role]

    def completion_requests(self, role: str | None = None) -> list[dict[str, Any]]:
        """The completion legs the fake workers of `role` (default: all) recorded."""
        workers = self.workers if role is None else self.role(role)
        return [r for w in workers for r in w.requests() if r["path"] in COMPLETION_PATHS]

    def start(self) -> LocalFleet:
        self.prepare()
        return self.launch()

    def prepare(self) -> None:
        """Choose the ports and the commands (`workers` is filled): a test may publish the
        addresses somewhere before the processes start."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        ports = iter(free_ports(2 + 2 * len(self.workers_spec)))
        self.proxy_port = self.proxy_port or next(ports)
        self.registry_port = self.registry_port or next(ports)
        counts = {"P": 0, "D": 0}
        for spec in self.workers_spec:
            index = counts[spec.role]
            counts[spec.role] += 1
            http_port, kv_port = next(ports), next(ports)
            name = f"fake-{spec.role}{index}"
            argv = pdproxy_command(
                "fake-worker",
                "--role",
                spec.role,
                "--port",
                str(http_port),
                "--kv-port",
                str(kv_port),
                "--model",
                spec.model,
                "--token-latency-ms",
                str(spec.token_latency_ms),
                "--prefill-latency-ms",
                str(spec.prefill_latency_ms),
                *spec.extra_args,
            )
            if spec.announce in ("v0", "v1"):
                argv += [
                    "--proxy",
                    self.registry_address,
                    "--announce",
                    spec.announce,
                    "--announce-interval",
                    str(self.announce_interval),
                ]
            process = ManagedProcess(name, argv, self.log_dir / f"{name}.log")
            self.workers.append(Worker(spec, index, http_port, kv_port, process))
        static = [
            arg for w in self.workers if w.spec.announce == "static" for arg in w.static_flag()
        ]
        self.proxy = ManagedProcess(
            "pdproxy",
            pdproxy_command(
                "serve",
                "--host",
                LOOPBACK,
                "--port",
                str(self.proxy_port),
                "--registry-bind",
                f"tcp://{LOOPBACK}:{self.registry_port}",
                *static,
                *self.proxy_args,
            ),
            self.log_dir / "pdproxy.log",
            env=self.proxy_env,
            unset=self.proxy_unset,
        )

    def launch(self) -> LocalFleet:
        """Start the processes `prepare` made; wait until the proxy lists every worker."""
        assert self.proxy is not None, "prepare first"
        try:
            self.proxy.start()
            for worker in self.workers:
                worker.process.start()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def processes(self) -> list[ManagedProcess]:
        procs = [w.process for w in self.workers]
        return procs + ([self.proxy] if self.proxy is not None else [])

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        wait_http_ok(self.proxy_url + "/health", timeout, self.processes())
        for worker in self.workers:
            wait_http_ok(worker.url + "/health", timeout, self.processes())
        expected = {w.http_address for w in self.workers}
        wait_until(
            lambda: self.registered() >= expected,
            timeout,
            f"registration of {sorted(expected)}",
            self.processes(),
        )

    def instances(self) -> list[dict[str, Any]]:
        """What the proxy's /v1/instances lists now (nothing if it does not answer)."""
        headers = {} if self.api_key is None else {"Authorization": f"Bearer {self.api_key}"}
        status, body = http_get(self.proxy_url + "/v1/instances", headers=headers)
        if status != 200:
            return []
        listed: list[dict[str, Any]] = json.loads(body)["instances"]
        return listed

    def registered(self) -> set[str]:
        return {item["http_address"] for item in self.instances()}

    def stop(self) -> None:
        for process in reversed(self.processes()):
            process.stop()

    def reset_records(self) -> None:
        for worker in self.workers:
            request = urllib.request.Request(worker.url + "/_fake/reset", data=b"{}", method="POST")
            with urllib.request.urlopen(request, timeout=5):
                pass
