"""helm/pdproxy rendered by real Helm: lint, schema, Kubernetes schemas, and the wiring between
the proxy, its Services and the vLLM fleet (ports, DNS names, probes, config file, secrets)."""

from __future__ import annotations

import enum
import json
import math
import re
import socket
import time
import typing
from pathlib import Path, PurePosixPath
from typing import Any

import helm_python as helm
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from pdproxy.base.roles import Role
from pdproxy.base.secret_file import SECRET_ENV, read_secret_file
from pdproxy.config import ENV_PREFIX, Settings, StaticInstance
from pdproxy.demo.processes import http_get
from pdproxy.proxy.app import PdproxyApp
from pdproxy.proxy.credentials import Credentials
from pdproxy.proxy.front import COMPLETION_PATHS
from pdproxy.proxy.serving import FINAL_GRACE_SECONDS
from pdproxy.registry.auth import Verifier, new_nonce, signed
from pdproxy.vllm_side.announce import registry_secret
from pdproxy.vllm_side.connector_settings import connector_settings
from tests.deploy.support import (
    CHART,
    CONFIG_FILE_KEY,
    EXAMPLES,
    NAMESPACE,
    REPO,
    VALUE_SETS,
    Rendered,
    container,
    container_port,
    env_value,
    flag_value,
    parse_pdproxy,
    pod_spec,
    read_dockerfile,
    render,
    running_proxy,
    selects,
    serve_settings,
    walk_schema_paths,
)

SCHEMA: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
# Bounds the probes of a proxy the test started: generous, since the suite may run beside
# real vLLM servers that keep both cores busy.
PROBE_TIMEOUT_S = 15.0
DEFAULT_VALUES: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text("utf-8"))
# Settings the chart sets itself rather than through `config`: the listening addresses (the
# Services and probes point at them) and the paths of the Secret files it mounts; and the
# settings that hold secrets, which come from Secrets (env or mounted files), never a ConfigMap.
SECRET_FILE_SETTINGS = {"api_key_file": "clientApiKeys", "admin_token_file": "adminToken"}
CHART_OWNED = {"host", "port", "registry_bind", *SECRET_FILE_SETTINGS}
# registry_secret_file: the chart hands the registry secret over from its Secret directly.
FROM_SECRET = {
    "upstream_api_key",
    "registry_secret",
    "registry_secret_file",
    "api_key",
    "admin_token",
}
# Objects with no schema in kubernetes-validate (a CRD); checked field by field below instead.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
OLDEST_KUBERNETES = "1.25"  # Chart.yaml's kubeVersion
ANNOUNCE_FLAGS = {
    "--role",
    "--http-address",
    "--zmq-address",
    "--registry",
    "--model",
    "--connector",
    "--metrics-url",
}
# After the drain: uvicorn's last grace, then the registry and upstream connections close.
SHUTDOWN_MARGIN_SECONDS = 5

VALUE_SET_IDS = sorted(VALUE_SETS)


@pytest.fixture(scope="module", params=VALUE_SET_IDS)
def rendered(request: pytest.FixtureRequest) -> Rendered:
    return render(VALUE_SETS[request.param])


def test_the_examples_are_the_documented_three() -> None:
    assert set(EXAMPLES) == {"proxy-only", "fleet-2p2d", "all-on"}


# ---- lint and schema -------------------------------------------------------------------------


@pytest.mark.parametrize("name", VALUE_SET_IDS)
def test_helm_lint_is_clean(name: str) -> None:
    report = helm.lint(CHART, VALUE_SETS[name], strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    # Severity 1 is Helm's "info" (only "icon is recommended"); warnings and errors fail.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_every_default_value_is_declared_in_the_schema() -> None:
    assert list(walk_schema_paths(DEFAULT_VALUES, SCHEMA, SCHEMA)) == []


def test_the_walk_finds_undeclared_values() -> None:
    """The check above can fail: an undeclared key, nested or not, is reported."""
    values = {
        "image": {"repository": "x", "colour": "blue"},
        "bogus": 1,
        "nodeSelector": {"a": "b"},
    }
    assert sorted(walk_schema_paths(values, SCHEMA, SCHEMA)) == ["bogus", "image.colour"]


def test_every_schema_property_has_a_default() -> None:
    """Schema and values.yaml describe the same tree: no declared key lacks a default."""

    def missing(schema: dict[str, Any], values: Any, path: str) -> list[str]:
        # Shared definitions ($ref: ports, resources, ...) are types whose keys are optional;
        # config's keys are Settings fields, whose defaults live in Settings.
        if "$ref" in schema or "properties" not in schema or path == "config":
            return []
        out = []
        for key, sub in schema["properties"].items():
            where = f"{path}.{key}" if path else key
            if not isinstance(values, dict) or key not in values:
                out.append(where)
            else:
                out += missing(sub, values[key], where)
        return out

    assert missing(SCHEMA, DEFAULT_VALUES, "") == []


def test_the_schema_refuses_unknown_keys_everywhere() -> None:
    def open_objects(schema: dict[str, Any], path: str) -> list[str]:
        if "properties" not in schema:
            return []
        out = [] if schema.get("additionalProperties") is False else [path or "<root>"]
        for key, sub in schema["properties"].items():
            out += open_objects(sub, f"{path}.{key}" if path else key)
        return out

    assert open_objects(SCHEMA, "") == []


def test_config_schema_is_exactly_the_settings_fields() -> None:
    """Every Settings field is configurable through the chart, and nothing else is."""
    declared = set(SCHEMA["properties"]["config"]["properties"])
    assert declared | CHART_OWNED | FROM_SECRET == set(Settings.model_fields)
    assert not declared & (CHART_OWNED | FROM_SECRET)


def test_static_instance_schema_is_exactly_the_static_instance_fields() -> None:
    """A static instance in the chart takes the keys `--prefill`/`--decode` take (connector and
    geometry included), with their types, bounds and choices, as a string or as a map."""
    for role in ("prefill", "decode"):
        text, mapping = SCHEMA["properties"]["config"]["properties"][role]["items"]["oneOf"]
        assert set(mapping["properties"]) == set(StaticInstance.model_fields)
        assert mapping["required"] == ["http", "zmq"]
        for name, node in mapping["properties"].items():
            field = StaticInstance.model_fields[name]
            bounds = {
                keyword: getattr(c, attribute)
                for c in field.metadata
                for attribute, keyword in BOUND_KEYWORDS.items()
                if getattr(c, attribute, None) is not None
            }
            assert {k: node[k] for k in BOUND_KEYWORDS.values() if k in node} == bounds, name
            choices = [a for a in typing.get_args(field.annotation) if a is not type(None)]
            if choices and isinstance(choices[0], type) and issubclass(choices[0], enum.Enum):
                assert node["enum"] == [c.value for c in choices[0]], name
            elif choices and typing.get_origin(choices[0]) is typing.Literal:
                assert node["enum"] == list(typing.get_args(choices[0])), name
        keys = "|".join(k for k in StaticInstance.model_fields if k not in ("http", "zmq"))
        assert text["pattern"] == f"^http=[^,]+,zmq=[^,]+(,({keys})=[^,]+)*$"


def test_all_on_example_sets_every_config_key() -> None:
    """So the Settings round trip below covers every key the schema lets through."""
    assert set(VALUE_SETS["all-on"]["config"]) == set(SCHEMA["properties"]["config"]["properties"])


BOUND_KEYWORDS = {
    "ge": "minimum",
    "gt": "exclusiveMinimum",
    "le": "maximum",
    "lt": "exclusiveMaximum",
}
JSON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string"}


def test_config_schema_mirrors_the_settings_constraints() -> None:
    """Each `config` key has its Settings field's type and exactly its bounds, so Helm refuses
    an out-of-range value before the proxy would refuse to start with it."""
    for name, node in SCHEMA["properties"]["config"]["properties"].items():
        field = Settings.model_fields[name]
        bounds = {}
        for constraint in field.metadata:
            for attribute, keyword in BOUND_KEYWORDS.items():
                value = getattr(constraint, attribute, None)
                if value is not None:
                    bounds[keyword] = value
        declared = {k: node[k] for k in BOUND_KEYWORDS.values() if k in node}
        assert declared == bounds, name
        annotation = field.annotation
        if typing.get_origin(annotation) is typing.Literal:
            assert set(node["enum"]) == set(typing.get_args(annotation)), name
        elif annotation in JSON_TYPES:
            assert node["type"] == JSON_TYPES[annotation], name
        else:
            assert typing.get_origin(annotation) is list and node["type"] == "array", name
        assert node.get("description") or field.description, name


def test_all_on_example_moves_every_config_key_off_its_default() -> None:
    """So a key the chart dropped or renamed cannot pass unnoticed as the proxy's default."""
    config = VALUE_SETS["all-on"]["config"]
    unchanged = {
        name
        for name, value in config.items()
        if value == Settings.model_fields[name].get_default(call_default_factory=True)
    }
    assert unchanged == {"prefill", "decode"}  # listed empty: the fleet announces instead


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"config": {"not_a_setting": 1}}, "not_a_setting"),
        ({"config": {"port": 9000}}, "'port' not allowed"),
        ({"config": {"upstream_api_key": "in-a-configmap"}}, "upstream_api_key"),
        ({"config": {"api_key": ["in-a-configmap"]}}, "'api_key' not allowed"),
        ({"config": {"admin_token": "in-a-configmap"}}, "'admin_token' not allowed"),
        ({"config": {"registry_secret": "in-a-configmap-1234"}}, "'registry_secret' not allowed"),
        ({"config": {"api_key_file": "/etc/keys"}}, "'api_key_file' not allowed"),
        ({"config": {"admin_token_file": "/etc/token"}}, "'admin_token_file' not allowed"),
        ({"config": {"max_attempts": 11}}, "/config/max_attempts"),
        ({"config": {"retry_backoff_base_seconds": -1}}, "/config/retry_backoff_base_seconds"),
        ({"config": {"outlier_max_ejection_percent": 101}}, "/config/outlier_max_ejection_percent"),
        ({"config": {"queue_timeout": 0}}, "/config/queue_timeout"),
        ({"config": {"open_paths": ["health"]}}, "/config/open_paths/0"),
        ({"config": {"open_paths": ["/health,/ready"]}}, "/config/open_paths/0"),
        ({"auth": {"adminToken": {"existingSecret": "admin", "key": "a/b"}}}, "/auth/adminToken"),
        ({"auth": {"adminToken": {"existingSecret": "a", "token": "t"}}}, "'token' not allowed"),
        ({"auth": {"hmac": {"existingSecret": "a", "key": "k"}}}, "'hmac' not allowed"),
        ({"terminationGracePeriodSeconds": 0}, "/terminationGracePeriodSeconds"),
        ({"config": {"log_level": "verbose"}}, "/config/log_level"),
        ({"config": {"ttl": 0}}, "/config/ttl"),
        ({"config": {"prefill": ["10.0.0.1:8000"]}}, "/config/prefill/0"),
        ({"config": {"prefill": ["http=a:1,zmq=b:2,gpu=0"]}}, "/config/prefill/0"),
        (
            {"config": {"decode": [{"http": "a:1", "zmq": "b:2", "connector": "x"}]}},
            "/config/decode/0",
        ),
        ({"config": {"decode": [{"http": "a:1", "zmq": "b:2", "tp_size": 0}]}}, "/config/decode/0"),
        (
            {"config": {"decode": [{"http": "a:1", "zmq": "b:2", "kv_layout": "X"}]}},
            "/config/decode/0",
        ),
        ({"replicaCount": "two"}, "/replicaCount"),
        ({"ports": {"http": 70000, "registry": 30001}}, "/ports/http"),
        ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
        ({"fleet": {"enabled": True}}, "/fleet/model"),
        ({"fleet": {"connector": "LMCacheConnectorV1"}}, "/fleet/connector"),
        (
            {"fleet": {"connector": "NixlConnector", "announce": {"enabled": False}}},
            "/fleet/announce/enabled",
        ),
        # The default fleet is NixlConnector with the sidecar: PdproxyConnector turns it off.
        ({"fleet": {"connector": "PdproxyConnector"}}, "/fleet/announce/enabled"),
        ({"podDisruptionBudget": {"maxUnavailable": "10"}}, "/podDisruptionBudget/maxUnavailable"),
        (
            {"fleet": {"connector": "PdproxyConnector", "announce": {"enabled": True}}},
            "/fleet/announce/enabled",
        ),
    ],
)
def test_values_violating_the_schema_are_refused(
    tmp_path: Path, values: dict[str, Any], complaint: str
) -> None:
    values_file = tmp_path / "bad-values.yaml"
    values_file.write_text(yaml.safe_dump(values), encoding="utf-8")
    loaded = yaml.safe_load(values_file.read_text(encoding="utf-8"))
    with pytest.raises(helm.HelmValuesError) as refused:
        render(loaded)
    assert complaint in str(refused.value)
    report = helm.lint(CHART, loaded, namespace=NAMESPACE)
    assert any(complaint in error for error in report["errors"]), report


CLIENT_KEYS = {"existingSecret": "client-keys", "key": "keys"}


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        (
            {"fleet": {"connector": "P2pNcclConnector", "decode": {"tensorParallelSize": 2}}},
            "P2pNcclConnector supports symmetric tensor parallelism only",
        ),
        ({"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}, "minReplicas"),
        (
            {"terminationGracePeriodSeconds": 30},
            "terminationGracePeriodSeconds (30) must be larger than config.drain_seconds (30)",
        ),
        (
            {"terminationGracePeriodSeconds": 60, "config": {"drain_seconds": 75}},
            "must be larger than config.drain_seconds",
        ),
        (
            {"auth": {"clientApiKeys": CLIENT_KEYS}, "config": {"open_paths": ["/metrics"]}},
            "config.open_paths must include /health",
        ),
        (
            {"auth": {"clientApiKeys": CLIENT_KEYS}, "config": {"open_paths": []}},
            "config.open_paths must include /health",
        ),
        (
            {
                "auth": {"clientApiKeys": CLIENT_KEYS},
                "config": {"open_paths": ["/health", "/ready"]},
                "serviceMonitor": {"enabled": True},
            },
            "config.open_paths must include /metrics",
        ),
        (
            {
                "auth": {"registrySecret": {"existingSecret": "reg", "key": "k"}},
                "fleet": {"connector": "P2pNcclConnector", "announce": {"enabled": False}},
            },
            "stock vLLM sends unsigned v0 pings",
        ),
    ],
)
def test_inconsistent_values_fail_rendering(values: dict[str, Any], complaint: str) -> None:
    base = VALUE_SETS["fleet-2p2d"]
    merged = {**base, **values}
    if "fleet" in values:
        fleet = {
            **base["fleet"],
            **values["fleet"],
            "decode": {**base["fleet"]["decode"], **values["fleet"].get("decode", {})},
        }
        merged["fleet"] = fleet
    with pytest.raises(helm.HelmError) as refused:
        render(merged)
    assert complaint in str(refused.value)


# ---- Kubernetes schemas (offline) --------------------------------------------------------------


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any connection attempt from Python fails the test: validation must be offline."""

    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("network access during schema validation")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, kubernetes_validate.latest_version()])
def test_every_manifest_is_valid_kubernetes(rendered: Rendered, version: str) -> None:
    unchecked = set()
    for manifest in rendered.manifests:
        key = (manifest["apiVersion"], manifest["kind"])
        if key in CUSTOM_KINDS:
            unchecked.add(key)
            continue
        try:
            kubernetes_validate.validate(manifest, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            name = f"{manifest['kind']}/{manifest['metadata']['name']}"
            pytest.fail(f"{name} is invalid for Kubernetes {version} at {where}: {exc.message}")
    kinds = {(m["apiVersion"], m["kind"]) for m in rendered.manifests}
    assert unchecked == kinds & CUSTOM_KINDS


@pytest.mark.usefixtures("no_network")
def test_the_validator_catches_a_bad_manifest() -> None:
    """Strict validation is real: a misspelt field and a wrong type are both refused."""
    deployment = render({}).proxy_deployment
    typo = json.loads(json.dumps(deployment))
    typo["spec"]["replica"] = 2
    wrong_type = json.loads(json.dumps(deployment))
    pod_spec(wrong_type)["containers"][0]["ports"][0]["containerPort"] = "8000"
    for bad in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, OLDEST_KUBERNETES, strict=True)


def test_rendered_objects_are_namespaced_and_unique(rendered: Rendered) -> None:
    keys = [(m["kind"], m["metadata"]["name"]) for m in rendered.manifests]
    assert len(keys) == len(set(keys))
    for manifest in rendered.manifests:
        assert manifest["metadata"]["namespace"] == NAMESPACE
        assert len(manifest["metadata"]["name"]) <= 63


# ---- the proxy: config file, command, secrets ----------------------------------------------


def _fake_secret(secret: str, key: str) -> str:
    """What the test pretends Secret `secret` holds under `key`: distinct per Secret and key,
    so a reference to the wrong Secret shows, and long enough for a registry secret."""
    return f"fake-{secret}-{key}-0123456789"


def _environ(spec: dict[str, Any]) -> dict[str, str]:
    """A container's environment as the kubelet would build it (Secrets faked)."""
    environ: dict[str, str] = {}
    for item in spec.get("env", []):
        if "value" in item:
            environ[item["name"]] = item["value"]
        elif "secretKeyRef" in item["valueFrom"]:
            ref = item["valueFrom"]["secretKeyRef"]
            environ[item["name"]] = _fake_secret(ref["name"], ref["key"])
        else:
            assert "fieldRef" in item["valueFrom"], item
            environ[item["name"]] = "10.1.2.3"
    return environ


def _proxy_environ(rendered: Rendered) -> dict[str, str]:
    return _environ(container(rendered.proxy_deployment, "pdproxy"))


def _on_host(root: Path, container_path: str) -> Path:
    """Where the test puts what the container sees at `container_path`."""
    return root / container_path.lstrip("/")


def _secret_mounts(workload: dict[str, Any], name: str) -> list[tuple[dict[str, Any], Any]]:
    """(volumeMount, secret volume source) of every Secret volume container `name` mounts."""
    volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
    return [
        (mount, volumes[mount["name"]]["secret"])
        for mount in container(workload, name).get("volumeMounts", [])
        if "secret" in volumes[mount["name"]]
    ]


def _mount_secrets(workload: dict[str, Any], name: str, root: Path) -> dict[str, Path]:
    """Write the files of every Secret volume container `name` mounts, under `root`, as the
    kubelet would (faked contents); {container mount path: where it is on this host}."""
    placed = {}
    for mount, secret in _secret_mounts(workload, name):
        directory = _on_host(root, mount["mountPath"])
        directory.mkdir(parents=True, exist_ok=True)
        for item in secret["items"]:
            text = _fake_secret(secret["secretName"], item["key"]) + "\n"
            (directory / item["path"]).write_text(text, encoding="utf-8")
        placed[mount["mountPath"]] = directory
    return placed


def _mounted_command(rendered: Rendered, root: Path) -> list[str]:
    """The proxy container's argv with its ConfigMap and Secret volumes "mounted" under `root`:
    the config file's paths of Secret files are moved there too, so a path that is not in a
    mounted Secret volume stays unreadable."""
    deployment = rendered.proxy_deployment
    spec = container(deployment, "pdproxy")
    mounts = {m["name"]: m["mountPath"] for m in spec["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(deployment)["volumes"]}
    config_volume = next(n for n, v in volumes.items() if "configMap" in v)
    assert volumes[config_volume]["configMap"]["name"] == rendered.fullname
    config_text = rendered.config_text
    for mount_path, directory in _mount_secrets(deployment, "pdproxy", root).items():
        config_text = config_text.replace(f" {mount_path}/", f" {directory}/")
    config_dir = _on_host(root, mounts[config_volume])
    config_dir.mkdir(parents=True, exist_ok=True)
    (config_dir / CONFIG_FILE_KEY).write_text(config_text, encoding="utf-8")
    argv = [*spec["command"], *spec["args"]]
    return [arg.replace(mounts[config_volume], str(config_dir)) for arg in argv]


def _client_key(rendered: Rendered) -> str | None:
    """A client API key the rendered proxy accepts (faked), None when it requires none."""
    path = rendered.config.get("api_key_file")
    if path is None:
        return None
    for mount, secret in _secret_mounts(rendered.proxy_deployment, "pdproxy"):
        if PurePosixPath(mount["mountPath"]) == PurePosixPath(path).parent:
            (item,) = [i for i in secret["items"] if i["path"] == PurePosixPath(path).name]
            return _fake_secret(secret["secretName"], item["key"])
    raise AssertionError(f"api_key_file {path} is in no mounted Secret volume")


def test_config_keys_are_settings_fields(rendered: Rendered) -> None:
    assert set(rendered.config) <= set(Settings.model_fields)


def test_the_container_command_builds_settings(rendered: Rendered, tmp_path: Path) -> None:
    """Flags, env and the mounted config file go through the proxy's real CLI and Settings."""
    argv = _mounted_command(rendered, tmp_path)
    assert flag_value(argv, "--config") == str(tmp_path / "etc" / "pdproxy" / CONFIG_FILE_KEY)
    settings = serve_settings(argv, _proxy_environ(rendered))
    spec = container(rendered.proxy_deployment, "pdproxy")
    assert settings.port == container_port(spec, "http")
    registry = re.fullmatch(r"tcp://0\.0\.0\.0:(\d+)", settings.registry_bind)
    assert registry is not None, settings.registry_bind
    assert int(registry.group(1)) == container_port(spec, "registry")
    for key, value in rendered.config.items():
        assert key in Settings.model_fields
        if key in ("prefill", "decode"):
            # Each spec, string or map, read with every key it gives (connector, geometry...).
            assert getattr(settings, key) == [StaticInstance.model_validate(v) for v in value]
        elif key in SECRET_FILE_SETTINGS:  # moved to where the test mounted the Secret
            assert str(getattr(settings, key)).endswith(value), key
        else:
            assert getattr(settings, key) == value, key


def test_env_vars_are_settings_the_proxy_accepts(rendered: Rendered) -> None:
    spec = container(rendered.proxy_deployment, "pdproxy")
    for item in spec.get("env", []):
        if item["name"].startswith(ENV_PREFIX):
            field = item["name"].removeprefix(ENV_PREFIX).lower()
            assert field in Settings.model_fields, item["name"]


@pytest.mark.parametrize("name", VALUE_SET_IDS)
def test_upstream_key_comes_from_the_named_secret(name: str, tmp_path: Path) -> None:
    values = VALUE_SETS[name]
    rendered = render(values)
    spec = container(rendered.proxy_deployment, "pdproxy")
    secret = values.get("upstreamApiKey", {}).get("existingSecret", "")
    names = [e["name"] for e in spec.get("env", [])]
    if not secret:
        assert "PDPROXY_UPSTREAM_API_KEY" not in names
        return
    ref = env_value(spec, "PDPROXY_UPSTREAM_API_KEY")["valueFrom"]["secretKeyRef"]
    assert ref == {"name": secret, "key": values["upstreamApiKey"]["key"]}
    argv = _mounted_command(rendered, tmp_path)
    settings = serve_settings(argv, _proxy_environ(rendered))
    assert settings.upstream_api_key is not None
    assert settings.upstream_api_key.get_secret_value() == _fake_secret(secret, ref["key"])
    assert "upstream_api_key" not in rendered.config_text


@pytest.mark.parametrize("name", VALUE_SET_IDS)
def test_auth_secrets_reach_the_proxy(name: str, tmp_path: Path) -> None:
    """Client keys and admin token: files of read-only Secret volumes whose paths the config
    file names; the registry secret: an env var from the Secret. The proxy's own Credentials
    and Settings read them back."""
    values = VALUE_SETS[name]
    auth = values.get("auth", {})
    rendered = render(values)
    spec = container(rendered.proxy_deployment, "pdproxy")
    secret_mounts = _secret_mounts(rendered.proxy_deployment, "pdproxy")
    by_dir = {m["mountPath"]: m for m in spec["volumeMounts"]}
    for setting, value_name in SECRET_FILE_SETTINGS.items():
        ref = auth.get(value_name, {})
        if not ref.get("existingSecret"):
            assert setting not in rendered.config
            continue
        path = PurePosixPath(rendered.config[setting])
        mount = by_dir[str(path.parent)]
        assert mount["readOnly"] is True
        (secret,) = [s for m, s in secret_mounts if m == mount]
        assert secret["secretName"] == ref["existingSecret"]
        assert secret["items"] == [{"key": ref["key"], "path": path.name}]
    enabled = [v for v in SECRET_FILE_SETTINGS.values() if auth.get(v, {}).get("existingSecret")]
    assert len(secret_mounts) == len(enabled)

    argv = _mounted_command(rendered, tmp_path)
    settings = serve_settings(argv, _proxy_environ(rendered))
    credentials = Credentials.from_settings(settings)
    client_key = _client_key(rendered)
    assert credentials.keys_required == (client_key is not None)
    if client_key is not None:
        assert credentials.client_allowed(f"Bearer {client_key}")
        assert not credentials.client_allowed("Bearer not-the-key")
        # The kubelet's probes and Prometheus send no key.
        probes = [spec[p]["httpGet"]["path"] for p in ("livenessProbe", "readinessProbe")]
        assert set(probes) <= set(settings.open_paths)
        if rendered.all("ServiceMonitor"):
            assert "/metrics" in settings.open_paths
    admin = auth.get("adminToken", {})
    assert credentials.admin_enabled == bool(admin.get("existingSecret"))
    if admin.get("existingSecret"):
        token = _fake_secret(admin["existingSecret"], admin["key"])
        assert credentials.admin_allowed(f"Bearer {token}")
        if client_key is not None:
            assert not credentials.admin_allowed(f"Bearer {client_key}")

    registry = auth.get("registrySecret", {})
    names = [e["name"] for e in spec.get("env", [])]
    if not registry.get("existingSecret"):
        assert SECRET_ENV not in names and settings.registry_secret is None
        return
    ref = env_value(spec, SECRET_ENV)["valueFrom"]["secretKeyRef"]
    assert ref == {"name": registry["existingSecret"], "key": registry["key"]}
    assert settings.registry_secret is not None
    assert settings.registry_secret.get_secret_value() == _fake_secret(ref["name"], ref["key"])


def test_secrets_are_read_only_private_files_never_config(rendered: Rendered) -> None:
    """Every Secret volume, in every workload, is mounted read-only, 0440 at most and readable
    by the container's user; the chart renders no Secret and no secret setting into its
    ConfigMap."""
    assert rendered.all("Secret") == []
    assert not set(rendered.config) & FROM_SECRET
    for workload in rendered.all("Deployment"):
        pod = pod_spec(workload)
        for spec in pod["containers"]:
            for mount, secret in _secret_mounts(workload, spec["name"]):
                assert mount["readOnly"] is True, mount
                mode = secret["defaultMode"]
                assert mode & 0o7337 == 0, oct(mode)  # no write, execute or world bits
                user = spec.get("securityContext", {}).get(
                    "runAsUser", pod.get("securityContext", {}).get("runAsUser", 0)
                )
                if user != 0:  # root-owned files: a non-root user reads them as the fsGroup
                    assert mode & 0o040 and pod["securityContext"].get("fsGroup") is not None


def test_probe_paths_are_routes_of_the_proxy_app(rendered: Rendered) -> None:
    app = PdproxyApp(Settings())
    routes = {getattr(r, "path", None) for r in app.api.routes} | set(COMPLETION_PATHS)
    spec = container(rendered.proxy_deployment, "pdproxy")
    assert spec["livenessProbe"]["httpGet"]["path"] == "/health"
    assert spec["readinessProbe"]["httpGet"]["path"] == "/ready"
    for probe in ("livenessProbe", "readinessProbe"):
        get = spec[probe]["httpGet"]
        assert get["path"] in routes
        container_port(spec, get["port"])


@pytest.mark.parametrize("name", VALUE_SET_IDS)
def test_the_rendered_proxy_serves_its_probes(name: str, tmp_path: Path) -> None:
    """`pdproxy serve` started from the rendered command and config file answers the probes."""
    rendered = render(VALUE_SETS[name])
    argv = _mounted_command(rendered, tmp_path / "root")
    spec = container(rendered.proxy_deployment, "pdproxy")
    env = _proxy_environ(rendered)
    client_key = _client_key(rendered)
    with running_proxy(argv, env, tmp_path / "pdproxy.log") as url:
        status, _ = http_get(
            url + spec["livenessProbe"]["httpGet"]["path"], timeout=PROBE_TIMEOUT_S
        )
        assert status == 200
        status, body = http_get(
            url + spec["readinessProbe"]["httpGet"]["path"], timeout=PROBE_TIMEOUT_S
        )
        static = rendered.config.get("prefill") and rendered.config.get("decode")
        # Ready only once a prefill instance has a compatible decode instance: here only the
        # statically configured ones can be there (nothing announces).
        assert status == (200 if static else 503), body
        assert json.loads(body)["status"] == ("ready" if static else "not_ready")
        status, body = http_get(url + "/metrics", timeout=PROBE_TIMEOUT_S)
        assert status == 200 and b"pdproxy_registry_instances" in body
        if client_key is not None:  # the keys come from the mounted Secret file
            status, _ = http_get(url + "/v1/instances", timeout=PROBE_TIMEOUT_S)
            assert status == 401
            status, _ = http_get(
                url + "/v1/instances",
                headers={"Authorization": "Bearer x"},
                timeout=PROBE_TIMEOUT_S,
            )
            assert status == 401
        headers = {} if client_key is None else {"Authorization": f"Bearer {client_key}"}
        status, body = http_get(url + "/v1/instances", headers=headers, timeout=PROBE_TIMEOUT_S)
        assert status == 200, body
        listed = {i["http_address"] for i in json.loads(body)["instances"]}
        assert len(listed) == len(rendered.config.get("prefill", [])) + len(
            rendered.config.get("decode", [])
        )


def test_proxy_pod_is_locked_down(rendered: Rendered) -> None:
    deployment = rendered.proxy_deployment
    pod = pod_spec(deployment)
    spec = container(deployment, "pdproxy")
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    # The API token only where Kubernetes discovery needs it (tests/deploy/test_helm_scaling.py).
    discovery = rendered.config.get("discovery") == "kubernetes"
    assert pod["automountServiceAccountToken"] is discovery
    security = spec["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert spec["resources"]["requests"] and spec["resources"]["limits"]


def test_termination_grace_outlasts_the_drain(rendered: Rendered, tmp_path: Path) -> None:
    """SIGTERM drains for drain_seconds; Kubernetes must not kill the proxy before it is done."""
    settings = serve_settings(_mounted_command(rendered, tmp_path), _proxy_environ(rendered))
    grace = pod_spec(rendered.proxy_deployment)["terminationGracePeriodSeconds"]
    assert isinstance(grace, int)
    assert grace >= settings.drain_seconds + FINAL_GRACE_SECONDS + SHUTDOWN_MARGIN_SECONDS


def test_default_grace_follows_pdproxys_drain_default() -> None:
    """The chart assumes pdproxy's default drain_seconds when config does not set it."""
    default = Settings.model_fields["drain_seconds"].default
    grace = pod_spec(render({}).proxy_deployment)["terminationGracePeriodSeconds"]
    assert grace == math.ceil(default) + 10


@pytest.mark.parametrize(
    ("values", "grace"),
    [
        ({"config": {"drain_seconds": 0}}, 10),
        ({"config": {"drain_seconds": 12.2}}, 23),
        ({"config": {"drain_seconds": 120}}, 130),
        ({"terminationGracePeriodSeconds": 90}, 90),
        ({"terminationGracePeriodSeconds": 31, "config": {"drain_seconds": 30.5}}, 31),
    ],
)
def test_termination_grace_values(values: dict[str, Any], grace: int) -> None:
    assert pod_spec(render(values).proxy_deployment)["terminationGracePeriodSeconds"] == grace


def test_the_pod_runs_as_the_images_user() -> None:
    _, stages = read_dockerfile(REPO / "Dockerfile")
    user = stages[-1].get("USER")[-1].text
    pod = pod_spec(render({}).proxy_deployment)["securityContext"]
    assert user == f"{pod['runAsUser']}:{pod['runAsGroup']}"


def test_image_defaults_to_the_app_version() -> None:
    with helm.Chart.load(CHART) as chart:
        app_version = chart.metadata["appVersion"]
    spec = container(render({}).proxy_deployment, "pdproxy")
    assert spec["image"] == f"pdproxy:{app_version}"


# ---- Services and the objects that point at the proxy ------------------------------------------


def test_services_route_to_the_proxy_ports(rendered: Rendered) -> None:
    deployment = rendered.proxy_deployment
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    spec = container(deployment, "pdproxy")
    for service, port_name in (
        (rendered.http_service, "http"),
        (rendered.registry_service, "registry"),
    ):
        assert selects(service["spec"]["selector"], labels)
        (port,) = service["spec"]["ports"]
        assert port["targetPort"] == port_name
        container_port(spec, port_name)
    # Announcements must reach a proxy that is not ready yet: it becomes ready through them;
    # and every replica: the name resolves to each proxy pod (headless).
    assert rendered.registry_service["spec"]["publishNotReadyAddresses"] is True
    assert rendered.registry_service["spec"]["clusterIP"] == "None"
    for deployment in rendered.all("Deployment"):
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selects(selector, deployment["spec"]["template"]["metadata"]["labels"])


def test_optional_objects_target_the_proxy(rendered: Rendered) -> None:
    deployment = rendered.proxy_deployment
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for hpa in rendered.all("HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("Deployment", rendered.fullname)
        assert "replicas" not in deployment["spec"]  # the HPA owns it
    for pdb in rendered.all("PodDisruptionBudget"):
        assert selects(pdb["spec"]["selector"]["matchLabels"], labels)
    for monitor in rendered.all("ServiceMonitor"):
        selector = monitor["spec"]["selector"]["matchLabels"]
        assert selects(selector, rendered.http_service["metadata"]["labels"])
        assert not selects(selector, rendered.registry_service["metadata"]["labels"])
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["port"] in {p["name"] for p in rendered.http_service["spec"]["ports"]}
        assert endpoint["path"] == "/metrics"
        # No pdproxy series has an `instance` label to keep: the target's label stands.
        assert "honorLabels" not in endpoint
        assert monitor["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
    spec = container(deployment, "pdproxy")
    fleet_labels = [d["spec"]["template"]["metadata"]["labels"] for d in rendered.fleet()]
    for policy in rendered.all("NetworkPolicy"):
        assert selects(policy["spec"]["podSelector"]["matchLabels"], labels)
        rules = {rule["ports"][0]["port"]: rule for rule in policy["spec"]["ingress"]}
        assert set(rules) == {"http", "registry"}
        for port_name in rules:
            container_port(spec, port_name)
        peers = rules["registry"].get("from", [])
        for pod_labels in fleet_labels:  # every fleet pod may announce
            assert any(
                selects(p["podSelector"]["matchLabels"], pod_labels)
                for p in peers
                if "podSelector" in p
            )


def test_every_optional_object_is_off_by_default_and_on_in_all_on() -> None:
    optional = {"HorizontalPodAutoscaler", "NetworkPolicy", "ServiceMonitor", "Role", "RoleBinding"}
    assert {m["kind"] for m in render({}).manifests} & optional == set()
    all_on = render(VALUE_SETS["all-on"])
    assert {m["kind"] for m in all_on.manifests} >= optional | {"ServiceAccount"}
    assert len(all_on.fleet()) == 2


# ---- the vLLM fleet --------------------------------------------------------------------------


FLEET_SETS = [name for name in VALUE_SET_IDS if VALUE_SETS[name].get("fleet", {}).get("enabled")]


def _env_refs_resolve(spec: dict[str, Any]) -> None:
    """Every $(VAR) in command, args and env values names an env var defined before it."""
    defined: list[str] = []
    for item in spec.get("env", []):
        for ref in re.findall(r"\$\((\w+)\)", item.get("value", "")):
            assert ref in defined, f"{item['name']} uses $({ref}) before it is defined"
        defined.append(item["name"])
    for arg in [*spec.get("command", []), *spec.get("args", [])]:
        for ref in re.findall(r"\$\((\w+)\)", arg):
            assert ref in defined, f"{arg!r} uses $({ref}), not an env var of {spec['name']}"


@pytest.mark.parametrize("name", FLEET_SETS)
def test_fleet_announces_to_the_registry_service(name: str, tmp_path: Path) -> None:
    values = VALUE_SETS[name]
    rendered = render(values)
    proxy = serve_settings(_mounted_command(rendered, tmp_path / "proxy"), _proxy_environ(rendered))
    registry = rendered.registry_service
    registry_host = f"{registry['metadata']['name']}.{NAMESPACE}.svc.cluster.local"
    (registry_port,) = registry["spec"]["ports"]
    announce_sidecar = values["fleet"].get("announce", {}).get("enabled", False)
    roles = {}
    for deployment in rendered.fleet():
        role = deployment["metadata"]["labels"]["app.kubernetes.io/component"]
        roles[role] = deployment
        spec = container(deployment, "vllm")
        args = spec["args"]
        kv = json.loads(flag_value(args, "--kv-transfer-config"))
        assert kv["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
        extra = kv["kv_connector_extra_config"]
        if announce_sidecar:  # the sidecar announces; vLLM's own v0 ping is off
            assert "proxy_ip" not in extra and "proxy_port" not in extra
        else:
            assert extra["proxy_ip"] == registry_host
            assert extra["proxy_port"] == str(registry_port["port"])
        # vLLM builds the address as proxy_ip + ":" + proxy_port: strings, not numbers.
        assert all(isinstance(v, str) for v in extra.values())
        http_port = container_port(spec, "http")
        assert extra["http_port"] == flag_value(args, "--port") == str(http_port)
        tp = int(flag_value(args, "--tensor-parallel-size"))
        assert [container_port(spec, f"kv-r{r}") for r in range(tp)] == [
            kv["kv_port"] + r for r in range(tp)
        ]
        # vLLM's KVTransferConfig forbids unknown keys, and 0.32 dropped kv_ip and
        # kv_buffer_size: only keys every supported release accepts, plus kv_buffer_size for
        # P2pNcclConnector (which reads it, in the releases that ship it).
        common = {"kv_connector", "kv_role", "kv_port", "kv_connector_extra_config"}
        if kv["kv_connector"] == "PdproxyConnector":
            assert kv["kv_connector_module_path"] == "pdproxy.vllm_side.connector"
            assert set(kv) == common | {"kv_connector_module_path"}
            # What pdproxy's connector makes of it, with the pod IP the kubelet substitutes.
            ip = "10.1.2.3"
            read = connector_settings(
                kv["kv_role"],
                None,
                kv["kv_port"],
                {k: v.replace("$(POD_IP)", ip) for k, v in extra.items()},
                default_host="not-the-pod-ip",
            )
            assert read.announces
            assert read.role is Role(role)
            assert read.http_address == f"{ip}:{http_port}"
            assert read.zmq_address == f"{ip}:{kv['kv_port']}"
            assert read.registry == f"{registry_host}:{registry_port['port']}"
            secret_file = extra.get("registry_secret_file")
            assert read.registry_secret_file == (None if secret_file is None else Path(secret_file))
            default_report = DEFAULT_VALUES["fleet"]["prefillWorkReportSeconds"]
            report = values["fleet"].get("prefillWorkReportSeconds", default_report)
            assert read.prefill_work_report_s == report
        elif kv["kv_connector"] == "NixlConnector":
            # NIXL reads no key of pdproxy's; its side channel is the announced zmq address.
            assert set(kv) == common
            assert env_value(spec, "VLLM_NIXL_SIDE_CHANNEL_HOST")["value"] == "$(POD_IP)"
            assert env_value(spec, "VLLM_NIXL_SIDE_CHANNEL_PORT")["value"] == str(kv["kv_port"])
            assert announce_sidecar, "nothing else announces a NixlConnector instance"
        else:
            assert kv["kv_connector"] == "P2pNcclConnector"
            assert set(kv) == common | {"kv_buffer_size"}
            assert kv["kv_buffer_size"] == values["fleet"][role]["kvBufferSize"]
        # The pod IP is bound and announced; P and D keep one request id (vLLM >= 0.14).
        pod_ip = env_value(spec, "POD_IP")["valueFrom"]["fieldRef"]["fieldPath"]
        assert pod_ip == "status.podIP"
        assert flag_value(args, "--host") == extra["kv_ip"] == "$(POD_IP)"
        assert env_value(spec, "VLLM_HOST_IP")["value"] == "$(POD_IP)"
        assert env_value(spec, "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION")["value"] == "1"
        _env_refs_resolve(spec)
        gpu = values["fleet"].get("gpuResourceName", "nvidia.com/gpu")
        assert spec["resources"]["limits"][gpu] == spec["resources"]["requests"][gpu] == tp
        assert deployment["spec"]["replicas"] == values["fleet"][role]["replicas"]
        assert flag_value(args, "--model") == values["fleet"]["model"]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert spec[probe]["httpGet"] == {"path": "/health", "port": "http"}
        names = [c["name"] for c in pod_spec(deployment)["containers"]]
        assert names == (["vllm", "announce"] if announce_sidecar else ["vllm"])
        if announce_sidecar:
            _check_announce_sidecar(deployment, role, kv, registry_host, registry_port["port"])
        _check_fleet_signing(deployment, values, proxy, kv, tmp_path / role)
    assert set(roles) == {"prefill", "decode"}


def _check_fleet_signing(
    deployment: dict[str, Any],
    values: dict[str, Any],
    proxy: Settings,
    kv: dict[str, Any],
    root: Path,
) -> None:
    """With auth.registrySecret, the fleet signs with the Secret the proxy verifies with: the
    announce sidecar from its env, PdproxyConnector from a file of a mounted Secret volume
    (named by registry_secret_file). Stock vLLM alone cannot sign: its v0 must be allowed."""
    registry = values.get("auth", {}).get("registrySecret", {})
    fleet = values["fleet"]
    extra = kv["kv_connector_extra_config"]
    containers = pod_spec(deployment)["containers"]
    if not registry.get("existingSecret"):
        assert proxy.registry_secret is None
        assert "registry_secret_file" not in extra
        assert _secret_mounts(deployment, "vllm") == []
        assert all(SECRET_ENV not in _environ(spec) for spec in containers)
        return
    assert proxy.registry_secret is not None
    verifier = Verifier(proxy.registry_secret.get_secret_value().encode())
    signers: list[bytes] = []
    if fleet.get("announce", {}).get("enabled", False):
        sidecar = container(deployment, "announce")
        ref = env_value(sidecar, SECRET_ENV)["valueFrom"]["secretKeyRef"]
        assert ref == {"name": registry["existingSecret"], "key": registry["key"]}
        args = parse_pdproxy([a.replace("$(POD_IP)", "10.1.2.3") for a in sidecar["command"]])
        secret = registry_secret(args, _environ(sidecar))
        assert secret is not None
        signers.append(secret)
    if kv["kv_connector"] == "PdproxyConnector":
        path = PurePosixPath(extra["registry_secret_file"])
        placed = _mount_secrets(deployment, "vllm", root)
        assert str(path.parent) in placed, "registry_secret_file is in no mounted Secret volume"
        signers.append(read_secret_file(placed[str(path.parent)] / path.name))
    else:
        assert "registry_secret_file" not in extra  # stock vLLM never reads it
        assert _secret_mounts(deployment, "vllm") == []
    if not signers:  # stock vLLM's own unsigned v0 pings
        assert proxy.registry_allow_unsigned_v0
    for secret in signers:
        now = time.time()
        message = {"v": 1, "type": "announce", "http": extra["http_port"]}
        verifier.verify(signed(message, secret, now, new_nonce()), now)


def test_a_signed_registry_admits_stock_vllm_only_with_unsigned_v0() -> None:
    registry = {"existingSecret": "reg", "key": "secret"}
    stock = {"connector": "P2pNcclConnector", "announce": {"enabled": False}}
    values = {
        **VALUE_SETS["fleet-2p2d"],
        "fleet": {**VALUE_SETS["fleet-2p2d"]["fleet"], **stock},
        "auth": {"registrySecret": registry},
        "config": {"registry_allow_unsigned_v0": True},
    }
    rendered = render(values)
    for deployment in rendered.fleet():
        assert [c["name"] for c in pod_spec(deployment)["containers"]] == ["vllm"]
        assert _secret_mounts(deployment, "vllm") == []
    assert "announces unsigned v0" in rendered.notes


def _check_announce_sidecar(
    deployment: dict[str, Any], role: str, kv: dict[str, Any], host: str, port: int
) -> None:
    vllm = container(deployment, "vllm")
    sidecar = container(deployment, "announce")
    argv = sidecar["command"]
    assert argv[:2] == ["pdproxy", "announce"]
    # `pdproxy announce` is being added to the CLI: its agreed flags, each given once.
    flags = [arg for arg in argv[2:] if arg.startswith("--")]
    assert sorted(flags) == sorted(ANNOUNCE_FLAGS)
    # As the kubelet runs it (with $(POD_IP) expanded), through pdproxy's real parser.
    parsed = parse_pdproxy([arg.replace("$(POD_IP)", "10.1.2.3") for arg in argv])
    assert parsed.command == "announce"
    assert parsed.registry == f"{host}:{port}"
    http_port = kv["kv_connector_extra_config"]["http_port"]
    assert flag_value(argv, "--role") == {"prefill": "P", "decode": "D"}[role]
    assert flag_value(argv, "--registry") == f"{host}:{port}"
    assert flag_value(argv, "--http-address") == f"$(POD_IP):{http_port}"
    assert flag_value(argv, "--zmq-address") == f"$(POD_IP):{kv['kv_port']}"
    assert flag_value(argv, "--metrics-url") == f"http://$(POD_IP):{http_port}/metrics"
    assert flag_value(argv, "--model") == flag_value(vllm["args"], "--served-model-name")
    connector = {
        "PdproxyConnector": "pdproxy",
        "P2pNcclConnector": "p2p_nccl",
        "NixlConnector": "nixl",
    }
    assert flag_value(argv, "--connector") == connector[kv["kv_connector"]]
    _env_refs_resolve(sidecar)
    assert sidecar["securityContext"]["runAsNonRoot"] is True
    assert sidecar["securityContext"]["readOnlyRootFilesystem"] is True


def test_fleet_is_off_by_default() -> None:
    assert render({}).fleet() == []


def test_both_connectors_are_rendered() -> None:
    connectors = set()
    for name in FLEET_SETS:
        for deployment in render(VALUE_SETS[name]).fleet():
            args = container(deployment, "vllm")["args"]
            connectors.add(json.loads(flag_value(args, "--kv-transfer-config"))["kv_connector"])
    # The examples run current vLLM (NixlConnector) or pdproxy's own connector.
    assert connectors == {"NixlConnector", "PdproxyConnector"}


def test_fleet_example_is_two_prefill_two_decode() -> None:
    rendered = render(VALUE_SETS["fleet-2p2d"])
    replicas = {
        d["metadata"]["labels"]["app.kubernetes.io/component"]: d["spec"]["replicas"]
        for d in rendered.fleet()
    }
    assert replicas == {"prefill": 2, "decode": 2}


def _model_volumes(rendered: Rendered) -> list[dict[str, Any]]:
    """The `models` volume of each fleet Deployment, checked to be mounted as HF_HOME."""
    volumes = []
    for deployment in rendered.fleet():
        vllm = container(deployment, "vllm")
        (mount,) = [m for m in vllm["volumeMounts"] if m["name"] == "models"]
        assert env_value(vllm, "HF_HOME")["value"] == mount["mountPath"]
        (volume,) = [v for v in pod_spec(deployment)["volumes"] if v["name"] == "models"]
        volumes.append(volume)
    assert len(volumes) == 2
    return volumes


def _with_model_cache(cache: dict[str, Any]) -> Rendered:
    fleet = {**VALUE_SETS["fleet-2p2d"]["fleet"], "modelCache": cache}
    return render({**VALUE_SETS["fleet-2p2d"], "fleet": fleet})


def test_the_model_volume_is_an_emptydir_without_a_claim() -> None:
    rendered = _with_model_cache({"persistentVolumeClaim": {"enabled": False}})
    assert all(v == {"name": "models", "emptyDir": {}} for v in _model_volumes(rendered))
    assert rendered.all("PersistentVolumeClaim") == []


def test_the_model_volume_can_be_an_existing_claim() -> None:
    rendered = _with_model_cache({"existingClaim": "weights", "mountPath": "/data/hf"})
    for volume in _model_volumes(rendered):
        assert volume == {"name": "models", "persistentVolumeClaim": {"claimName": "weights"}}
    assert rendered.all("PersistentVolumeClaim") == []  # the operator's: not the chart's


def test_the_chart_can_make_the_model_claim() -> None:
    claim = {"enabled": True, "size": "300Gi", "storageClass": "fast-nfs"}
    rendered = _with_model_cache({"persistentVolumeClaim": claim})
    name = f"{rendered.fullname}-models"
    made = rendered.one("PersistentVolumeClaim", name)
    assert made["metadata"]["namespace"] == NAMESPACE
    assert made["spec"] == {
        "accessModes": ["ReadWriteMany"],  # the default: every fleet pod, on any node
        "storageClassName": "fast-nfs",
        "resources": {"requests": {"storage": "300Gi"}},
    }
    for volume in _model_volumes(rendered):
        assert volume == {"name": "models", "persistentVolumeClaim": {"claimName": name}}
    # No class named: the cluster's default (storageClassName left out, not "").
    rendered = _with_model_cache({"persistentVolumeClaim": {"enabled": True}})
    assert "storageClassName" not in rendered.one("PersistentVolumeClaim", name)["spec"]
    # The fleet example keeps its weights on such a claim.
    example = render(VALUE_SETS["fleet-2p2d"])
    assert example.one("PersistentVolumeClaim", name)["spec"]["resources"]["requests"] == {
        "storage": "100Gi"
    }


def test_an_existing_claim_and_a_made_one_are_refused_together() -> None:
    with pytest.raises(helm.HelmError) as refused:
        _with_model_cache({"existingClaim": "weights", "persistentVolumeClaim": {"enabled": True}})
    assert "set existingClaim or persistentVolumeClaim.enabled, not both" in str(refused.value)


def test_no_model_claim_without_the_fleet() -> None:
    values = {"fleet": {"modelCache": {"persistentVolumeClaim": {"enabled": True}}}}
    assert render(values).all("PersistentVolumeClaim") == []


def test_registry_dns_follows_namespace_and_cluster_domain() -> None:
    values = {**VALUE_SETS["fleet-2p2d-pdproxy-connector"], "clusterDomain": "corp.internal"}
    rendered = render(values)
    for deployment in rendered.fleet():
        kv = json.loads(flag_value(container(deployment, "vllm")["args"], "--kv-transfer-config"))
        host = kv["kv_connector_extra_config"]["proxy_ip"]
        assert host == f"{rendered.fullname}-registry.{NAMESPACE}.svc.corp.internal"


def test_notes_name_the_registry_and_warn_about_replicas() -> None:
    notes = render({}).notes
    assert f"{render({}).fullname}-registry.{NAMESPACE}.svc.cluster.local:30001" in notes
    assert "WARNING" not in notes and "Proxy replicas: 2" in notes
    # Stock vLLM's own ping reaches one replica: warned, unless discovery covers it.
    fleet = VALUE_SETS["fleet-2p2d"]["fleet"]
    p2p_nccl = {"connector": "P2pNcclConnector", "announce": {"enabled": False}}
    stock = render({**VALUE_SETS["fleet-2p2d"], "fleet": {**fleet, **p2p_nccl}}).notes
    assert "WARNING: stock vLLM's own v0 ping reaches one replica only" in stock
    discovered = render({**VALUE_SETS["fleet-2p2d"], "config": {"discovery": "kubernetes"}})
    assert "WARNING" not in discovered.notes
    assert "annotate pod POD pdproxy.io/drain=true" in discovered.notes
    all_on = render(VALUE_SETS["all-on"]).notes
    assert "pdproxy announce" in all_on and "example.com/drain=true" in all_on


def test_notes_mention_auth_only_when_enabled() -> None:
    notes = render({}).notes
    assert "Auth" not in notes and "Bearer" not in notes
    assert "The registry is unauthenticated" in notes
    notes = render(VALUE_SETS["all-on"]).notes
    assert "Client API keys: Secret pdproxy-client-keys, key keys" in notes
    assert "everywhere but /health, /ready, /metrics, /v1/models" in notes
    assert "Admin token: Secret pdproxy-admin, key token" in notes
    assert "Registry secret: Secret pdproxy-registry, key secret" in notes
    assert "The chart's fleet signs its announcements with it" in notes
    assert 'curl -s -H "Authorization: Bearer $API_KEY"' in notes
    assert "unauthenticated" not in notes


def test_proxy_command_is_a_valid_serve_invocation(rendered: Rendered) -> None:
    spec = container(rendered.proxy_deployment, "pdproxy")
    args = parse_pdproxy([*spec["command"], *spec["args"]])
    assert args.command == "serve"
