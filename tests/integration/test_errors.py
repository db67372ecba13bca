"""Every error case of the core issue, through a live proxy: OpenAI-shaped, one answer each."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from pdproxy.demo.fleet import LocalFleet, Worker, WorkerSpec
from pdproxy.demo.processes import free_ports
from tests.conftest import FleetFactory
from tests.integration import support
from tests.integration.support import (
    Answer,
    ScriptedUpstream,
    json_answer,
    metric_value,
    open_raw_request,
    post_json,
    read_until,
    request,
)

MODEL = "fake-model"
GOOD = {"model": MODEL, "prompt": "hello", "max_tokens": 3}
ADMIN = "admin-token-for-error-tests"


def assert_openai_error(answer: Answer, status: int, *fragments: str) -> dict[str, Any]:
    assert answer.status == status, (answer.status, answer.body)
    assert answer.headers["content-type"].startswith("application/json")
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    assert b"Traceback" not in answer.body
    return dict(error)


def set_behaviour(worker: Worker, **behaviour: Any) -> None:
    support.set_behaviour(worker.url, **behaviour)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    directory = tmp_path_factory.mktemp("errors")
    (directory / "admin").write_text(ADMIN + "\n", encoding="utf-8")
    fleet = LocalFleet(
        directory,
        [WorkerSpec("P"), WorkerSpec("D")],
        proxy_args=[
            "--admin-token-file",
            str(directory / "admin"),
            "--max-body-bytes",
            "4096",
            "--connect-timeout",
            "0.5",
            "--prefill-timeout",
            "1",
            "--decode-timeout",
            "1",
            "--decode-first-byte-timeout",
            "1",
            "--retry-after-seconds",
            "7",
        ],
    ).start()
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture(autouse=True)
def clean_slate(fleet: LocalFleet) -> Iterator[None]:
    fleet.reset_records()
    yield
    for worker in fleet.workers:
        if worker.process.alive():
            set_behaviour(worker)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_invalid_json_is_400(fleet: LocalFleet, path: str) -> None:
    answer = request(fleet.proxy_url + path, body=b'{"model": "fake-model", ')
    assert_openai_error(answer, 400, "not valid JSON")


@pytest.mark.parametrize(
    ("body", "fragment"),
    [(b"[1, 2]", "an array"), (b'"text"', "a string"), (b"42", "a number"), (b"null", "null")],
)
def test_body_not_an_object_is_400(fleet: LocalFleet, body: bytes, fragment: str) -> None:
    answer = request(fleet.proxy_url + "/v1/completions", body=body)
    assert_openai_error(answer, 400, "JSON object", fragment)


@pytest.mark.parametrize("body", [{"prompt": "x"}, {"model": ""}, {"model": 7}])
def test_missing_model_is_400(fleet: LocalFleet, body: dict[str, Any]) -> None:
    answer = post_json(fleet.proxy_url + "/v1/completions", body)
    error = assert_openai_error(answer, 400, "'model'")
    assert error["param"] == "model"


def test_body_over_limit_is_413(fleet: LocalFleet) -> None:
    big = dict(GOOD, prompt="x" * 5000)
    answer = post_json(fleet.proxy_url + "/v1/completions", big)
    assert_openai_error(answer, 413, "4096")
    assert not fleet.completion_requests("P") and not fleet.completion_requests("D")


def test_chunked_body_over_limit_is_413(fleet: LocalFleet) -> None:
    chunks = (b"x" * 1000 for _ in range(10))  # no Content-Length: http.client sends chunked
    answer = request(fleet.proxy_url + "/v1/completions", body=chunks)  # type: ignore[arg-type]
    assert_openai_error(answer, 413)


def test_unknown_path_is_404(fleet: LocalFleet) -> None:
    answer = request(fleet.proxy_url + "/v1/nothing-here", method="GET")
    assert_openai_error(answer, 404)
    # vLLM serves it (for speech models), pdproxy does not disaggregate it, and it is no
    # pass-through path: without --passthrough-unknown-paths it stays a 404.
    answer = request(fleet.proxy_url + "/v1/audio/transcriptions", body=b"{}")
    assert_openai_error(answer, 404)


def test_wrong_method_is_405(fleet: LocalFleet) -> None:
    answer = request(fleet.proxy_url + "/v1/completions", method="GET")
    assert_openai_error(answer, 405, "POST")


def test_a_model_no_instance_serves_is_vllms_404(fleet: LocalFleet) -> None:
    # As vLLM answers it, and final: no Retry-After that would make a client try again.
    answer = post_json(fleet.proxy_url + "/v1/completions", dict(GOOD, model="other-model"))
    error = assert_openai_error(answer, 404, "The model `other-model` does not exist.")
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert "retry-after" not in answer.headers


def test_no_instance_in_rotation_is_503_with_retry_after(fleet: LocalFleet) -> None:
    # The model is served, by an instance out of rotation for now: worth retrying later.
    decode = fleet.role("D")[0]
    drain = f"{fleet.proxy_url}/v1/instances/{decode.http_address}/drain"
    admin = {"Authorization": f"Bearer {ADMIN}"}
    assert request(drain, "POST", b"", admin).status == 200
    try:
        answer = post_json(fleet.proxy_url + "/v1/completions", GOOD)
        error = assert_openai_error(
            answer, 503, f"no decode instance serves model {MODEL!r}", "out of rotation"
        )
        assert error["code"] == "no_instance"
        assert answer.headers["retry-after"] == "7"
        ready = request(fleet.proxy_url + "/ready", "GET")
        assert ready.status == 503
        assert f"decode {decode.http_address} drained by an operator" in ready.json()["reason"]
    finally:
        assert request(drain, "DELETE", None, admin).status == 200


def test_prefill_5xx_is_502_naming_role_and_instance(fleet: LocalFleet) -> None:
    prefill = fleet.role("P")[0]
    set_behaviour(prefill, status=500)
    answer = post_json(fleet.proxy_url + "/v1/completions", GOOD)
    assert_openai_error(answer, 502, "prefill", prefill.http_address, "500")
    assert not fleet.completion_requests("D"), "decode must not be sent after a failed prefill"


def test_decode_5xx_is_502_naming_role_and_instance(fleet: LocalFleet) -> None:
    decode = fleet.role("D")[0]
    set_behaviour(decode, status=503)
    answer = post_json(fleet.proxy_url + "/v1/completions", GOOD)
    assert_openai_error(answer, 502, "decode", decode.http_address, "503")


def test_prefill_timeout_is_504(fleet: LocalFleet) -> None:
    prefill = fleet.role("P")[0]
    set_behaviour(prefill, delay_ms=6000)
    started = time.monotonic()
    answer = post_json(fleet.proxy_url + "/v1/completions", GOOD)
    assert_openai_error(answer, 504, "prefill", prefill.http_address, "within 1s")
    assert time.monotonic() - started < 5.5  # the 1 s bound fired, not the fake's own delay


def test_decode_first_byte_timeout_is_504(fleet: LocalFleet) -> None:
    decode = fleet.role("D")[0]
    set_behaviour(decode, delay_ms=3000)
    answer = post_json(fleet.proxy_url + "/v1/completions", dict(GOOD, stream=True))
    assert_openai_error(answer, 504, "decode", decode.http_address, "first byte")


def test_non_streaming_decode_timeout_is_504(fleet: LocalFleet) -> None:
    decode = fleet.role("D")[0]
    set_behaviour(decode, delay_ms=3000)
    answer = post_json(fleet.proxy_url + "/v1/completions", GOOD)
    assert_openai_error(answer, 504, "decode", decode.http_address, "no answer within 1s")


def test_request_timeout_is_504(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory(
        [WorkerSpec("P"), WorkerSpec("D")],
        proxy_args=["--request-timeout", "1", "--connect-timeout", "0.5"],
    )
    set_behaviour(fleet.role("D")[0], delay_ms=3000)
    answer = post_json(fleet.proxy_url + "/v1/completions", GOOD)
    assert_openai_error(answer, 504, "longer than 1s")
    assert metric_value(fleet.proxy_url, "pdproxy_inflight_legs") == 0


def test_slow_upload_is_408(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory(
        [WorkerSpec("P"), WorkerSpec("D")],
        proxy_args=["--request-timeout", "1", "--connect-timeout", "0.5"],
    )
    parts = urlsplit(fleet.proxy_url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model": '
        )  # ... and the rest never comes
        head = read_until(sock, b"\r\n\r\n", timeout=8)
    assert head.startswith(b"HTTP/1.1 408 ")


def test_a_body_trickling_past_the_body_timeout_is_408_and_frees_its_slot(
    fleet_factory: FleetFactory,
) -> None:
    fleet = fleet_factory(
        [WorkerSpec("P"), WorkerSpec("D")],
        proxy_args=["--body-timeout", "1", "--max-inflight-requests", "1"],
    )
    parts = urlsplit(fleet.proxy_url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model": '
        )
        head = read_until(sock, b"\r\n\r\n", timeout=8)
    assert head.startswith(b"HTTP/1.1 408 ")
    # The one admission slot is free again: the next request is served.
    assert post_json(fleet.proxy_url + "/v1/completions", GOOD).status == 200


def test_prefill_4xx_passes_through(fleet: LocalFleet) -> None:
    answer = post_json(fleet.proxy_url + "/v1/completions", dict(GOOD, temperature=-1))
    assert answer.status == 400
    error = answer.json()["error"]
    assert error["type"] == "BadRequestError" and "temperature" in error["message"]
    assert not fleet.completion_requests("D")


def test_decode_4xx_passes_through(fleet: LocalFleet) -> None:
    # stream_options without stream only fails on D: the prefill leg drops stream_options.
    # (max_tokens beyond the context no longer gets that far: the proxy knows the context.)
    body = dict(GOOD, stream=False, stream_options={"include_usage": True})
    answer = post_json(fleet.proxy_url + "/v1/completions", body)
    assert answer.status == 400
    assert answer.json()["error"]["type"] == "BadRequestError"
    assert answer.json()["error"]["param"] == "stream_options"
    assert len(fleet.completion_requests("P")) == 1


def test_upstream_error_body_is_vllms_own(fleet: LocalFleet) -> None:
    decode = fleet.role("D")[0]
    own = {
        "error": {"message": "vLLM says no", "type": "BadRequestError", "param": None, "code": 422}
    }
    set_behaviour(decode, status=422, error_body=own)
    answer = post_json(fleet.proxy_url + "/v1/completions", GOOD)
    assert answer.status == 422 and answer.json() == own


def test_errors_are_counted(fleet: LocalFleet) -> None:
    set_behaviour(fleet.role("P")[0], status=500)
    errors = {"role": "prefill", "reason": "status_5xx"}
    retries = {"role": "prefill", "reason": "status_5xx"}
    before = metric_value(fleet.proxy_url, "pdproxy_upstream_errors_total", errors)
    retried_before = metric_value(fleet.proxy_url, "pdproxy_retries_total", retries)
    post_json(fleet.proxy_url + "/v1/completions", GOOD)
    after = metric_value(fleet.proxy_url, "pdproxy_upstream_errors_total", errors)
    # The only prefill failed every one of the default 3 attempts: 3 failed legs, 2 retries.
    assert after == before + 3
    assert metric_value(fleet.proxy_url, "pdproxy_retries_total", retries) == retried_before + 2
    assert (
        metric_value(
            fleet.proxy_url,
            "pdproxy_requests_total",
            {"endpoint": "/v1/completions", "status": "502"},
        )
        >= 1
    )


@pytest.mark.parametrize("dead_role", ["P", "D"])
def test_connection_refused_is_502(fleet_factory: FleetFactory, dead_role: str) -> None:
    http_port, kv_port = free_ports(2)
    flag = "--prefill" if dead_role == "P" else "--decode"
    live_role = "D" if dead_role == "P" else "P"
    fleet = fleet_factory(
        [WorkerSpec(live_role, announce="static")],  # type: ignore[arg-type]
        proxy_args=[flag, f"http=127.0.0.1:{http_port},zmq=127.0.0.1:{kv_port}"],
    )
    answer = post_json(fleet.proxy_url + "/v1/completions", GOOD)
    role = "prefill" if dead_role == "P" else "decode"
    assert_openai_error(answer, 502, role, f"127.0.0.1:{http_port}", "connection failed")


def test_decode_dying_mid_stream_ends_with_sse_error(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory([WorkerSpec("P"), WorkerSpec("D", token_latency_ms=50)])
    sock = open_raw_request(
        fleet.proxy_url + "/v1/completions", dict(GOOD, max_tokens=400, stream=True)
    )
    head = read_until(sock, b"data: ", timeout=10)
    assert b" 200 " in head.split(b"\r\n")[0]
    fleet.role("D")[0].process.signal(signal.SIGKILL)
    rest = read_until(sock, b"data: [DONE]", timeout=10)
    sock.close()
    events = [e for e in (head + rest).split(b"\n\n") if b'"error"' in e]
    assert len(events) == 1, rest[-600:]
    assert b"decode instance" in events[0]


def test_saturated_proxy_is_503_not_an_instance_failure(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory(
        [WorkerSpec("P"), WorkerSpec("D", token_latency_ms=100)],
        proxy_args=["--upstream-max-connections", "1", "--connect-timeout", "0.5"],
    )
    sock = open_raw_request(
        fleet.proxy_url + "/v1/completions", dict(GOOD, max_tokens=100, stream=True)
    )
    try:
        read_until(sock, b"data: {", timeout=10)  # the only slot is now busy streaming
        answer = post_json(fleet.proxy_url + "/v1/completions", GOOD)
    finally:
        sock.close()
    assert_openai_error(answer, 503, "saturated")
    assert answer.headers["retry-after"] == "2"
    saturated = {"role": "prefill"}
    assert metric_value(fleet.proxy_url, "pdproxy_saturated_legs_total", saturated) == 1
    # The proxy's own congestion is no upstream's error.
    assert metric_value(fleet.proxy_url, "pdproxy_upstream_errors_total", saturated) == 0


def test_a_failure_after_done_still_ends_the_stream_cleanly(fleet_factory: FleetFactory) -> None:
    async def prefill(writer: asyncio.StreamWriter) -> None:
        writer.write(json_answer(b'{"id": "cmpl-x", "choices": []}'))
        await writer.drain()

    async def decode(writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        for event in (b'data: {"choices": [{"text": "hi"}]}\n\n', b"data: [DONE]\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        await writer.drain()
        await asyncio.sleep(5)  # ... and never sends the closing chunk

    with ScriptedUpstream(prefill) as p, ScriptedUpstream(decode) as d:
        fleet = fleet_factory(
            [],
            proxy_args=[
                "--prefill",
                f"http=127.0.0.1:{p.port},zmq=127.0.0.1:1",
                "--decode",
                f"http=127.0.0.1:{d.port},zmq=127.0.0.1:2",
                "--stream-idle-timeout",
                "1",
            ],
        )
        # http.client raises IncompleteRead on a chunked body that is cut short.
        answer = post_json(fleet.proxy_url + "/v1/completions", dict(GOOD, stream=True))
    assert answer.status == 200
    assert answer.body.endswith(b"data: [DONE]\n\n")
    assert b'"error"' not in answer.body  # the client already had its whole answer
