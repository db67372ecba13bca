"""Kubernetes discovery end to end: a real `pdproxy serve --discovery kubernetes` (the real
kubernetes_asyncio client inside) against a local stand-in API server
(tests/integration/kubernetes_standin.py: NOT Kubernetes, only the list and watch of pods),
with fake workers as the pods' endpoints. The proxy must route only to Ready pods, follow
readiness, the drain annotation and deletions, and keep following after a dropped watch and a
410 Gone."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdproxy.demo.fleet import COMPLETION_PATHS, LocalFleet, Worker, WorkerSpec
from pdproxy.demo.processes import wait_until
from tests.integration.kubernetes_standin import KubernetesStandIn, Pod, pod
from tests.integration.support import metric_value, post_json

NAMESPACE = "fleet"
SELECTORS = {"P": "app=vllm,role=prefill", "D": "app=vllm,role=decode"}
# The fake worker's default geometry, as a pod annotation (pods that do not announce).
GEOMETRY = {
    "tp_size": 1,
    "block_size": 16,
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_dim": 32,
    "kv_dtype": "float16",
    "is_mla": False,
    "kv_layout": "NHD",
}
DRAIN = "pdproxy.io/drain"
WAIT_S = 15.0


def proxy_args(workers: int = 1) -> list[str]:
    return [
        "--workers",
        str(workers),
        "--discovery",
        "kubernetes",
        "--kubernetes-namespace",
        NAMESPACE,
        "--kubernetes-prefill-selector",
        SELECTORS["P"],
        "--kubernetes-decode-selector",
        SELECTORS["D"],
        # Deterministic spread, so "every ready pod takes legs" can be asserted.
        "--prefill-policy",
        "round_robin",
        "--decode-policy",
        "round_robin",
    ]


def worker_pod(worker: Worker, ready: bool, with_geometry: bool = True) -> Pod:
    role = "prefill" if worker.spec.role == "P" else "decode"
    annotations = {
        "pdproxy.io/http-port": str(worker.http_port),
        "pdproxy.io/kv-port": str(worker.kv_port),
        "pdproxy.io/connector": "p2p_nccl",
    }
    if with_geometry:
        annotations["pdproxy.io/geometry"] = json.dumps(GEOMETRY)
    return pod(pod_name(worker), NAMESPACE, {"app": "vllm", "role": role}, annotations, ready=ready)


def pod_name(worker: Worker) -> str:
    return f"vllm-{worker.spec.role.lower()}{worker.index}"


class DiscoveredFleet:
    """Fake workers, their pods in the stand-in, and a proxy discovering them."""

    def __init__(self, tmp_path: Path, specs: list[WorkerSpec], workers: int = 1) -> None:
        self.api = KubernetesStandIn(NAMESPACE)
        kubeconfig = tmp_path / "kubeconfig"
        self.fleet = LocalFleet(
            tmp_path / "fleet",
            specs,
            proxy_args(workers),
            proxy_env={"KUBECONFIG": str(kubeconfig)},
            # The test host may itself run in a pod: the proxy must use the kubeconfig.
            proxy_unset=("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"),
        )
        self._kubeconfig = kubeconfig

    def start(self, ready: dict[str, bool], geometry: dict[str, bool]) -> None:
        """Pods first (keyed by pod name), then the processes: the proxy finds them listed."""
        self.api.__enter__()
        self._kubeconfig.write_text(self.api.kubeconfig(), encoding="utf-8")
        self.fleet.prepare()
        for worker in self.fleet.workers:
            name = pod_name(worker)
            self.api.put(worker_pod(worker, ready[name], geometry.get(name, True)))
        self.fleet.launch()

    def stop(self) -> None:
        self.fleet.stop()
        self.api.__exit__(None, None, None)

    def worker(self, name: str) -> Worker:
        return next(w for w in self.fleet.workers if pod_name(w) == name)

    def listed(self) -> dict[str, dict[str, object]]:
        """The proxy's /v1/instances by pod name."""
        names = {w.http_address: pod_name(w) for w in self.fleet.workers}
        return {names[i["http_address"]]: i for i in self.fleet.instances()}

    def legs_by_pod(self, requests: int) -> dict[str, int]:
        """Send `requests` completions (each must succeed); the legs each pod's worker took."""
        self.fleet.reset_records()
        for n in range(requests):
            body = {"model": "fake-model", "prompt": f"prompt {n}", "max_tokens": 2}
            answer = post_json(self.fleet.proxy_url + "/v1/completions", body)
            assert answer.status == 200, answer.body
        legs = {
            pod_name(w): sum(r["path"] in COMPLETION_PATHS for r in w.requests())
            for w in self.fleet.workers
        }
        return {name: count for name, count in legs.items() if count}


@pytest.fixture
def discovered(tmp_path: Path) -> Iterator[list[DiscoveredFleet]]:
    made: list[DiscoveredFleet] = []
    yield made
    for fleet in made:
        fleet.stop()


def test_only_ready_undrained_pods_take_requests(
    tmp_path: Path, discovered: list[DiscoveredFleet]
) -> None:
    specs = [
        WorkerSpec("P", announce="none"),
        WorkerSpec("P", announce="none"),
        WorkerSpec("D", announce="v1"),
        WorkerSpec("D", announce="none"),
    ]
    fleet = DiscoveredFleet(tmp_path, specs)
    discovered.append(fleet)
    # vllm-d0 announces and has no geometry annotation: its announcements enrich it.
    fleet.start(
        ready={"vllm-p0": True, "vllm-p1": False, "vllm-d0": True, "vllm-d1": False},
        geometry={"vllm-d0": False},
    )
    listed = fleet.listed()
    assert {name: item["source"] for name, item in listed.items()} == dict.fromkeys(
        listed, "discovered"
    )
    assert {name: item["ready"] for name, item in listed.items()} == {
        "vllm-p0": True,
        "vllm-p1": False,
        "vllm-d0": True,
        "vllm-d1": False,
    }
    d0 = listed["vllm-d0"]
    wait_until(
        lambda: fleet.listed()["vllm-d0"]["geometry"] is not None,
        WAIT_S,
        "vllm-d0's announcement",
    )
    d0 = fleet.listed()["vllm-d0"]
    assert d0["model"] == "fake-model" and d0["load"] is not None  # from its announcements
    assert d0["zmq_address"] == fleet.worker("vllm-d0").zmq_address  # from its pod

    # Unready pods take nothing.
    assert fleet.legs_by_pod(6) == {"vllm-p0": 6, "vllm-d0": 6}

    # Ready now: both roles spread over both pods.
    fleet.api.set_ready("vllm-p1", True)
    fleet.api.set_ready("vllm-d1", True)
    wait_until(
        lambda: all(item["ready"] for item in fleet.listed().values()), WAIT_S, "all pods ready"
    )
    assert fleet.legs_by_pod(8) == dict.fromkeys(["vllm-p0", "vllm-p1", "vllm-d0", "vllm-d1"], 4)

    # The drain annotation: listed as drained, no new legs; taking it off brings it back.
    fleet.api.annotate("vllm-d0", DRAIN, "true")
    wait_until(lambda: fleet.listed()["vllm-d0"]["drained"] is True, WAIT_S, "vllm-d0 drained")
    assert fleet.legs_by_pod(4) == {"vllm-p0": 2, "vllm-p1": 2, "vllm-d1": 4}

    # A deleted pod leaves the proxy's table at once, though its worker still runs and its
    # announcements keep coming (they are refused for a TTL, then it would be a plain v1).
    fleet.api.annotate("vllm-d0", DRAIN, None)
    fleet.api.delete("vllm-p0")
    wait_until(lambda: "vllm-p0" not in fleet.listed(), WAIT_S, "vllm-p0 gone")
    assert fleet.worker("vllm-p0").process.alive()
    legs = fleet.legs_by_pod(4)
    assert legs["vllm-p1"] == 4 and "vllm-p0" not in legs
    assert legs["vllm-d0"] + legs["vllm-d1"] == 4

    # No ready prefill left: the proxy answers 503, it does not try the unready one.
    fleet.api.set_ready("vllm-p1", False)
    wait_until(lambda: not fleet.listed()["vllm-p1"]["ready"], WAIT_S, "vllm-p1 unready")
    fleet.fleet.reset_records()
    answer = post_json(
        fleet.fleet.proxy_url + "/v1/completions",
        {"model": "fake-model", "prompt": "x", "max_tokens": 2},
    )
    assert answer.status == 503, answer.body
    assert not fleet.fleet.completion_requests()


# With --workers 2 discovery runs in the registry process and the HTTP workers route on its copy.
@pytest.mark.parametrize("workers", [1, 2])
def test_the_watch_resumes_after_a_drop_and_lists_again_after_410(
    tmp_path: Path, discovered: list[DiscoveredFleet], workers: int
) -> None:
    specs = [WorkerSpec(role, announce="none") for role in ("P", "D", "D")]
    fleet = DiscoveredFleet(tmp_path, specs, workers)
    discovered.append(fleet)
    fleet.start(ready={"vllm-p0": True, "vllm-d0": True, "vllm-d1": True}, geometry={})
    url = fleet.fleet.proxy_url
    lists_before = len(fleet.api.lists())
    wait_until(lambda: len(fleet.api.watches_opened()) >= 2, WAIT_S, "both watches")

    # A watch cut mid-stream: the client resumes from the last version it saw (no new list),
    # and a change made after the cut still arrives.
    fleet.api.drop_watches()
    fleet.api.set_ready("vllm-d1", False)
    wait_until(lambda: not fleet.listed()["vllm-d1"]["ready"], WAIT_S, "vllm-d1 unready")
    resumed = fleet.api.watches_opened()[-1]
    assert int(resumed.query["resourceVersion"]) > 100  # not the initial list's version
    assert len(fleet.api.lists()) == lists_before
    assert metric_value(url, "pdproxy_discovery_watch_restarts_total", {"reason": "failed"}) >= 1

    # The deletion happens as the history is compacted and the watches are cut: resuming
    # from its version gets 410 Gone, and only a new list shows the pod is gone.
    fleet.api.delete("vllm-d1", compact_and_drop=True)
    wait_until(lambda: "vllm-d1" not in fleet.listed(), WAIT_S, "vllm-d1 gone after a relist")
    assert len(fleet.api.lists()) > lists_before
    assert metric_value(url, "pdproxy_discovery_watch_restarts_total", {"reason": "expired"}) >= 1
    # And it keeps routing on what is there.
    answer = post_json(
        url + "/v1/completions", {"model": "fake-model", "prompt": "x", "max_tokens": 2}
    )
    assert answer.status == 200, answer.body
