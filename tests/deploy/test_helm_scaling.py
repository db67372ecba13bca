"""helm/pdproxy for several proxy replicas: the headless registry Service, the disruption budget,
the autoscaler, the spread across nodes, and Kubernetes discovery, whose RBAC, selectors and
annotation names must match what the proxy built from the rendered config reads."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from pdproxy.base.roles import Role
from pdproxy.config import Settings
from pdproxy.registry.kubernetes import namespace, pod_keys, selectors
from pdproxy.registry.messages import Connector
from pdproxy.registry.pods import instance_from_pod
from tests.deploy.support import (
    NAMESPACE,
    VALUE_SETS,
    Manifest,
    Rendered,
    container,
    container_port,
    pod_spec,
    render,
    selects,
    serve_settings,
)
from tests.deploy.test_helm_chart import _mounted_command, _proxy_environ

POD_IP = "10.4.0.9"
FLEET = VALUE_SETS["fleet-2p2d"]
DISCOVERY_SETS = {
    "chart-defaults": {**FLEET, "config": {"discovery": "kubernetes"}},
    "all-on": VALUE_SETS["all-on"],
    "pdproxy-connector": {
        **VALUE_SETS["fleet-2p2d-pdproxy-connector"],
        "config": {"discovery": "kubernetes", "kubernetes_drain_annotation": "ops/drain"},
    },
}


def proxy_settings(rendered: Rendered, tmp_path: Path) -> Settings:
    """The Settings `pdproxy serve` builds in the rendered container (config file, env)."""
    return serve_settings(_mounted_command(rendered, tmp_path), _proxy_environ(rendered))


def as_running_pod(template: dict[str, Any]) -> dict[str, Any]:
    """A fleet Deployment's pod template as the API would serve one of its pods, Ready."""
    return {
        "metadata": {**copy.deepcopy(template["metadata"]), "name": "p", "uid": "u"},
        "status": {"podIP": POD_IP, "conditions": [{"type": "Ready", "status": "True"}]},
    }


def selector_labels(selector: str) -> dict[str, str]:
    """An equality label selector (what the chart writes) as a map."""
    return dict(term.split("=", 1) for term in selector.split(","))


# vLLM's connector class -> the kind pdproxy's announcements and discovery use for it.
CONNECTOR_KINDS = {
    "NixlConnector": Connector.NIXL,
    "P2pNcclConnector": Connector.P2P_NCCL,
    "PdproxyConnector": Connector.PDPROXY,
}


def chart_connector(vllm: dict[str, Any]) -> Connector:
    """The kind of the connector the chart runs in this vLLM container."""
    argv = [*vllm.get("command", []), *vllm.get("args", [])]
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    return CONNECTOR_KINDS[config["kv_connector"]]


def role_of(deployment: Manifest) -> Role:
    return Role(deployment["metadata"]["labels"]["app.kubernetes.io/component"])


@pytest.mark.parametrize("name", sorted(DISCOVERY_SETS))
def test_discovery_reads_the_fleet_the_chart_deploys(name: str, tmp_path: Path) -> None:
    rendered = render(DISCOVERY_SETS[name])
    settings = proxy_settings(rendered, tmp_path)
    assert settings.discovery == "kubernetes"
    watched = namespace(settings, tmp_path / "no-service-account")
    assert watched == NAMESPACE
    fleet = rendered.fleet()
    assert {role_of(d) for d in fleet} == set(Role)
    for deployment in fleet:
        role = role_of(deployment)
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        # Its role's selector picks its pods, the other role's does not.
        assert selects(selector_labels(selectors(settings)[role]), labels)
        assert not selects(selector_labels(selectors(settings)[role.other]), labels)
        # Read as the proxy reads it: the container's ports, the chart's connector.
        instance = instance_from_pod(
            as_running_pod(deployment["spec"]["template"]), role, pod_keys(settings)
        )
        assert instance is not None and instance.ready and not instance.pod_drained
        vllm = container(deployment, "vllm")
        assert instance.http_address.port == container_port(vllm, "http")
        assert instance.zmq_address.port == container_port(vllm, "kv-r0")
        assert instance.connector is chart_connector(vllm)


@pytest.mark.parametrize("name", sorted(DISCOVERY_SETS))
def test_discovery_rbac_lets_the_proxy_read_pods_and_nothing_else(
    name: str, tmp_path: Path
) -> None:
    rendered = render(DISCOVERY_SETS[name])
    settings = proxy_settings(rendered, tmp_path)
    (role,) = rendered.all("Role")
    (binding,) = rendered.all("RoleBinding")
    assert role["metadata"]["namespace"] == namespace(settings, tmp_path / "none")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    spec = pod_spec(rendered.proxy_deployment)
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": spec["serviceAccountName"], "namespace": NAMESPACE}
    ]
    assert spec["automountServiceAccountToken"] is True  # the client needs the token
    (account,) = rendered.all("ServiceAccount")
    assert account["metadata"]["name"] == spec["serviceAccountName"]


def test_without_discovery_no_rbac_and_no_token(tmp_path: Path) -> None:
    rendered = render(FLEET)
    assert proxy_settings(rendered, tmp_path).discovery == "registry"
    assert rendered.all("Role") == [] and rendered.all("RoleBinding") == []
    assert pod_spec(rendered.proxy_deployment)["automountServiceAccountToken"] is False


def test_the_chart_fills_in_only_what_the_user_left_out(tmp_path: Path) -> None:
    values = {**FLEET, "config": {"discovery": "kubernetes", "kubernetes_decode_selector": "x=y"}}
    settings = proxy_settings(render(values), tmp_path)
    assert settings.kubernetes_decode_selector == "x=y"
    assert settings.kubernetes_prefill_selector == (
        "app.kubernetes.io/component=prefill,app.kubernetes.io/instance=llm,"
        "app.kubernetes.io/name=pdproxy"
    )


def test_two_replicas_a_budget_and_a_spread_by_default() -> None:
    rendered = render({})
    deployment = rendered.proxy_deployment
    assert deployment["spec"]["replicas"] == 2
    (budget,) = rendered.all("PodDisruptionBudget")
    assert budget["spec"]["minAvailable"] == 1 and "maxUnavailable" not in budget["spec"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    (spread,) = pod_spec(deployment)["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"
    assert selects(spread["labelSelector"]["matchLabels"], labels)
    # The user's constraints come beside it; off, only theirs.
    zone = {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}
    both = pod_spec(render({"topologySpreadConstraints": [zone]}).proxy_deployment)
    assert [c["topologyKey"] for c in both["topologySpreadConstraints"]] == [
        "kubernetes.io/hostname",
        "zone",
    ]
    off = render({"spreadAcrossNodes": False}).proxy_deployment
    assert "topologySpreadConstraints" not in pod_spec(off)


def test_no_budget_that_would_block_every_drain() -> None:
    assert render({"replicaCount": 1}).all("PodDisruptionBudget") == []
    scaled = {"autoscaling": {"enabled": True, "minReplicas": 1}}
    assert render(scaled).all("PodDisruptionBudget") == []


@pytest.mark.parametrize(
    ("autoscaling", "kinds"),
    [
        ({}, ["Resource"]),
        ({"targetInflightRequests": 150}, ["Resource", "Pods"]),
        ({"targetCPUUtilizationPercentage": None, "targetInflightRequests": 150}, ["Pods"]),
    ],
)
def test_the_autoscaler_scales_on_cpu_and_or_requests_in_flight(
    autoscaling: dict[str, Any], kinds: list[str]
) -> None:
    rendered = render({"autoscaling": {"enabled": True, **autoscaling}})
    (hpa,) = rendered.all("HorizontalPodAutoscaler")
    assert [m["type"] for m in hpa["spec"]["metrics"]] == kinds
    for metric in hpa["spec"]["metrics"]:
        if metric["type"] == "Pods":
            assert metric["pods"]["metric"]["name"] == "pdproxy_admitted_requests"
            assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "150"}
    assert "replicas" not in rendered.proxy_deployment["spec"]


def test_an_autoscaler_without_a_metric_is_refused() -> None:
    values = {"autoscaling": {"enabled": True, "targetCPUUtilizationPercentage": None}}
    with pytest.raises(helm.HelmError, match="targetInflightRequests"):
        render(values)
