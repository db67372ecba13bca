"""Client API keys and the admin token, through a live proxy."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from pdproxy.demo.fleet import LocalFleet, WorkerSpec
from pdproxy.demo.processes import (
    ManagedProcess,
    free_ports,
    http_get,
    http_json,
    pdproxy_command,
    wait_http_ok,
)
from tests.integration.support import Answer, metric_value, post_json, request

MODEL = "fake-model"
GOOD = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
KEY, OTHER_KEY, FILE_KEY = "sk-client-key-1", "sk-client-key-2", "sk-from-the-file"
ADMIN = "admin-token-for-tests"


@pytest.fixture(scope="module", params=[1, 2], ids=["one-process", "two-workers"])
def fleet(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[LocalFleet]:
    """The same checks with the admin API's changes made in one process, and made in the
    registry process of two HTTP workers (each request of a test a new connection: any
    worker may answer it)."""
    directory = tmp_path_factory.mktemp("auth")
    keys = directory / "keys"
    keys.write_text(f"# client keys\n{FILE_KEY}\n\n", encoding="utf-8")
    admin = directory / "admin"
    admin.write_text(ADMIN + "\n", encoding="utf-8")
    fleet = LocalFleet(
        directory,
        [WorkerSpec("P"), WorkerSpec("D")],
        proxy_args=[
            "--api-key",
            KEY,
            "--api-key",
            OTHER_KEY,
            "--api-key-file",
            str(keys),
            "--admin-token-file",
            str(admin),
            "--upstream-api-key",
            "sk-for-the-instances",
            "--workers",
            str(request.param),
        ],
        api_key=KEY,
    )
    fleet.start()
    try:
        yield fleet
    finally:
        fleet.stop()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_401(answer: Answer) -> None:
    assert answer.status == 401, answer.body
    assert answer.headers["www-authenticate"].startswith("Bearer")
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "invalid_api_key" or "admin token" in error["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    "headers",
    [
        {},
        bearer("sk-wrong"),
        bearer(KEY + "x"),
        bearer(KEY[:-1]),
        {"Authorization": KEY},
        bearer(""),
    ],
)
def test_completions_need_a_valid_key(
    fleet: LocalFleet, path: str, headers: dict[str, str]
) -> None:
    body = GOOD if path == "/v1/completions" else {"model": MODEL, "messages": [], "max_tokens": 2}
    assert_401(post_json(fleet.proxy_url + path, body, headers))


@pytest.mark.parametrize("key", [KEY, OTHER_KEY, FILE_KEY])
def test_every_configured_key_is_accepted(fleet: LocalFleet, key: str) -> None:
    answer = post_json(fleet.proxy_url + "/v1/completions", GOOD, bearer(key))
    assert answer.status == 200, answer.body
    answer = request(fleet.proxy_url + "/v1/models", "GET", headers=bearer(key))
    assert answer.status == 200


def test_the_scheme_is_case_insensitive(fleet: LocalFleet) -> None:
    answer = post_json(
        fleet.proxy_url + "/v1/completions", GOOD, {"Authorization": f"bearer {KEY}"}
    )
    assert answer.status == 200


def test_other_endpoints_need_a_key_too(fleet: LocalFleet) -> None:
    for path in ("/v1/models", "/v1/instances", "/v1/instances/pairs", "/no/such/path"):
        assert_401(request(fleet.proxy_url + path, "GET"))


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics"])
def test_probes_and_metrics_are_open_by_default(fleet: LocalFleet, path: str) -> None:
    assert http_get(fleet.proxy_url + path)[0] == 200


def test_the_clients_key_is_never_sent_to_the_instances(fleet: LocalFleet) -> None:
    assert post_json(fleet.proxy_url + "/v1/completions", GOOD, bearer(KEY)).status == 200
    for leg in fleet.completion_requests():
        assert leg["headers"]["authorization"] == "Bearer sk-for-the-instances"


def test_refusals_are_counted(fleet: LocalFleet) -> None:
    before = metric_value(
        fleet.proxy_url, "pdproxy_refused_requests_total", {"reason": "unauthorized"}
    )
    post_json(fleet.proxy_url + "/v1/completions", GOOD)
    after = metric_value(
        fleet.proxy_url, "pdproxy_refused_requests_total", {"reason": "unauthorized"}
    )
    assert after == before + 1


def test_secrets_never_show(fleet: LocalFleet) -> None:
    post_json(fleet.proxy_url + "/v1/completions", GOOD, bearer("sk-wrong-and-secret"))
    post_json(fleet.proxy_url + "/v1/completions", GOOD, bearer(KEY))
    shown = [
        http_get(fleet.proxy_url + "/metrics")[1],
        request(fleet.proxy_url + "/v1/instances", "GET", headers=bearer(KEY)).body,
    ]
    assert fleet.proxy is not None and fleet.proxy.log_path is not None
    shown.append(fleet.proxy.log_path.read_bytes())
    for text in shown:
        for secret in (
            KEY,
            OTHER_KEY,
            FILE_KEY,
            ADMIN,
            "sk-for-the-instances",
            "sk-wrong-and-secret",
        ):
            assert secret.encode() not in text


def registration(port: int) -> bytes:
    return json.dumps(
        {
            "role": "decode",
            "http_address": f"127.0.0.1:{port}",
            "zmq_address": f"127.0.0.1:{port + 1}",
            "model": MODEL,
        }
    ).encode()


def test_admin_endpoints_need_the_admin_token(fleet: LocalFleet) -> None:
    url = fleet.proxy_url + "/v1/instances"
    for headers in ({}, bearer(KEY), bearer(ADMIN + "x")):
        assert_401(request(url, "POST", registration(1000), headers))
    decode = fleet.role("D")[0].http_address
    assert_401(request(f"{url}/{decode}/drain", "POST", b"", bearer(KEY)))
    assert_401(request(f"{url}/{decode}", "DELETE", None, bearer(KEY)))


def test_an_admin_registers_drains_and_removes_an_instance(fleet: LocalFleet) -> None:
    url = fleet.proxy_url + "/v1/instances"
    admin = bearer(ADMIN)
    answer = request(url, "POST", registration(1000), admin)
    assert answer.status == 201, answer.body
    listed = request(url, "GET", headers=bearer(KEY)).json()["instances"]
    added = [i for i in listed if i["http_address"] == "127.0.0.1:1000"]
    assert added and added[0]["source"] == "static" and added[0]["role"] == "decode"
    decode = fleet.role("D")[0].http_address
    # Drain the real decode: with the fake one drained too, nothing can decode.
    assert request(f"{url}/127.0.0.1:1000/drain", "POST", b"", admin).status == 200
    assert request(f"{url}/{decode}/drain", "POST", b"", admin).status == 200
    answer = post_json(fleet.proxy_url + "/v1/completions", GOOD, bearer(KEY))
    assert answer.status == 503 and "out of rotation" in answer.json()["error"]["message"]
    assert http_get(fleet.proxy_url + "/ready")[0] == 503
    assert request(f"{url}/{decode}/drain", "DELETE", None, admin).status == 200
    assert post_json(fleet.proxy_url + "/v1/completions", GOOD, bearer(KEY)).status == 200
    assert request(f"{url}/127.0.0.1:1000", "DELETE", None, admin).status == 200
    assert request(f"{url}/127.0.0.1:1000", "DELETE", None, admin).status == 404
    listed = request(url, "GET", headers=bearer(KEY)).json()["instances"]
    assert all(i["http_address"] != "127.0.0.1:1000" for i in listed)


@pytest.mark.parametrize(
    "body",
    [
        b"{}",
        b"not json",
        b'{"role": "both", "http_address": "127.0.0.1:1", "zmq_address": "127.0.0.1:2"}',
        b'{"role": "decode", "http_address": "nohost", "zmq_address": "127.0.0.1:2"}',
        b'{"role": "decode", "http_address": "127.0.0.1:1", "zmq_address": "127.0.0.1:2", "x": 1}',
    ],
)
def test_a_bad_registration_is_400(fleet: LocalFleet, body: bytes) -> None:
    answer = request(fleet.proxy_url + "/v1/instances", "POST", body, bearer(ADMIN))
    assert answer.status == 400, answer.body
    assert set(answer.json()["error"]) == {"message", "type", "param", "code"}


def bare_proxy(tmp_path: Path, *args: str) -> tuple[ManagedProcess, str]:
    """A `pdproxy serve` with no fleet (stopped by the caller) and its URL."""
    http_port, registry_port = free_ports(2)
    argv = pdproxy_command(
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(http_port),
        "--registry-bind",
        f"tcp://127.0.0.1:{registry_port}",
        *args,
    )
    return ManagedProcess(
        "pdproxy", argv, tmp_path / "pdproxy.log"
    ), f"http://127.0.0.1:{http_port}"


def test_without_an_admin_token_admin_endpoints_are_403(tmp_path: Path) -> None:
    proxy, url = bare_proxy(tmp_path)
    try:
        proxy.start()
        wait_http_ok(url + "/health", 30, [proxy])
        answer = request(url + "/v1/instances", "POST", registration(1000), bearer("anything"))
        assert answer.status == 403
        assert http_json(url + "/v1/instances")["instances"] == []
    finally:
        proxy.stop()


def test_an_unreadable_key_file_stops_the_start(tmp_path: Path) -> None:
    proxy, _ = bare_proxy(tmp_path, "--api-key-file", str(tmp_path / "missing"))
    try:
        proxy.start()
        assert proxy.process is not None
        assert proxy.process.wait(timeout=30) == 2
        assert "missing" in proxy.log_tail() and "Traceback" not in proxy.log_tail()
    finally:
        proxy.stop()


def _raw_post(url: str, head_fields: list[tuple[str, str]], body: bytes) -> Answer:
    """A POST whose header fields are sent exactly as listed (repeats included)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30)
    try:
        conn.putrequest("POST", parts.path)
        for name, value in head_fields:
            conn.putheader(name, value)
        conn.endheaders(body)
        response = conn.getresponse()
        headers = {k.lower(): v for k, v in response.getheaders()}
        return Answer(response.status, headers, response.read())
    finally:
        conn.close()


@pytest.mark.parametrize(
    "keys", [(KEY, "sk-wrong"), ("sk-wrong", KEY), (KEY, KEY)], ids=["good-bad", "bad-good", "same"]
)
def test_several_authorization_headers_are_refused(
    fleet: LocalFleet, keys: tuple[str, str]
) -> None:
    body = json.dumps(GOOD).encode()
    legs_before = len(fleet.completion_requests())
    refused_before = metric_value(
        fleet.proxy_url, "pdproxy_refused_requests_total", {"reason": "ambiguous_authorization"}
    )
    fields = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    fields += [("Authorization", f"Bearer {key}") for key in keys]
    answer = _raw_post(fleet.proxy_url + "/v1/completions", fields, body)
    assert answer.status == 400, answer.body
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "one Authorization header" in error["message"]
    assert len(fleet.completion_requests()) == legs_before  # nothing went upstream
    refused_after = metric_value(
        fleet.proxy_url, "pdproxy_refused_requests_total", {"reason": "ambiguous_authorization"}
    )
    assert refused_after == refused_before + 1


def test_a_key_sent_only_as_a_trailer_is_not_a_key(fleet: LocalFleet) -> None:
    body = json.dumps(GOOD).encode()
    chunked = b"%x\r\n%s\r\n0\r\nAuthorization: Bearer %s\r\n\r\n" % (len(body), body, KEY.encode())
    fields = [("Content-Type", "application/json"), ("Transfer-Encoding", "chunked")]
    answer = _raw_post(fleet.proxy_url + "/v1/completions", fields, chunked)
    assert_401(answer)
