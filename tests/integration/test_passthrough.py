"""vLLM's other endpoints passed through a live proxy to live fake workers: which role serves
each path, what is forwarded, how errors, hangs, dead instances and large bodies come back,
and that the metrics' endpoint label stays bounded."""

from __future__ import annotations

import http.client
import json
import random
import re
import string
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pdproxy.demo.fleet import LocalFleet, WorkerSpec
from pdproxy.demo.processes import free_ports, http_get
from pdproxy.fake_vllm.passthrough import pattern
from pdproxy.proxy.front import COMPLETION_PATHS, COUNTED_PATHS
from pdproxy.proxy.passthrough import PASSTHROUGH_PATHS
from tests.integration.support import Answer, metric_value, set_behaviour

MODEL = "fake-model"
KEY = "sk-client-key-for-passthrough"
GET_PATHS = {"/version", "/tokenizer_info"}


def call(
    fleet: LocalFleet,
    target: str,
    method: str = "POST",
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    key: str | None = KEY,
    timeout: float = 30.0,
) -> Answer:
    """One request to the proxy; `target` may carry a query."""
    conn = http.client.HTTPConnection("127.0.0.1", fleet.proxy_port, timeout=timeout)
    sent = dict(headers or {})
    if key is not None:
        sent["Authorization"] = f"Bearer {key}"
    try:
        conn.request(method, target, body=body, headers=sent)
        response = conn.getresponse()
        return Answer(
            response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        )
    finally:
        conn.close()


def post(fleet: LocalFleet, target: str, payload: Any, **kwargs: Any) -> Answer:
    headers = {"Content-Type": "application/json", **kwargs.pop("headers", {})}
    return call(fleet, target, body=json.dumps(payload).encode(), headers=headers, **kwargs)


def assert_openai_error(answer: Answer, status: int) -> dict[str, Any]:
    assert answer.status == status, answer.body
    error: dict[str, Any] = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    """One prefill, two decodes; client keys on; /detokenize served by prefill."""
    fleet = LocalFleet(
        tmp_path_factory.mktemp("passthrough"),
        [WorkerSpec("P"), WorkerSpec("D"), WorkerSpec("D")],
        proxy_args=[
            "--api-key",
            KEY,
            "--passthrough-role",
            "/detokenize=prefill",
            "--decode-policy",
            "round_robin",
            "--connect-timeout",
            "1",
            "--decode-timeout",
            "2",
        ],
        api_key=KEY,
    )
    fleet.start()
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture
def normal(fleet: LocalFleet) -> Iterator[LocalFleet]:
    """The fleet, every worker put back to normal behaviour afterwards."""
    try:
        yield fleet
    finally:
        for worker in fleet.workers:
            set_behaviour(worker.url)


@pytest.mark.parametrize("path", PASSTHROUGH_PATHS)
def test_each_known_path_reaches_its_role_with_the_body_as_sent(
    fleet: LocalFleet, path: str
) -> None:
    decodes = {w.http_address for w in fleet.role("D")}
    prefills = {w.http_address for w in fleet.role("P")}
    if path in GET_PATHS:
        answer = call(fleet, path, "GET")
        sent = ""
    else:
        sent = json.dumps({"model": MODEL, "prompt": f"text for {path}", "extra": [1, 2]})
        answer = call(fleet, path, body=sent.encode(), headers={"Content-Type": "application/json"})
    assert answer.status == 200, answer.body
    echo = answer.json()
    assert echo["path"] == path
    assert echo["method"] == ("GET" if path in GET_PATHS else "POST")
    assert echo["body"] == sent
    if path == "/detokenize":  # --passthrough-role /detokenize=prefill
        assert (echo["role"], echo["served_by"] in prefills) == ("prefill", True)
    else:
        assert (echo["role"], echo["served_by"] in decodes) == ("decode", True)


def test_requests_spread_over_the_decodes_and_carry_a_query(fleet: LocalFleet) -> None:
    served = set()
    for i in range(4):
        answer = post(fleet, f"/tokenize?i={i}&x=%20y", {"model": MODEL, "prompt": "p"})
        assert answer.status == 200, answer.body
        assert answer.json()["query"] == f"i={i}&x=%20y"
        served.add(answer.json()["served_by"])
    assert served == {w.http_address for w in fleet.role("D")}  # round robin over both


@pytest.mark.parametrize("path", ["/v1/no/such/path", "/v1/responses/render/x", "/tokenize/x"])
def test_unknown_paths_answer_404_without_the_flag(fleet: LocalFleet, path: str) -> None:
    before = [len(w.requests()) for w in fleet.workers]
    error = assert_openai_error(post(fleet, path, {"model": MODEL}), 404)
    assert error["message"] == "not found"
    assert [len(w.requests()) for w in fleet.workers] == before  # nothing reached a worker


def test_the_api_key_is_required_and_never_forwarded(fleet: LocalFleet) -> None:
    for key in (None, "sk-wrong"):
        answer = post(fleet, "/tokenize", {"model": MODEL, "prompt": "p"}, key=key)
        assert assert_openai_error(answer, 401)["code"] == "invalid_api_key"
    assert call(fleet, "/version", "GET", key=None).status == 401
    answer = post(
        fleet, "/tokenize", {"model": MODEL, "prompt": "p"}, headers={"X-Request-Id": "mine-1"}
    )
    assert answer.status == 200, answer.body
    echo = answer.json()
    assert echo["authorization"] is None  # pdproxy's client key stays with pdproxy
    # The instance gets pdproxy's own id; the client gets its own back.
    assert echo["request_id"] and echo["request_id"] != "mine-1"
    assert answer.headers["x-request-id"] == "mine-1"


VLLM_400 = {"error": {"message": "vLLM says no", "type": "BadRequestError", "code": 400}}
FASTAPI_422 = {"detail": [{"loc": ["body", "prompt"], "msg": "Field required"}]}


@pytest.mark.parametrize(
    ("status", "body", "content_type"),
    [
        (400, VLLM_400, "application/json"),
        (422, FASTAPI_422, "application/json"),
        (500, "an internal error, as plain text", "text/plain; charset=utf-8"),
        (503, "overloaded", "text/plain; charset=utf-8"),
    ],
)
def test_the_instances_errors_pass_through_verbatim(
    normal: LocalFleet, status: int, body: Any, content_type: str
) -> None:
    for worker in normal.role("D"):
        set_behaviour(worker.url, status=status, error_body=body)
    answer = post(normal, "/v1/embeddings", {"model": MODEL, "input": "x"})
    assert answer.status == status
    # The fake sends a JSON body compact, a string as it is.
    sent = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    assert answer.body == sent.encode()
    assert answer.headers["content-type"] == content_type


def test_a_hanging_instance_times_out_with_the_proxys_error(normal: LocalFleet) -> None:
    for worker in normal.role("D"):
        set_behaviour(worker.url, delay_ms=20_000)
    began = time.monotonic()
    answer = post(normal, "/score", {"model": MODEL, "text_1": "a", "text_2": "b"})
    elapsed = time.monotonic() - began
    error = assert_openai_error(answer, 504)
    assert error["code"] == "decode_timeout"
    assert "no answer within 2s" in error["message"]
    assert elapsed < 15  # the 2 s leg bound, not the worker's 20 s delay (generous: CI load)


def test_a_large_streamed_answer_is_relayed_intact(fleet: LocalFleet) -> None:
    size = 6 * 1024 * 1024 + 7
    answer = post(fleet, f"/pooling?fake_stream_bytes={size}", {"model": MODEL, "input": "x"})
    assert answer.status == 200
    assert answer.headers["content-type"] == "application/octet-stream"
    assert len(answer.body) == size
    assert answer.body == pattern(size)


def test_a_model_nobody_serves_gets_the_completions_404(fleet: LocalFleet) -> None:
    answer = post(fleet, "/tokenize", {"model": "no-such-model", "prompt": "p"})
    error = assert_openai_error(answer, 404)
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert error["message"] == "The model `no-such-model` does not exist."
    assert "retry-after" not in answer.headers


def test_passed_through_requests_are_counted_by_path(fleet: LocalFleet) -> None:
    labels = {"endpoint": "/detokenize", "status": "200"}
    before = metric_value(fleet.proxy_url, "pdproxy_requests_total", labels)
    assert post(fleet, "/detokenize", {"model": MODEL, "tokens": [1, 2]}).status == 200
    assert metric_value(fleet.proxy_url, "pdproxy_requests_total", labels) == before + 1
    duration = {"endpoint": "/detokenize"}
    assert metric_value(fleet.proxy_url, "pdproxy_request_duration_seconds_count", duration) >= 1


# -- unknown paths passed through, and a dead instance ------------------------------------------


@pytest.fixture(scope="module")
def open_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    """Unknown paths passed through; one live decode and one static decode nobody listens on."""
    dead_http, dead_zmq = free_ports(2)
    fleet = LocalFleet(
        tmp_path_factory.mktemp("passthrough-open"),
        [WorkerSpec("P"), WorkerSpec("D")],
        proxy_args=[
            "--passthrough-unknown-paths",
            "--passthrough-role",
            "/v1/to/prefill=P",
            "--decode",
            f"http=127.0.0.1:{dead_http},zmq=127.0.0.1:{dead_zmq}",
            "--decode-policy",
            "round_robin",
            "--outlier-consecutive-failures",
            "1000",  # the dead one stays in rotation: every other request meets it
        ],
    )
    fleet.start()
    try:
        yield fleet
    finally:
        fleet.stop()


def test_unknown_paths_pass_through_with_the_flag(open_fleet: LocalFleet) -> None:
    for _ in range(2):  # both decodes' turns: the dead one's is retried on the live one
        answer = post(open_fleet, "/v1/audio/anything?q=1", {"model": MODEL}, key=None)
        assert answer.status == 200, answer.body
        echo = answer.json()
        assert (echo["path"], echo["query"], echo["role"]) == (
            "/v1/audio/anything",
            "q=1",
            "decode",
        )
    answer = call(open_fleet, "/v1/to/prefill", "DELETE", key=None)
    assert answer.status == 200, answer.body
    assert (answer.json()["role"], answer.json()["method"]) == ("prefill", "DELETE")


@pytest.mark.parametrize("path", ["/v1/admin/anything", "/v1/instances/x/y", "/v1/instancesx"])
def test_pdproxys_own_paths_are_never_passed_through(open_fleet: LocalFleet, path: str) -> None:
    assert_openai_error(call(open_fleet, path, "GET", key=None), 404)


def test_a_dead_instance_is_retried_on_another_before_any_byte(open_fleet: LocalFleet) -> None:
    [live] = open_fleet.role("D")
    retried = {"role": "decode", "reason": "connect"}
    failed = {"role": "decode", "reason": "connect"}
    before = metric_value(open_fleet.proxy_url, "pdproxy_retries_total", retried)
    for i in range(6):
        answer = post(open_fleet, "/tokenize", {"model": MODEL, "prompt": str(i)}, key=None)
        assert answer.status == 200, answer.body
        assert answer.json()["served_by"] == live.http_address
        assert answer.json()["body"] == json.dumps({"model": MODEL, "prompt": str(i)})
    # Round robin sent about half of them to the dead one first: each was tried again.
    assert metric_value(open_fleet.proxy_url, "pdproxy_retries_total", retried) >= before + 2
    assert metric_value(open_fleet.proxy_url, "pdproxy_upstream_errors_total", failed) >= 2


def test_unknown_paths_share_one_metric_label(open_fleet: LocalFleet) -> None:
    rng = random.Random(25)
    other = {"endpoint": "other", "status": "200"}
    before = metric_value(open_fleet.proxy_url, "pdproxy_requests_total", other)
    for _ in range(100):
        words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 9))) for _ in "ab"]
        assert call(open_fleet, "/" + "/".join(words), "GET", key=None).status == 200
    assert metric_value(open_fleet.proxy_url, "pdproxy_requests_total", other) == before + 100
    status, text = http_get(open_fleet.proxy_url + "/metrics", timeout=5)
    assert status == 200
    endpoints = set(re.findall(r'pdproxy_requests_total\{endpoint="([^"]*)"', text.decode()))
    assert "other" in endpoints
    assert endpoints <= {*PASSTHROUGH_PATHS, *COMPLETION_PATHS, *COUNTED_PATHS, "other"}
