"""The main path through a live `pdproxy serve` and fake P/D workers, with the openai client."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest

from pdproxy.demo.fleet import LocalFleet, WorkerSpec
from pdproxy.demo.processes import wait_until
from pdproxy.ids import VLLM_DECODE_SIDE, VLLM_PREFILL_SIDE, parse_request_id
from tests.conftest import FleetFactory
from tests.integration.support import (
    hang_up_mid_stream_aborts,
    metric_value,
    open_raw_request,
    post_json,
    read_until,
    set_behaviour,
)

MODEL = "fake-model"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    specs = [WorkerSpec("P"), WorkerSpec("P"), WorkerSpec("D"), WorkerSpec("D")]
    # Round robin (vLLM's example behaviour) makes the spread exact and testable; the default
    # policies are tested in test_pairing_live.py.
    policies = ["--prefill-policy", "round_robin", "--decode-policy", "round_robin"]
    fleet = LocalFleet(tmp_path_factory.mktemp("fleet2x2"), specs, policies).start()
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture
def client(fleet: LocalFleet) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=fleet.proxy_url + "/v1", api_key="sk-client", max_retries=0, timeout=30
    )


def _by_request_id(records: list[dict[str, Any]], request_id: str) -> list[dict[str, Any]]:
    return [r for r in records if r["headers"].get("x-request-id") == request_id]


def test_completion_non_streaming(fleet: LocalFleet, client: openai.OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=7)
    tagged = parse_request_id(completion.id)
    assert tagged is not None, completion.id
    assert completion.id.startswith("cmpl-___prefill_addr_")
    assert completion.usage is not None and completion.usage.completion_tokens == 7
    assert len(completion.choices[0].text.split()) == 7
    zmq_by_role: dict[str, set[str]] = {w.spec.role: set() for w in fleet.workers}
    for w in fleet.workers:
        zmq_by_role[w.spec.role].add(w.zmq_address)
    assert str(tagged.prefill) in zmq_by_role["P"]
    assert str(tagged.decode) in zmq_by_role["D"]


@pytest.mark.parametrize("chat", [False, True])
def test_stream_equals_non_stream_and_usage(client: openai.OpenAI, chat: bool) -> None:
    prompt = f"streaming equals whole {chat}"
    if chat:
        messages: Any = [{"role": "user", "content": prompt}]
        whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9)
        whole_text = whole.choices[0].message.content
        stream = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=9,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, usage = [], None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
    else:
        whole_c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=9)
        whole_text = whole_c.choices[0].text
        stream_c = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=9,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, usage = [], None
        for chunk_c in stream_c:
            if chunk_c.choices:
                pieces.append(chunk_c.choices[0].text)
            usage = chunk_c.usage or usage
    assert "".join(pieces) == whole_text
    assert len(pieces) == 9
    assert usage is not None and usage.completion_tokens == 9


def test_stream_without_include_usage_has_no_usage(client: openai.OpenAI) -> None:
    stream = client.completions.create(model=MODEL, prompt="x y", max_tokens=3, stream=True)
    assert all(chunk.usage is None for chunk in stream)


def test_prefill_leg_body_and_headers(fleet: LocalFleet) -> None:
    body = {
        "model": MODEL,
        "prompt": ["first prompt", "second prompt"],
        "max_tokens": 20,
        "min_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "user_field": {"nested": [1, 2.5, "x"]},
    }
    answer = post_json(
        fleet.proxy_url + "/v1/completions",
        body,
        headers={"X-Request-Id": "client-own-id-42", "Authorization": "Bearer sk-user"},
    )
    assert answer.status == 200, answer.body
    assert answer.headers["x-request-id"] == "client-own-id-42"
    assert answer.headers["content-type"].startswith("text/event-stream")
    assert answer.body.endswith(b"data: [DONE]\n\n")
    first_event = json.loads(answer.body.split(b"\n\n")[0].removeprefix(b"data: "))
    request_id = first_event["id"].removeprefix("cmpl-")
    tagged = parse_request_id(request_id)
    assert tagged is not None

    prefill = _by_request_id(fleet.completion_requests("P"), request_id)
    decode = _by_request_id(fleet.completion_requests("D"), request_id)
    assert len(prefill) == 1 and len(decode) == 1
    expected_prefill = dict(body, max_tokens=1, min_tokens=1, stream=False)
    del expected_prefill["stream_options"]
    assert prefill[0]["body"] == expected_prefill
    assert decode[0]["body"] == body  # the client's body, unchanged
    for leg in (prefill[0], decode[0]):
        assert leg["headers"]["x-request-id"] == request_id
        assert leg["headers"]["authorization"] == "Bearer sk-user"
        assert "client-own-id-42" not in json.dumps(leg["headers"])
    # Each leg went to the instance whose KV address the id names.
    p_worker = next(w for w in fleet.role("P") if w.zmq_address == str(tagged.prefill))
    assert _by_request_id(p_worker.requests(), request_id)
    assert VLLM_PREFILL_SIDE.search(request_id) and VLLM_DECODE_SIDE.search(request_id)


def test_chat_prefill_pins_max_completion_tokens(fleet: LocalFleet) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "pin both limits"}],
        "max_completion_tokens": 30,
        "min_tokens": 0,
    }
    answer = post_json(fleet.proxy_url + "/v1/chat/completions", body)
    assert answer.status == 200, answer.body
    request_id = answer.json()["id"].removeprefix("chatcmpl-")
    (prefill,) = _by_request_id(fleet.completion_requests("P"), request_id)
    assert prefill["body"] == dict(body, max_tokens=1, max_completion_tokens=1, stream=False)
    assert answer.json()["usage"]["completion_tokens"] == 30


def test_every_request_hands_kv_to_its_decode(fleet: LocalFleet, client: openai.OpenAI) -> None:
    fleet.reset_records()
    ids = []
    for i in range(12):
        if i % 2:
            c = client.completions.create(model=MODEL, prompt=f"kv {i}", max_tokens=2)
            ids.append(c.id.removeprefix("cmpl-"))
        else:
            ch = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"kv {i}"}], max_tokens=2
            )
            ids.append(ch.id.removeprefix("chatcmpl-"))
    kv_ok = [rid for w in fleet.role("D") for rid in w.events()["kv_ok"]]
    kv_failed = [f for w in fleet.role("D") for f in w.events()["kv_failed"]]
    assert sorted(kv_ok) == sorted(ids)
    assert kv_failed == []


def test_round_robin_spreads_evenly_under_concurrency(fleet: LocalFleet) -> None:
    fleet.reset_records()

    async def send_all() -> None:
        client = openai.AsyncOpenAI(base_url=fleet.proxy_url + "/v1", api_key="x", max_retries=0)
        limit = asyncio.Semaphore(16)

        async def one(i: int) -> None:
            async with limit:
                await client.completions.create(model=MODEL, prompt=f"rr {i}", max_tokens=1)

        await asyncio.gather(*(one(i) for i in range(100)))
        await client.close()

    asyncio.run(send_all())
    per_worker: Counter[str] = Counter()
    for worker in fleet.workers:
        per_worker[worker.http_address] = len(
            [r for r in worker.requests() if r["path"] == "/v1/completions"]
        )
    assert sorted(per_worker.values()) == [50, 50, 50, 50], per_worker
    # And every (P, D) pair carried KV: 25 requests each, none left out.
    per_pair: Counter[tuple[str, str]] = Counter()
    for record in fleet.completion_requests("P"):
        tagged = parse_request_id(record["headers"]["x-request-id"])
        assert tagged is not None
        per_pair[(str(tagged.prefill), str(tagged.decode))] += 1
    assert len(per_pair) == 4 and set(per_pair.values()) == {25}, per_pair


def test_metrics_after_traffic(fleet: LocalFleet, client: openai.OpenAI) -> None:
    for chunk in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "s"}], max_tokens=3, stream=True
    ):
        assert chunk.id.startswith("chatcmpl-")
    # A client that hangs up right after [DONE] finished its request: 200, not 499.
    assert metric_value(fleet.proxy_url, "pdproxy_requests_total", {"status": "499"}) == 0
    before = metric_value(
        fleet.proxy_url, "pdproxy_requests_total", {"endpoint": "/v1/completions", "status": "200"}
    )
    # The stream's time to first token was observed; a whole answer has none.
    first_tokens = metric_value(fleet.proxy_url, "pdproxy_time_to_first_token_seconds_count")
    assert first_tokens >= 1
    client.completions.create(model=MODEL, prompt="count me", max_tokens=1)
    url = fleet.proxy_url
    assert metric_value(url, "pdproxy_time_to_first_token_seconds_count") == first_tokens
    after = metric_value(
        url, "pdproxy_requests_total", {"endpoint": "/v1/completions", "status": "200"}
    )
    assert after == before + 1
    assert metric_value(url, "pdproxy_prefill_duration_seconds_count") >= 1
    assert metric_value(url, "pdproxy_decode_first_byte_seconds_count") >= 1
    assert metric_value(url, "pdproxy_request_duration_seconds_count") >= 1
    assert metric_value(url, "pdproxy_registry_instances", {"role": "prefill"}) == 2
    assert metric_value(url, "pdproxy_registry_instances", {"role": "decode"}) == 2
    assert metric_value(url, "pdproxy_registry_messages_total", {"outcome": "accepted"}) >= 4
    for worker in fleet.workers:
        role = "prefill" if worker.spec.role == "P" else "decode"
        assert (
            metric_value(
                url, "pdproxy_inflight_legs", {"role": role, "upstream": worker.http_address}
            )
            == 0
        )


def test_models_lists_announced_models(fleet: LocalFleet, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_client_disconnect_mid_stream_reaches_decode(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory(
        [WorkerSpec("P"), WorkerSpec("D", token_latency_ms=100)],
    )
    sock = open_raw_request(
        fleet.proxy_url + "/v1/completions",
        {"model": MODEL, "prompt": "long story", "max_tokens": 500, "stream": True},
    )
    hang_up_mid_stream_aborts(fleet.role("D")[0], sock)


def test_abandoned_streams_give_their_connection_slot_back(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory(
        [WorkerSpec("P"), WorkerSpec("D", token_latency_ms=50)],
        proxy_args=["--upstream-max-connections", "1"],
    )
    for _ in range(3):
        sock = open_raw_request(
            fleet.proxy_url + "/v1/completions",
            {"model": MODEL, "prompt": "leave early", "max_tokens": 500, "stream": True},
        )
        read_until(sock, b"data: {", timeout=10)
        sock.close()
    # With one slot, any leak would make this wait forever; the client gives up after 10 s.
    client = openai.OpenAI(base_url=fleet.proxy_url + "/v1", api_key="x", max_retries=0, timeout=10)
    assert client.completions.create(model=MODEL, prompt="still served", max_tokens=2).choices


def test_client_disconnect_during_prefill_cancels_it(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory([WorkerSpec("P", prefill_latency_ms=3000), WorkerSpec("D")])
    sock = open_raw_request(
        fleet.proxy_url + "/v1/completions", {"model": MODEL, "prompt": "abandon", "max_tokens": 5}
    )
    prefill, decode = fleet.role("P")[0], fleet.role("D")[0]
    deadline = time.monotonic() + 5
    while not fleet.completion_requests("P") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fleet.completion_requests("P"), "the prefill leg never started"
    hung_up = time.monotonic()
    sock.close()
    aborted: list[dict[str, Any]] = []
    while not aborted and time.monotonic() < deadline:
        aborted = prefill.events()["aborted"]
        time.sleep(0.05)
    assert len(aborted) == 1 and aborted[0]["time"] - hung_up < 1.0
    time.sleep(3.5)  # past the prefill latency: a decode leg would have been sent by now
    assert fleet.completion_requests("D") == []
    assert decode.events()["kv_received"] == []
    assert (
        metric_value(
            fleet.proxy_url,
            "pdproxy_requests_total",
            {"endpoint": "/v1/completions", "status": "499"},
        )
        == 1
    )
    assert metric_value(fleet.proxy_url, "pdproxy_inflight_legs", {"role": "prefill"}) == 0


def test_stream_is_relayed_while_it_is_generated(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory([WorkerSpec("P"), WorkerSpec("D", token_latency_ms=100)])
    decode = fleet.role("D")[0]
    sock = open_raw_request(
        fleet.proxy_url + "/v1/completions",
        {"model": MODEL, "prompt": "flush early", "max_tokens": 30, "stream": True},
    )
    try:
        read_until(sock, b"data: {", timeout=10)
        # The first chunk reached the client while D still had ~3 s of tokens to produce.
        assert decode.events()["completed"] == []
        rest = read_until(sock, b"data: [DONE]", timeout=20)
    finally:
        sock.close()
    assert rest.count(b"data: {") >= 29
    assert len(decode.events()["completed"]) == 1


def test_mixed_outcomes_leave_nothing_in_flight(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory(
        [WorkerSpec("P"), WorkerSpec("P"), WorkerSpec("D", token_latency_ms=5)],
    )
    failing = fleet.role("P")[1]
    set_behaviour(failing.url, status=500)
    url = fleet.proxy_url + "/v1/completions"
    outcomes: Counter[str] = Counter()

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        kind = i % 5
        body: Any = {"model": MODEL, "prompt": f"mix {i}", "max_tokens": 8}
        if kind == 1:
            body["stream"] = True
        if kind == 2:
            body.update(stream=True, max_tokens=200)
        if kind == 3:
            body["model"] = "nobody-serves-this"
        data = b"{not json" if kind == 4 else json.dumps(body).encode()
        async with session.post(url, data=data) as response:
            if kind == 2 and response.status == 200:
                await response.content.readany()
                response.close()  # hang up mid-stream
                outcomes["hung_up"] += 1
                return
            await response.read()
            outcomes[str(response.status)] += 1

    async def run() -> None:
        limit = asyncio.Semaphore(32)
        async with aiohttp.ClientSession() as session:

            async def bounded(i: int) -> None:
                async with limit:
                    await one(session, i)

            await asyncio.wait_for(asyncio.gather(*(bounded(i) for i in range(500))), 120)

    asyncio.run(run())
    assert sum(outcomes.values()) == 500
    assert outcomes["400"] == 100 and outcomes["404"] == 100
    # The failing prefill's requests were retried on the healthy one: no client saw its 500s.
    assert outcomes["502"] == 0 and outcomes["200"] > 0 and outcomes["hung_up"] > 0
    assert metric_value(fleet.proxy_url, "pdproxy_retries_total", {"role": "prefill"}) > 0

    def settled() -> bool:
        counted = metric_value(fleet.proxy_url, "pdproxy_requests_total")
        inflight = metric_value(fleet.proxy_url, "pdproxy_inflight_legs")
        return counted >= 500 and inflight == 0

    wait_until(settled, 10, "every request counted and nothing in flight")
    for worker in fleet.workers:
        role = "prefill" if worker.spec.role == "P" else "decode"
        labels = {"role": role, "upstream": worker.http_address}
        assert metric_value(fleet.proxy_url, "pdproxy_inflight_legs", labels) == 0
