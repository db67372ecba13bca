"""pdproxy.registry.pods: a Pod as the Kubernetes API serves it, read as an instance."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdproxy.base.roles import Role
from pdproxy.ids import Address
from pdproxy.registry.messages import Connector, Geometry
from pdproxy.registry.pods import PodError, PodKeys, instance_from_pod, pod_uid
from pdproxy.registry.table import Source

KEYS = PodKeys(
    http_port="pdproxy.io/http-port",
    kv_port="pdproxy.io/kv-port",
    connector="pdproxy.io/connector",
    geometry="pdproxy.io/geometry",
    drain="pdproxy.io/drain",
)
PORTS = {"pdproxy.io/http-port": "8000", "pdproxy.io/kv-port": "21001"}


def api_pod(
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    ip: str | None = "10.2.0.7",
    ready: str = "True",
    deleting: bool = False,
) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "name": "vllm-0",
        "namespace": "ns",
        "uid": "u-1",
        "labels": labels or {},
        "annotations": PORTS if annotations is None else annotations,
    }
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": ready}]}
    if ip is not None:
        status["podIP"] = ip
    return {"metadata": metadata, "status": status}


def test_a_ready_pod_is_an_instance_at_its_ip() -> None:
    instance = instance_from_pod(api_pod(), Role.PREFILL, KEYS)
    assert instance is not None
    assert instance.role is Role.PREFILL and instance.source is Source.DISCOVERED
    assert instance.http_address == Address("10.2.0.7", 8000)
    assert instance.zmq_address == Address("10.2.0.7", 21001)
    assert instance.ready and not instance.pod_drained
    assert instance.connector is None and instance.geometry is None


def test_labels_serve_when_annotations_are_silent_and_annotations_win() -> None:
    labels = {"pdproxy.io/http-port": "9000", "pdproxy.io/kv-port": "22000"}
    both = api_pod(annotations={"pdproxy.io/http-port": "8000"}, labels=labels)
    instance = instance_from_pod(both, Role.DECODE, KEYS)
    assert instance is not None
    assert instance.http_address.port == 8000 and instance.zmq_address.port == 22000


@pytest.mark.parametrize(
    ("pod", "ready"),
    [
        (api_pod(ready="False"), False),
        (api_pod(ready="True", deleting=True), False),
        ({"metadata": api_pod()["metadata"], "status": {"podIP": "10.2.0.7"}}, False),
    ],
    ids=["not-ready", "terminating", "no-conditions"],
)
def test_readiness(pod: dict[str, Any], ready: bool) -> None:
    instance = instance_from_pod(pod, Role.DECODE, KEYS)
    assert instance is not None and instance.ready is ready


def test_a_pod_without_an_ip_is_nothing_yet() -> None:
    assert instance_from_pod(api_pod(ip=None), Role.DECODE, KEYS) is None


@pytest.mark.parametrize(
    ("value", "drained"),
    [("true", True), ("", True), ("yes-please", True), ("false", False), ("0", False)],
)
def test_the_drain_mark(value: str, drained: bool) -> None:
    pod = api_pod(annotations={**PORTS, "pdproxy.io/drain": value})
    instance = instance_from_pod(pod, Role.DECODE, KEYS)
    assert instance is not None and instance.pod_drained is drained


def test_connector_and_geometry() -> None:
    geometry = {"tp_size": 2, "block_size": 16, "kv_dtype": "bfloat16", "is_mla": False}
    pod = api_pod(
        annotations={
            **PORTS,
            "pdproxy.io/connector": "pdproxy",
            "pdproxy.io/geometry": json.dumps(geometry),
        }
    )
    instance = instance_from_pod(pod, Role.DECODE, KEYS)
    assert instance is not None and instance.connector is Connector.PDPROXY
    assert instance.geometry == Geometry(
        tp_size=2, block_size=16, kv_dtype="bfloat16", is_mla=False
    )


@pytest.mark.parametrize(
    ("annotations", "complaint"),
    [
        ({"pdproxy.io/kv-port": "21001"}, "no pdproxy.io/http-port"),
        ({**PORTS, "pdproxy.io/http-port": "http"}, "must be a port number"),
        ({**PORTS, "pdproxy.io/kv-port": "70000"}, "must be a port number"),
        ({**PORTS, "pdproxy.io/connector": "nccl"}, "must be one of"),
        ({**PORTS, "pdproxy.io/geometry": "{tp_size: 2"}, "must be a JSON map"),
        ({**PORTS, "pdproxy.io/geometry": '{"tp_size": 0}'}, "geometry.tp_size"),
    ],
)
def test_unusable_pods_are_refused_with_the_reason(
    annotations: dict[str, str], complaint: str
) -> None:
    with pytest.raises(PodError, match=complaint):
        instance_from_pod(api_pod(annotations=annotations), Role.DECODE, KEYS)


def test_an_ipv6_pod_cannot_be_carried_in_a_request_id() -> None:
    with pytest.raises(PodError, match="pod IP"):
        instance_from_pod(api_pod(ip="fd00::7"), Role.DECODE, KEYS)


def test_the_uid_names_a_pod_across_its_life() -> None:
    assert pod_uid(api_pod()) == "u-1"
    assert pod_uid({"metadata": {"name": "x", "namespace": "ns"}}) == "ns/x"
