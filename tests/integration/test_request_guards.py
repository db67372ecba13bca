"""Request bodies the proxy refuses before any leg, through a live `pdproxy serve` and fake
workers: JSON nested deeper than pdproxy can write back, bodies holding more values than it
parses, kv_transfer_params through vllm_xargs, and output limits beyond the context length the
decode announced (vLLM's own answer, no KV made for nothing). Also the count of KV a prefill
made for a decode that then refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdproxy.demo.fleet import LocalFleet, WorkerSpec
from pdproxy.demo.processes import LOOPBACK, free_ports, wait_until
from tests.conftest import FleetFactory
from tests.integration.support import (
    Answer,
    metric_value,
    post_json,
    request,
    set_behaviour,
)

MODEL = "fake-model"
CONTEXT = 512  # the fakes' --max-model-len, which they announce
PATHS = ["/v1/completions", "/v1/chat/completions"]
ORPHANED = "pdproxy_kv_orphaned_prefills_total"
DECODE_REFUSED = {"reason": "decode_refused"}


def payload(path: str, **extra: Any) -> dict[str, Any]:
    if path.endswith("/chat/completions"):
        return {"model": MODEL, "messages": [{"role": "user", "content": "hi there"}], **extra}
    return {"model": MODEL, "prompt": "hi there", **extra}


def assert_openai_error(answer: Answer, status: int, code: str, param: str | None = None) -> None:
    assert answer.status == status, (answer.status, answer.body[:300])
    assert answer.headers["content-type"].startswith("application/json")
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["param"]) == (code, param)
    assert error["type"] == "invalid_request_error"
    assert b"Traceback" not in answer.body


def nested_body(path: str, depth: int) -> bytes:
    """A valid request whose field `extra` makes the whole body `depth` levels deep."""
    head = json.dumps(payload(path))[:-1].encode()
    return head + b', "extra": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


def spec(role: str) -> WorkerSpec:
    return WorkerSpec(role, extra_args=("--max-model-len", str(CONTEXT)))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    fleet = LocalFleet(tmp_path_factory.mktemp("guards"), [spec("P"), spec("D")]).start()
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture(autouse=True)
def clean_slate(fleet: LocalFleet) -> Iterator[None]:
    fleet.reset_records()
    yield
    for worker in fleet.workers:
        set_behaviour(worker.url)


def no_leg_sent(fleet: LocalFleet) -> bool:
    return not fleet.completion_requests("P") and not fleet.completion_requests("D")


# --- nesting -----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("depth", [255, 1024, 1100])
def test_json_nested_too_deep_is_400(fleet: LocalFleet, path: str, depth: int) -> None:
    answer = request(fleet.proxy_url + path, body=nested_body(path, depth))
    # Up to orjson's 1024 levels pdproxy reads it but could not write the prefill leg; beyond,
    # it is not even read.
    assert_openai_error(answer, 400, "too_deep" if depth <= 1024 else "invalid_json")
    assert no_leg_sent(fleet)


@pytest.mark.parametrize("path", PATHS)
def test_json_nested_to_the_limit_is_served(fleet: LocalFleet, path: str) -> None:
    answer = request(fleet.proxy_url + path, body=nested_body(path, 254))
    assert answer.status == 200, answer.body[:300]
    (prefill_leg,) = fleet.completion_requests("P")
    assert prefill_leg["body"]["extra"] == json.loads(nested_body(path, 254))["extra"]


# --- kv_transfer_params by the vllm_xargs door ---------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_kv_transfer_params_in_vllm_xargs_is_400(fleet: LocalFleet, path: str) -> None:
    sneaked = {"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.6.6.6"}}
    answer = post_json(fleet.proxy_url + path, payload(path, vllm_xargs=sneaked))
    assert_openai_error(answer, 400, "invalid_request", "vllm_xargs.kv_transfer_params")
    assert no_leg_sent(fleet)
    # Other extension arguments still go through.
    answer = post_json(fleet.proxy_url + path, payload(path, vllm_xargs={"my_ext": 1}))
    assert answer.status == 200, answer.body


# --- the announced context length --------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "limit"),
    [
        ("/v1/completions", "max_tokens"),
        ("/v1/chat/completions", "max_tokens"),
        ("/v1/chat/completions", "max_completion_tokens"),
    ],
)
def test_more_output_tokens_than_the_decode_holds_is_refused_before_any_leg(
    fleet: LocalFleet, path: str, limit: str
) -> None:
    body = payload(path, **{limit: CONTEXT + 1})
    before = metric_value(fleet.proxy_url, ORPHANED, DECODE_REFUSED)
    answer = post_json(fleet.proxy_url + path, body)
    assert no_leg_sent(fleet)  # no prefill ran: no KV made for a decode that refuses
    # Word for word what the decode itself answers.
    direct = post_json(fleet.role("D")[0].url + path, body)
    assert (answer.status, answer.json()) == (direct.status, direct.json())
    assert answer.json()["error"] == {
        "message": f"{limit}={CONTEXT + 1} cannot be greater than max_model_len={CONTEXT}. "
        f"Please request fewer output tokens. (parameter={limit}, value={CONTEXT + 1})",
        "type": "BadRequestError",
        "param": limit,
        "code": 400,
    }
    assert metric_value(fleet.proxy_url, ORPHANED, DECODE_REFUSED) == before


@pytest.mark.parametrize("path", PATHS)
def test_an_output_limit_the_context_holds_is_served(fleet: LocalFleet, path: str) -> None:
    answer = post_json(fleet.proxy_url + path, payload(path, max_tokens=CONTEXT))
    assert answer.status == 200, answer.body
    assert len(fleet.completion_requests("P")) == 1 and len(fleet.completion_requests("D")) == 1


def test_a_static_decode_can_declare_its_context_length(fleet_factory: FleetFactory) -> None:
    # Nothing listens at these addresses: a leg sent there fails with 502, a refusal comes first.
    p_http, p_zmq, d_http, d_zmq, other_http, other_zmq = free_ports(6)
    prefill = f"http={LOOPBACK}:{p_http},zmq={LOOPBACK}:{p_zmq},model={MODEL}"
    decode = f"http={LOOPBACK}:{d_http},zmq={LOOPBACK}:{d_zmq},model={MODEL},max_model_len=64"
    fleet = fleet_factory(
        [], proxy_args=["--prefill", prefill, "--decode", decode, "--max-attempts", "1"]
    )
    url = fleet.proxy_url + "/v1/completions"
    answer = post_json(url, payload("/v1/completions", max_tokens=65))
    assert answer.status == 400 and answer.json()["error"]["param"] == "max_tokens"
    assert "max_model_len=64" in answer.json()["error"]["message"]
    answer = post_json(url, payload("/v1/completions", max_tokens=64))
    assert answer.status == 502  # within the context: the prefill leg was tried

    unknown = f"http={LOOPBACK}:{other_http},zmq={LOOPBACK}:{other_zmq},model={MODEL}"
    fleet = fleet_factory(
        [], proxy_args=["--prefill", prefill, "--decode", unknown, "--max-attempts", "1"]
    )
    body = payload("/v1/completions", max_tokens=65)
    answer = post_json(fleet.proxy_url + "/v1/completions", body)
    assert answer.status == 502  # no context length known: nothing refused on a guess


# --- KV orphaned by a decode that refused ------------------------------------------------------


def test_a_decode_refusing_after_the_prefill_counts_orphaned_kv(fleet: LocalFleet) -> None:
    before = metric_value(fleet.proxy_url, ORPHANED, DECODE_REFUSED)
    refusal = {"error": {"message": "no", "type": "BadRequestError", "param": None, "code": 400}}
    set_behaviour(fleet.role("D")[0].url, status=400, error_body=refusal)
    answer = post_json(fleet.proxy_url + "/v1/completions", payload("/v1/completions"))
    assert (answer.status, answer.json()) == (400, refusal)
    assert len(fleet.completion_requests("P")) == 1  # the prefill ran, its KV went nowhere
    assert metric_value(fleet.proxy_url, ORPHANED, DECODE_REFUSED) == before + 1


def test_a_prefill_refusal_orphans_nothing(fleet: LocalFleet) -> None:
    before = metric_value(fleet.proxy_url, ORPHANED, DECODE_REFUSED)
    set_behaviour(fleet.role("P")[0].url, status=400)
    answer = post_json(fleet.proxy_url + "/v1/completions", payload("/v1/completions"))
    assert answer.status == 400
    assert not fleet.completion_requests("D")
    assert metric_value(fleet.proxy_url, ORPHANED, DECODE_REFUSED) == before


def test_orphaned_kv_is_counted_with_the_decode_sent_beside_the_prefill(
    fleet_factory: FleetFactory,
) -> None:
    # pdproxy's connector: both legs at once, the decode's refusal arrives while the prefill runs.
    fleet = fleet_factory(
        [
            WorkerSpec("P", prefill_latency_ms=300, extra_args=("--connector", "pdproxy")),
            WorkerSpec("D", extra_args=("--connector", "pdproxy")),
        ]
    )
    set_behaviour(fleet.role("D")[0].url, status=400)
    assert metric_value(fleet.proxy_url, ORPHANED, DECODE_REFUSED) == 0
    answer = post_json(fleet.proxy_url + "/v1/completions", payload("/v1/completions"))
    assert answer.status == 400
    assert len(fleet.completion_requests("P")) == 1
    # Counted once the prefill, still running when the client got the refusal, ended.
    wait_until(
        lambda: metric_value(fleet.proxy_url, ORPHANED, DECODE_REFUSED) == 1,
        10.0,
        "the orphaned KV counted",
        fleet.processes(),
    )


# --- how much a body may cost ------------------------------------------------------------------

MiB = 1024 * 1024


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_a_body_of_tiny_values_is_413_without_being_parsed(fleet_factory: FleetFactory) -> None:
    """32 MiB of empty arrays once made the proxy parse about 1 GiB of Python objects."""
    fleet = fleet_factory([spec("P"), spec("D")])
    assert fleet.proxy is not None
    head = json.dumps(payload("/v1/completions"))[:-1].encode() + b', "extra": ['
    body = head + b"[]," * ((32 * MiB - len(head) - 64) // 3) + b"[]]}"
    assert len(body) <= 32 * MiB
    before = peak_rss_mib(fleet.proxy.pid)
    answer = request(fleet.proxy_url + "/v1/completions", body=body, timeout=60)
    assert answer.status == 413, answer.body[:300]
    assert answer.json()["error"]["code"] == "too_many_values"
    assert no_leg_sent(fleet)
    # The body itself, read and counted, with room to spare; parsed it was about 1,000 MiB.
    assert peak_rss_mib(fleet.proxy.pid) - before < 256
