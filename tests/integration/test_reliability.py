"""Failover, outlier ejection, admission control and draining, through a live proxy."""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

from pdproxy.demo.fleet import COMPLETION_PATHS as PATHS
from pdproxy.demo.fleet import LocalFleet, Worker, WorkerSpec
from pdproxy.demo.processes import http_get, http_json, wait_until
from pdproxy.ids import parse_request_id
from tests.conftest import FleetFactory
from tests.integration.support import (
    Answer,
    metric_value,
    open_raw_request,
    post_json,
    read_until,
    set_behaviour,
)

MODEL = "fake-model"
GOOD = {"model": MODEL, "prompt": "hello there", "max_tokens": 4}
ROUND_ROBIN = ["--prefill-policy", "round_robin", "--decode-policy", "round_robin"]


def completions(fleet: LocalFleet) -> str:
    return fleet.proxy_url + "/v1/completions"


def instance_view(fleet: LocalFleet, name: str) -> dict[str, Any]:
    listing = http_json(fleet.proxy_url + "/v1/instances")
    found = [i for i in listing["instances"] if i["http_address"] == name]
    assert len(found) == 1, listing
    view: dict[str, Any] = found[0]
    return view


def ids_seen(fleet: LocalFleet, role: str) -> list[str]:
    return [r["headers"]["x-request-id"] for r in fleet.completion_requests(role)]


def completion_ids(worker: Worker) -> set[str]:
    return {r["headers"]["x-request-id"] for r in worker.requests() if r["path"] in PATHS}


def test_a_failing_prefill_is_retried_on_another(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory([WorkerSpec("P"), WorkerSpec("P"), WorkerSpec("D")], ROUND_ROBIN)
    bad, good = fleet.role("P")
    set_behaviour(bad.url, status=500)
    for _ in range(6):
        answer = post_json(completions(fleet), GOOD)
        assert answer.status == 200, answer.body
    assert metric_value(fleet.proxy_url, "pdproxy_retries_total", {"role": "prefill"}) >= 1
    # Each retry carried a new id naming the healthy prefill; decode saw only those.
    decoded = ids_seen(fleet, "D")
    assert len(decoded) == 6
    for request_id in decoded:
        tagged = parse_request_id(request_id)
        assert tagged is not None and str(tagged.prefill) == good.zmq_address
    assert not set(decoded) & completion_ids(bad)


def test_a_decode_failing_before_its_first_byte_gets_a_new_pair(
    fleet_factory: FleetFactory,
) -> None:
    fleet = fleet_factory(
        [WorkerSpec("P"), WorkerSpec("P"), WorkerSpec("D"), WorkerSpec("D")], ROUND_ROBIN
    )
    bad = fleet.role("D")[0]
    set_behaviour(bad.url, status=503)
    for stream in (False, True):
        for _ in range(4):
            answer = post_json(completions(fleet), dict(GOOD, stream=stream))
            assert answer.status == 200, answer.body
            if stream:
                assert answer.body.rstrip().endswith(b"data: [DONE]")
                assert b'"error"' not in answer.body
    failed_ids = completion_ids(bad)
    assert failed_ids
    # The retry ran a new prefill under a new id: every id the bad decode saw was prefilled
    # once, and the retry's own id was prefilled too.
    prefilled = ids_seen(fleet, "P")
    assert len(prefilled) == 8 + len(failed_ids)
    assert failed_ids <= set(prefilled)
    assert metric_value(fleet.proxy_url, "pdproxy_retries_total", {"role": "decode"}) >= 1


def test_a_4xx_is_never_retried(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory([WorkerSpec("P"), WorkerSpec("P"), WorkerSpec("D")], ROUND_ROBIN)
    for worker in fleet.role("P"):
        set_behaviour(worker.url, status=400)
    answer = post_json(completions(fleet), GOOD)
    assert answer.status == 400
    assert len(fleet.completion_requests("P")) == 1
    assert metric_value(fleet.proxy_url, "pdproxy_retries_total") == 0


def test_without_migration_a_stream_cut_after_its_first_byte_ends_with_an_error_event(
    fleet_factory: FleetFactory,
) -> None:
    fleet = fleet_factory(
        [WorkerSpec("P"), WorkerSpec("D"), WorkerSpec("D")], [*ROUND_ROBIN, "--migration", "off"]
    )
    for worker in fleet.role("D"):
        set_behaviour(worker.url, drop_after_chunks=2)
    answer = post_json(completions(fleet), dict(GOOD, stream=True, max_tokens=8))
    assert answer.status == 200
    events = [e for e in answer.body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2][len(b"data: ") :])["error"]
    assert "decode" in error["message"] and error["code"] == "decode_reset"
    assert sum(b'"text"' in e for e in events) == 2  # the two chunks sent before the cut
    assert len(fleet.completion_requests("D")) == 1
    assert metric_value(fleet.proxy_url, "pdproxy_retries_total") == 0


def test_non_streaming_connection_dropped_before_any_byte_is_retried(
    fleet_factory: FleetFactory,
) -> None:
    fleet = fleet_factory([WorkerSpec("P"), WorkerSpec("D"), WorkerSpec("D")], ROUND_ROBIN)
    set_behaviour(fleet.role("D")[0].url, drop_after_chunks=0)
    for _ in range(4):
        assert post_json(completions(fleet), GOOD).status == 200
    assert metric_value(fleet.proxy_url, "pdproxy_retries_total", {"reason": "reset"}) >= 1


def test_attempts_are_bounded_and_the_last_failure_is_reported(
    fleet_factory: FleetFactory,
) -> None:
    fleet = fleet_factory(
        [WorkerSpec("P"), WorkerSpec("P"), WorkerSpec("D")],
        [*ROUND_ROBIN, "--max-attempts", "2", "--outlier-max-ejection-percent", "0"],
    )
    for worker in fleet.role("P"):
        set_behaviour(worker.url, status=500)
    answer = post_json(completions(fleet), GOOD)
    assert answer.status == 502
    assert answer.json()["error"]["code"] == "prefill_status_5xx"
    # Two attempts, on the two different prefills.
    assert sorted(len(completion_ids(w)) for w in fleet.role("P")) == [1, 1]
    assert not fleet.completion_requests("D")


def eject_flags(percent: int = 100) -> list[str]:
    return [
        *ROUND_ROBIN,
        "--outlier-consecutive-failures",
        "2",
        "--outlier-base-ejection-seconds",
        "1.5",
        "--outlier-max-ejection-percent",
        str(percent),
    ]


def test_an_instance_that_keeps_failing_is_ejected_then_probed_back(
    fleet_factory: FleetFactory,
) -> None:
    fleet = fleet_factory([WorkerSpec("P"), WorkerSpec("P"), WorkerSpec("D")], eject_flags(50))
    bad = fleet.role("P")[0]
    set_behaviour(bad.url, status=500)
    for _ in range(6):
        assert post_json(completions(fleet), GOOD).status == 200
    view = instance_view(fleet, bad.http_address)
    assert view["circuit"] == "open" and view["ejections"] == 1, view
    circuit = {"upstream": bad.http_address}
    assert metric_value(fleet.proxy_url, "pdproxy_upstream_circuit_state", circuit) == 2
    assert (
        metric_value(fleet.proxy_url, "pdproxy_outlier_ejections_total", {"role": "prefill"}) == 1
    )
    seen = len(completion_ids(bad))
    for _ in range(6):
        assert post_json(completions(fleet), GOOD).status == 200
    assert len(completion_ids(bad)) == seen, "an ejected instance got traffic"
    # Healed: after the cool-down it is half-open, and its first success closes it.
    set_behaviour(bad.url)
    time.sleep(1.6)
    for _ in range(4):
        assert post_json(completions(fleet), GOOD).status == 200
    assert len(completion_ids(bad)) > seen
    assert instance_view(fleet, bad.http_address)["circuit"] == "closed"
    assert metric_value(fleet.proxy_url, "pdproxy_upstream_circuit_state", circuit) == 0


def test_ready_turns_503_when_no_healthy_pair_remains(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory([WorkerSpec("P"), WorkerSpec("D")], eject_flags(100))
    set_behaviour(fleet.role("P")[0].url, status=500)
    assert post_json(completions(fleet), GOOD).status == 502  # 3 attempts: 2 make it eject
    status, body = http_get(fleet.proxy_url + "/ready")
    assert status == 503, body
    answer = post_json(completions(fleet), GOOD)
    assert answer.status == 503 and "out of rotation" in answer.json()["error"]["message"]
    set_behaviour(fleet.role("P")[0].url)
    wait_until(lambda: http_get(fleet.proxy_url + "/ready")[0] == 200, 5, "ready again")
    assert post_json(completions(fleet), GOOD).status == 200


def test_active_probes_eject_an_idle_dead_instance(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory(
        [WorkerSpec("P"), WorkerSpec("P"), WorkerSpec("D")],
        [*eject_flags(50), "--health-check-interval", "0.2", "--health-check-timeout", "0.5"],
    )
    dead = fleet.role("P")[1]
    dead.process.signal(signal.SIGKILL)  # no `leave`: it stays registered until its TTL
    wait_until(
        lambda: instance_view(fleet, dead.http_address)["circuit"] == "open",
        5,
        "the dead prefill ejected by probes alone",
    )
    assert metric_value(fleet.proxy_url, "pdproxy_health_probes_total", {"outcome": "failed"}) >= 2
    for _ in range(4):
        assert post_json(completions(fleet), GOOD).status == 200
    assert metric_value(fleet.proxy_url, "pdproxy_retries_total") == 0


def concurrently(count: int, call: Any) -> list[Any]:
    results: list[Any] = [None] * count

    def run(i: int) -> None:
        results[i] = call(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
        time.sleep(0.05)  # arrival order is the queue's order
    for thread in threads:
        thread.join(30)
    return results


def test_beyond_the_queue_requests_get_429_and_waiting_too_long_503(
    fleet_factory: FleetFactory,
) -> None:
    fleet = fleet_factory(
        [WorkerSpec("P"), WorkerSpec("D", token_latency_ms=400)],
        ["--max-inflight-requests", "1", "--max-queued-requests", "1", "--queue-timeout", "1"],
    )
    slow = dict(GOOD, max_tokens=5)  # about 2 s of decode
    answers: list[Answer] = concurrently(3, lambda i: post_json(completions(fleet), slow))
    statuses = [a.status for a in answers]
    assert statuses == [200, 503, 429], statuses
    for refusal in answers[1:]:
        assert refusal.headers["retry-after"] == "2"
    assert answers[1].json()["error"]["code"] == "queue_timeout"
    assert answers[2].json()["error"]["code"] == "queue_full"
    counter = "pdproxy_refused_requests_total"
    assert metric_value(fleet.proxy_url, counter, {"reason": "queue_full"}) == 1
    assert metric_value(fleet.proxy_url, counter, {"reason": "queue_timeout"}) == 1
    assert metric_value(fleet.proxy_url, "pdproxy_admitted_requests") == 0
    assert metric_value(fleet.proxy_url, "pdproxy_queued_requests") == 0


def test_a_request_waits_for_an_instance_below_its_cap(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory(
        [WorkerSpec("P"), WorkerSpec("D", token_latency_ms=200)],
        ["--instance-max-inflight", "1", "--queue-timeout", "10"],
    )
    answers: list[Answer] = concurrently(3, lambda i: post_json(completions(fleet), GOOD))
    assert [a.status for a in answers] == [200, 200, 200]
    # Never two decode legs at once on the capped instance.
    load = http_json(fleet.role("D")[0].url + "/_fake/load")
    assert load["peak_running"] == 1, load


def test_sigterm_drains_in_flight_streams_and_exits_0(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory(
        [WorkerSpec("P"), WorkerSpec("D", token_latency_ms=100)], ["--drain-seconds", "20"]
    )
    assert fleet.proxy is not None
    sock = open_raw_request(completions(fleet), dict(GOOD, stream=True, max_tokens=30))
    try:
        read_until(sock, b"data: {", timeout=10)
        fleet.proxy.signal(signal.SIGTERM)
        wait_until(lambda: http_get(fleet.proxy_url + "/ready")[0] == 503, 2, "/ready 503 at once")
        refused = post_json(completions(fleet), GOOD)
        assert refused.status == 503 and refused.json()["error"]["code"] == "draining"
        rest = read_until(sock, b"data: [DONE]", timeout=20)
    finally:
        sock.close()
    assert rest.count(b"data: {") >= 25
    assert fleet.proxy.process is not None
    assert fleet.proxy.process.wait(timeout=10) == 0


def test_sigterm_with_nothing_in_flight_exits_at_once(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory([WorkerSpec("P"), WorkerSpec("D")])
    assert fleet.proxy is not None and fleet.proxy.process is not None
    assert post_json(completions(fleet), GOOD).status == 200
    started = time.monotonic()
    fleet.proxy.signal(signal.SIGTERM)
    assert fleet.proxy.process.wait(timeout=10) == 0
    assert time.monotonic() - started < 5  # not the 30 s drain period


def test_a_drain_that_runs_out_of_time_still_exits_0(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory(
        [WorkerSpec("P"), WorkerSpec("D", token_latency_ms=500)], ["--drain-seconds", "1"]
    )
    assert fleet.proxy is not None and fleet.proxy.process is not None
    sock = open_raw_request(completions(fleet), dict(GOOD, stream=True, max_tokens=100))
    try:
        read_until(sock, b"data: {", timeout=10)
        fleet.proxy.signal(signal.SIGTERM)
        assert fleet.proxy.process.wait(timeout=10) == 0
        sock.settimeout(5)
        tail = b""
        try:
            while chunk := sock.recv(65536):
                tail += chunk
        except ConnectionResetError:
            pass  # cut: what the client of a process that had to go sees
        except TimeoutError:
            raise AssertionError("the cut stream was not closed promptly") from None
    finally:
        sock.close()
    # Cut short, but the client hears why: an error event, then the end of the stream.
    assert b'"code":"shutting_down"' in tail, tail[-300:]
    assert tail.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")  # and a complete chunked body
