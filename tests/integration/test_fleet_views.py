"""What the proxy shows about its fleet (models, instances, metrics labels) and what it passes on
(authorization), through live fleets whose workers announce in different ways."""

from __future__ import annotations

import signal

from pdproxy.demo.fleet import WorkerSpec
from pdproxy.demo.processes import http_get, http_json, wait_until
from tests.conftest import FleetFactory
from tests.integration.support import post_json

GOOD = {"model": "fake-model", "prompt": "hello", "max_tokens": 2}


def test_models_from_a_decode_when_only_v0_instances(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory(
        [
            WorkerSpec("P", announce="v0", model="v0-model"),
            WorkerSpec("D", announce="v0", model="v0-model"),
        ]
    )
    models = http_json(fleet.proxy_url + "/v1/models")
    assert [m["id"] for m in models["data"]] == ["v0-model"]
    assert models["data"][0]["owned_by"] == "vllm"  # the decode worker's own answer
    decode = fleet.role("D")[0]
    assert any(r["path"] == "/v1/models" for r in decode.requests())


def test_upstream_key_replaces_the_clients_authorization(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory(
        [WorkerSpec("P"), WorkerSpec("D")], proxy_args=["--upstream-api-key", "sk-fleet"]
    )
    answer = post_json(
        fleet.proxy_url + "/v1/completions", GOOD, headers={"Authorization": "Bearer sk-user"}
    )
    assert answer.status == 200
    legs = fleet.completion_requests()
    assert len(legs) == 2
    assert all(leg["headers"]["authorization"] == "Bearer sk-fleet" for leg in legs)


def test_no_authorization_is_invented(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory([WorkerSpec("P"), WorkerSpec("D")])
    assert post_json(fleet.proxy_url + "/v1/completions", GOOD).status == 200
    assert all("authorization" not in leg["headers"] for leg in fleet.completion_requests())


def test_instances_show_every_source(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory(
        [WorkerSpec("P", announce="v0"), WorkerSpec("P", announce="static"), WorkerSpec("D")]
    )
    items = {
        i["http_address"]: i for i in http_json(fleet.proxy_url + "/v1/instances")["instances"]
    }
    by_source = {item["source"]: item for item in items.values()}
    assert set(by_source) == {"v0", "static", "v1"}
    v1 = by_source["v1"]
    assert v1["role"] == "decode" and v1["model"] == "fake-model"
    assert v1["geometry"]["tp_size"] == 1 and v1["connector"] == "p2p_nccl"
    assert v1["load"] == {"running": 0, "waiting": 0, "kv_usage": 0.0}
    assert all(item["age_seconds"] >= 0 for item in items.values())
    worker = fleet.role("D")[0]
    assert v1["zmq_address"] == worker.zmq_address and v1["http_address"] == worker.http_address


def test_expired_instance_labels_are_removed(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory([WorkerSpec("P"), WorkerSpec("D")], proxy_args=["--ttl", "1.5"])
    assert post_json(fleet.proxy_url + "/v1/completions", GOOD).status == 200
    decode = fleet.role("D")[0]
    label = f'upstream="{decode.http_address}"'

    def metrics() -> str:
        return http_get(fleet.proxy_url + "/metrics")[1].decode()

    assert label in metrics()
    decode.process.signal(signal.SIGKILL)  # no leave: only the TTL can notice
    wait_until(lambda: label not in metrics(), 10, "the dead decode's labels to go")
    assert 'pdproxy_registry_instances{role="decode"} 0.0' in metrics()
    status, body = http_get(fleet.proxy_url + "/ready")
    assert status == 503 and b"no decode" in body
    answer = post_json(fleet.proxy_url + "/v1/completions", GOOD)
    assert answer.status == 503 and answer.headers["retry-after"] == "2"
