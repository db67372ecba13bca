"""Shared helpers of the deployment tests: the Helm chart rendered by real Helm (the Go library
helm-python-sdk binds), the Dockerfile read instruction by instruction, the proxy's real CLI."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

from pdproxy.cli import build_parser
from pdproxy.config import Settings, load_settings
from pdproxy.demo.processes import (
    LOOPBACK,
    ManagedProcess,
    free_ports,
    pdproxy_command,
    wait_http_ok,
)

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "pdproxy"
EXAMPLES = {path.stem: path for path in sorted((CHART / "examples").glob("*.yaml"))}
RELEASE = "llm"
NAMESPACE = "inference"
CONFIG_FILE_KEY = "config.yaml"

Manifest = dict[str, Any]


# ---- the chart ---------------------------------------------------------------------------


def example_values(name: str) -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load(EXAMPLES[name].read_text(encoding="utf-8"))
    return values


def _with_pdproxy_connector(values: dict[str, Any]) -> dict[str, Any]:
    """The fleet on pdproxy's own connector, signing its announcements with a registry secret
    (read from a file mounted into the vLLM container), its prefills' work reported every 50 ms."""
    registry = {"existingSecret": "pdproxy-registry", "key": "hmac"}
    return {
        **values,
        # It announces itself: no sidecar.
        "fleet": {
            **values["fleet"],
            "connector": "PdproxyConnector",
            "announce": {"enabled": False},
            "prefillWorkReportSeconds": 0.05,
        },
        "auth": {**values.get("auth", {}), "registrySecret": registry},
    }


# Every values set the chart is tested with: its defaults, each example file, and the 2P2D
# fleet on pdproxy's own connector (with a registry secret).
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    **{name: example_values(name) for name in EXAMPLES},
    "fleet-2p2d-pdproxy-connector": _with_pdproxy_connector(example_values("fleet-2p2d")),
}


@dataclass(frozen=True)
class Rendered:
    manifests: list[Manifest]
    notes: str

    def all(self, kind: str) -> list[Manifest]:
        return [m for m in self.manifests if m["kind"] == kind]

    def one(self, kind: str, name: str) -> Manifest:
        found = [m for m in self.all(kind) if m["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
        return found[0]

    @property
    def fullname(self) -> str:
        return f"{RELEASE}-pdproxy"

    @property
    def proxy_deployment(self) -> Manifest:
        return self.one("Deployment", self.fullname)

    @property
    def http_service(self) -> Manifest:
        return self.one("Service", self.fullname)

    @property
    def registry_service(self) -> Manifest:
        return self.one("Service", f"{self.fullname}-registry")

    @property
    def config_text(self) -> str:
        data: dict[str, str] = self.one("ConfigMap", self.fullname)["data"]
        return data[CONFIG_FILE_KEY]

    @property
    def config(self) -> dict[str, Any]:
        loaded: dict[str, Any] = yaml.safe_load(self.config_text)
        return loaded

    def fleet(self) -> list[Manifest]:
        return [
            m
            for m in self.all("Deployment")
            if m["metadata"]["labels"]["app.kubernetes.io/component"] in ("prefill", "decode")
        ]


def render(values: dict[str, Any] | None = None) -> Rendered:
    """`helm template` with the chart's schema check: HelmValuesError on a schema violation."""
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    manifests: list[Manifest] = []
    notes = ""
    for path, text in sorted(files.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        manifests.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return Rendered(manifests, notes)


def pod_spec(workload: Manifest) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def container(workload: Manifest, name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [c for c in pod_spec(workload)["containers"] if c["name"] == name]
    assert len(found) == 1, f"no single container {name} in {workload['metadata']['name']}"
    return found[0]


def container_port(spec: dict[str, Any], name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in spec.get("ports", [])}
    assert name in ports, f"container {spec['name']} has no port named {name}: {ports}"
    return int(ports[name])


def env_value(spec: dict[str, Any], name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [e for e in spec.get("env", []) if e["name"] == name]
    assert len(found) == 1, f"container {spec['name']}: env {name} defined {len(found)} times"
    return found[0]


def flag_value(argv: list[str], flag: str) -> str:
    """The value after `flag` (which must occur exactly once)."""
    positions = [i for i, arg in enumerate(argv) if arg == flag]
    assert len(positions) == 1, f"{flag} occurs {len(positions)} times in {argv}"
    return argv[positions[0] + 1]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def walk_schema_paths(values: Any, schema: dict[str, Any], root: dict[str, Any]) -> Iterator[str]:
    """Yield the dotted path of every value that `schema` does not declare.

    Free-form objects (type object without `properties`) declare everything below them.
    """
    yield from _undeclared(values, schema, root, "")


def _resolve(schema: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        target: Any = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        schema = target
    return schema


def _undeclared(
    value: Any, schema: dict[str, Any], root: dict[str, Any], path: str
) -> Iterator[str]:
    schema = _resolve(schema, root)
    if not isinstance(value, dict) or "properties" not in schema:
        return
    for key, item in value.items():
        where = f"{path}.{key}" if path else key
        if key not in schema["properties"]:
            yield where
            continue
        yield from _undeclared(item, schema["properties"][key], root, where)


# ---- the proxy's own CLI and settings ----------------------------------------------------


def parse_pdproxy(argv: list[str]) -> argparse.Namespace:
    """Parse `pdproxy ARGS...` with the real CLI parser; an invalid command fails the test."""
    assert argv[0] == "pdproxy", f"not a pdproxy command: {argv}"
    try:
        return build_parser().parse_args(argv[1:])
    except SystemExit as exc:
        raise AssertionError(f"`{shlex.join(argv)}` is refused by pdproxy's parser") from exc


def serve_settings(argv: list[str], environ: dict[str, str]) -> Settings:
    """The Settings a `pdproxy serve ...` command builds from its flags, env and config file."""
    args = parse_pdproxy(argv)
    assert args.command == "serve", argv
    del args.func, args.command
    return load_settings(args, environ=environ)


@contextlib.contextmanager
def running_proxy(
    argv: list[str], env: dict[str, str], log_path: Path, executable: list[str] | None = None
) -> Iterator[str]:
    """Run `pdproxy serve ...` (argv as a container would) on free loopback ports; yield its
    base URL. Flags given last win, so the ports are moved to 127.0.0.1 whatever the config
    says. Stopped by PID whatever happens."""
    assert argv[:2] == ["pdproxy", "serve"], argv
    http_port, registry_port = free_ports(2)
    command = (executable or pdproxy_command())[:] + argv[1:]
    command += ["--host", LOOPBACK, "--port", str(http_port)]
    command += ["--registry-bind", f"tcp://{LOOPBACK}:{registry_port}"]
    proxy = ManagedProcess("pdproxy", command, log_path, env=env)
    try:
        proxy.start()
        url = f"http://{LOOPBACK}:{http_port}"
        wait_http_ok(url + "/health", 30.0, [proxy])
        yield url
    finally:
        proxy.stop()


# ---- the Dockerfile ----------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str
    text: str

    def exec_form(self) -> list[str]:
        """The JSON (exec) form of the instruction's arguments."""
        start = self.text.index("[")
        parsed: list[str] = json.loads(self.text[start:])
        return parsed


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[Instruction] = field(default_factory=list)

    def get(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def read_dockerfile(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages): continuation lines joined, comments dropped."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, text = line.partition(" ")
        keyword = keyword.upper()
        text = re.sub(r"\s+", " ", text).strip()
        if keyword == "FROM":
            parts = text.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(name, parts[0]))
        elif not stages:
            assert keyword == "ARG", f"{keyword} before the first FROM"
            key, _, default = text.partition("=")
            global_args[key] = default
        else:
            stages[-1].instructions.append(Instruction(keyword, text))
    return global_args, stages


def key_values(text: str) -> dict[str, str]:
    """KEY=VALUE pairs of an ENV or LABEL instruction (values may be double-quoted)."""
    return {key: value for key, value in (item.split("=", 1) for item in shlex.split(text))}
