"""deploy/docker-compose.yaml: every command it runs is a valid `pdproxy` invocation (parsed by
the real CLI parser), and the demo's parts point at each other (registry, scrape, data source)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from pdproxy import __version__
from pdproxy.base.roles import Role
from pdproxy.config import Settings
from pdproxy.fake_vllm.arguments import config_from_args
from pdproxy.fake_vllm.config import WorkerConfig
from tests.deploy.support import REPO, parse_pdproxy, read_dockerfile, serve_settings

DEPLOY = REPO / "deploy"
COMPOSE: dict[str, Any] = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text("utf-8"))
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
_, STAGES = read_dockerfile(REPO / "Dockerfile")
IMAGE_ENTRYPOINT = STAGES[-1].get("ENTRYPOINT")[-1].exec_form()
IMAGE_CMD = STAGES[-1].get("CMD")[-1].exec_form()
PDPROXY_SERVICES = sorted(name for name, s in SERVICES.items() if "build" in s)
THIRD_PARTY = {"prometheus", "grafana"}


def argv_of(service: dict[str, Any]) -> list[str]:
    """What the container runs: entrypoint (or the image's) + command (or the image's CMD)."""
    entrypoint = service.get("entrypoint", IMAGE_ENTRYPOINT)
    command = service.get("command", IMAGE_CMD)
    assert isinstance(entrypoint, list) and isinstance(command, list), "use exec (list) form"
    return [*entrypoint, *command]


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    assert isinstance(env, dict), "environment as a mapping"
    return {str(k): str(v) for k, v in env.items()}


def proxy_settings() -> Settings:
    return serve_settings(argv_of(SERVICES["pdproxy"]), environment(SERVICES["pdproxy"]))


def worker_config(name: str) -> WorkerConfig:
    args = parse_pdproxy(argv_of(SERVICES[name]))
    assert args.command == "fake-worker"
    return config_from_args(args)


def workers() -> list[str]:
    return [n for n in PDPROXY_SERVICES if argv_of(SERVICES[n])[:2] == ["pdproxy", "fake-worker"]]


def test_services_are_the_proxy_a_2p2d_fake_fleet_and_monitoring() -> None:
    assert set(SERVICES) == {*PDPROXY_SERVICES, *THIRD_PARTY}
    roles = sorted(worker_config(name).role for name in workers())
    assert roles == [Role.DECODE, Role.DECODE, Role.PREFILL, Role.PREFILL]
    assert set(PDPROXY_SERVICES) == {"pdproxy", *workers()}


def test_every_pdproxy_service_is_built_from_the_dockerfile() -> None:
    images = {SERVICES[name]["image"] for name in PDPROXY_SERVICES}
    assert images == {f"pdproxy:{__version__}"}
    for name in PDPROXY_SERVICES:
        build = SERVICES[name]["build"]
        context = (DEPLOY / build["context"]).resolve()
        assert (context / build["dockerfile"]).resolve() == REPO / "Dockerfile"


@pytest.mark.parametrize("name", PDPROXY_SERVICES)
def test_every_command_is_a_valid_pdproxy_invocation(name: str) -> None:
    argv = argv_of(SERVICES[name])
    args = parse_pdproxy(argv)
    assert args.command in ("serve", "fake-worker")
    if args.command == "serve":
        serve_settings(argv, environment(SERVICES[name]))
    else:
        config_from_args(args)


def test_an_invalid_command_is_caught() -> None:
    """The check above can fail: an unknown flag and a bad value are both refused."""
    with pytest.raises(AssertionError, match="refused by pdproxy's parser"):
        parse_pdproxy(["pdproxy", "fake-worker", "--role", "P", "--port", "1", "--kv-prot", "2"])
    with pytest.raises(AssertionError, match="refused by pdproxy's parser"):
        parse_pdproxy(["pdproxy", "fake-worker", "--role", "X", "--port", "1", "--kv-port", "2"])
    with pytest.raises(AssertionError, match="not a pdproxy command"):
        parse_pdproxy(["python", "-m", "http.server"])


def test_the_proxy_listens_where_the_demo_expects() -> None:
    settings = proxy_settings()
    assert settings.host == "0.0.0.0"
    published = {p.split(":")[-1] for p in SERVICES["pdproxy"]["ports"]}
    assert published == {str(settings.port)}


@pytest.mark.parametrize("name", workers())
def test_workers_announce_to_the_proxys_registry(name: str) -> None:
    cfg = worker_config(name)
    registry_port = int(proxy_settings().registry_bind.rsplit(":", 1)[1])
    assert cfg.proxy is not None
    assert (cfg.proxy.host, cfg.proxy.port) == ("pdproxy", registry_port)
    # The worker binds and announces its service name, which the proxy resolves on the network.
    assert cfg.http.host == cfg.kv.host == name
    assert cfg.announce == "v1"
    health = SERVICES[name]["healthcheck"]["test"]
    assert f"http://{name}:{cfg.http.port}/health" in health[-1]
    assert SERVICES[name]["depends_on"]["pdproxy"]["condition"] == "service_healthy"


def test_workers_serve_one_model() -> None:
    assert {worker_config(name).model for name in workers()} == {"fake-model"}


def test_prometheus_scrapes_the_proxy() -> None:
    mount = next(v for v in SERVICES["prometheus"]["volumes"] if "prometheus.yml" in v)
    source, target, _ = mount.split(":")
    assert (DEPLOY / source).resolve() == DEPLOY / "prometheus.yml"
    assert f"--config.file={target}" in SERVICES["prometheus"]["command"]
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text(encoding="utf-8"))
    (job,) = config["scrape_configs"]
    (static,) = job["static_configs"]
    assert static["targets"] == [f"pdproxy:{proxy_settings().port}"]
    assert job["metrics_path"] == "/metrics"
    # pdproxy's series carry no `instance` label of their own: Prometheus' wins untouched.
    assert "honor_labels" not in job


def _mounts(service: str) -> dict[str, Path]:
    """Container path -> host path of a service's bind mounts."""
    out = {}
    for volume in SERVICES[service]["volumes"]:
        source, target = volume.split(":")[:2]
        out[target] = (DEPLOY / source).resolve()
    return out


def _in_container(mounts: dict[str, Path], path: str) -> Path:
    for target, source in mounts.items():
        if path == target or path.startswith(target + "/"):
            return source / path.removeprefix(target).lstrip("/")
    raise AssertionError(f"{path} is not mounted into the container")


def test_grafana_provisions_the_datasource_and_the_dashboard() -> None:
    mounts = _mounts("grafana")
    provisioning = _in_container(mounts, "/etc/grafana/provisioning")
    (source_file,) = sorted((provisioning / "datasources").glob("*.yaml"))
    (datasource,) = yaml.safe_load(source_file.read_text(encoding="utf-8"))["datasources"]
    prometheus_port = SERVICES["prometheus"]["ports"][0].split(":")[-1]
    assert datasource["url"] == f"http://prometheus:{prometheus_port}"
    assert datasource["type"] == "prometheus"
    (provider_file,) = sorted((provisioning / "dashboards").glob("*.yaml"))
    (provider,) = yaml.safe_load(provider_file.read_text(encoding="utf-8"))["providers"]
    dashboards = _in_container(mounts, provider["options"]["path"])
    assert dashboards == DEPLOY / "grafana" / "dashboards"
    assert (dashboards / "pdproxy.json").is_file()
    home = SERVICES["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert _in_container(mounts, home) == dashboards / "pdproxy.json"
    # The dashboard's data source variable defaults to the provisioned uid.
    dashboard = yaml.safe_load((dashboards / "pdproxy.json").read_text(encoding="utf-8"))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["current"]["value"] == datasource["uid"]
    # The demo's series have no pod label: the pod variable's All must still match them.
    assert variables["pod"]["allValue"] == ".*" and variables["pod"]["includeAll"]
