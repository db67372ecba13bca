"""Structured JSON logs (one line per request) and W3C trace context on both legs, through a
live `pdproxy serve` and fake workers."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from pdproxy.demo.fleet import LocalFleet, WorkerSpec
from pdproxy.demo.processes import wait_until
from tests.conftest import FleetFactory
from tests.integration.support import post_json, set_behaviour

MODEL = "fake-model"
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


def json_lines(fleet: LocalFleet) -> list[dict[str, Any]]:
    text = (fleet.log_dir / "pdproxy.log").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def access_lines(fleet: LocalFleet) -> list[dict[str, Any]]:
    return [line for line in json_lines(fleet) if line["logger"] == "pdproxy.access"]


def wait_access_lines(fleet: LocalFleet, count: int) -> list[dict[str, Any]]:
    wait_until(lambda: len(access_lines(fleet)) >= count, 10, f"{count} access lines")
    return access_lines(fleet)


def test_json_logs_one_line_per_request_and_trace_context(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory([WorkerSpec("P"), WorkerSpec("D")], proxy_args=["--log-format", "json"])
    prefill, decode = fleet.role("P")[0], fleet.role("D")[0]
    answer = post_json(
        fleet.proxy_url + "/v1/completions",
        {"model": MODEL, "prompt": "trace me", "max_tokens": 3},
        headers={
            "traceparent": f"00-{TRACE}-{PARENT}-01",
            "tracestate": "vendor=1",
            "X-Request-Id": "client-42",
        },
    )
    assert answer.status == 200
    (p_leg,) = fleet.completion_requests("P")
    (d_leg,) = fleet.completion_requests("D")
    spans = []
    for leg in (p_leg, d_leg):
        version, trace, span, flags = leg["headers"]["traceparent"].split("-")
        assert (version, trace, flags) == ("00", TRACE, "01")
        assert len(span) == 16 and span != PARENT
        assert leg["headers"]["tracestate"] == "vendor=1"
        spans.append(span)
    assert spans[0] != spans[1]  # one span per leg

    (line,) = wait_access_lines(fleet, 1)
    assert line["message"] == "request" and line["level"] == "info"
    assert line["endpoint"] == "/v1/completions" and line["status"] == 200
    assert line["outcome"] == "ok" and line["model"] == MODEL and line["stream"] is False
    assert line["request_id"] == p_leg["headers"]["x-request-id"]
    assert line["client_request_id"] == "client-42"
    assert line["trace_id"] == TRACE
    assert (line["prefill"], line["decode"]) == (prefill.http_address, decode.http_address)
    assert line["direct"] is False
    assert line["prefill_ms"] > 0 and line["decode_first_byte_ms"] > 0
    assert line["duration_ms"] >= line["prefill_ms"]
    # Every line the process wrote is JSON, uvicorn's own included.
    loggers = {entry["logger"] for entry in json_lines(fleet)}
    assert any(name.startswith("uvicorn") for name in loggers)


def test_failures_and_untraced_requests_are_logged_too(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory([WorkerSpec("P"), WorkerSpec("D")], proxy_args=["--log-format", "json"])
    ok = post_json(
        fleet.proxy_url + "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True},
    )
    assert ok.status == 200
    refused = post_json(fleet.proxy_url + "/v1/completions", {"model": "nobody", "prompt": "x"})
    assert refused.status == 404
    bad = post_json(fleet.proxy_url + "/v1/completions", {"prompt": "no model"})
    assert bad.status == 400
    first, second, third = wait_access_lines(fleet, 3)
    assert first["outcome"] == "ok" and first["stream"] is True
    assert first["endpoint"] == "/v1/chat/completions"
    # Without a client traceparent both legs share one new trace, named in the log.
    traces = {leg["headers"]["traceparent"].split("-")[1] for leg in fleet.completion_requests()}
    assert traces == {first["trace_id"]}
    assert (second["status"], second["outcome"]) == (404, "model_not_found")
    assert second["prefill"] is None and second["decode"] is None
    assert (third["status"], third["outcome"]) == (400, "missing_model")


def span_lines(fleet: LocalFleet) -> list[dict[str, Any]]:
    spans = []
    for line in (fleet.log_dir / "pdproxy.log").read_text().splitlines():
        if line.startswith('{"name": "pdproxy.'):
            spans.append(json.loads(line))
    return spans


def test_opentelemetry_spans_nest_under_the_clients_and_name_each_leg(
    fleet_factory: FleetFactory,
) -> None:
    fleet = fleet_factory(
        [WorkerSpec("P"), WorkerSpec("D")], proxy_args=["--otel-exporter", "console"]
    )
    answer = post_json(
        fleet.proxy_url + "/v1/completions",
        {"model": MODEL, "prompt": "span me", "max_tokens": 2},
        headers={"traceparent": f"00-{TRACE}-{PARENT}-01"},
    )
    assert answer.status == 200
    wait_until(lambda: len(span_lines(fleet)) >= 3, 10, "three spans")
    spans = {span["name"]: span for span in span_lines(fleet)}
    request, prefill, decode = (
        spans["pdproxy.request"],
        spans["pdproxy.prefill"],
        spans["pdproxy.decode"],
    )
    assert {s["context"]["trace_id"] for s in (request, prefill, decode)} == {f"0x{TRACE}"}
    assert request["parent_id"] == f"0x{PARENT}"
    request_span = request["context"]["span_id"]
    assert prefill["parent_id"] == decode["parent_id"] == request_span
    assert request["kind"] == "SpanKind.SERVER" and prefill["kind"] == "SpanKind.CLIENT"
    assert prefill["attributes"]["server.address"] == fleet.role("P")[0].http_address
    assert decode["attributes"]["server.address"] == fleet.role("D")[0].http_address
    # Each leg's traceparent names that leg's own span: vLLM's spans nest under it.
    for role, span in (("P", prefill), ("D", decode)):
        (leg,) = fleet.completion_requests(role)
        sent_span = leg["headers"]["traceparent"].split("-")[2]
        assert f"0x{sent_span}" == span["context"]["span_id"]
    assert request["status"]["status_code"] == "UNSET"


def test_a_failed_leg_is_an_error_span(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory(
        [WorkerSpec("P"), WorkerSpec("D")], proxy_args=["--otel-exporter", "console"]
    )
    set_behaviour(fleet.role("P")[0].url, status=500)
    answer = post_json(
        fleet.proxy_url + "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}
    )
    assert answer.status == 502
    wait_until(lambda: len(span_lines(fleet)) >= 2, 10, "two spans")
    spans = {span["name"]: span for span in span_lines(fleet)}
    assert spans["pdproxy.prefill"]["status"]["status_code"] == "ERROR"
    assert spans["pdproxy.request"]["status"]["status_code"] == "ERROR"
    assert "pdproxy.decode" not in spans  # no decode leg after a failed prefill


def text_access_lines(fleet: LocalFleet) -> list[str]:
    text = (fleet.log_dir / "pdproxy.log").read_text()
    return [line for line in text.splitlines() if "pdproxy.access" in line]


@pytest.mark.parametrize("turned_off", [False, True])
def test_text_logs_have_one_access_line_per_request_unless_turned_off(
    fleet_factory: FleetFactory, turned_off: bool
) -> None:
    proxy_args = ["--access-log", "false"] if turned_off else []
    fleet = fleet_factory([WorkerSpec("P"), WorkerSpec("D")], proxy_args=proxy_args)
    body = {"model": MODEL, "prompt": "count me", "max_tokens": 3}
    assert post_json(fleet.proxy_url + "/v1/completions", body).status == 200
    assert post_json(fleet.proxy_url + "/v1/completions", dict(body, model="x")).status == 404
    if turned_off:
        time.sleep(0.5)  # an access line would have been written by now
        assert text_access_lines(fleet) == []
        return
    wait_until(lambda: len(text_access_lines(fleet)) >= 2, 10, "two access lines")
    ok, refused = text_access_lines(fleet)
    prefill, decode = fleet.role("P")[0], fleet.role("D")[0]
    assert " request endpoint=/v1/completions status=200 " in ok
    assert f"prefill={prefill.http_address} decode={decode.http_address}" in ok
    assert ok.endswith(" outcome=ok")
    assert "status=404" in refused and refused.endswith(" outcome=model_not_found")
