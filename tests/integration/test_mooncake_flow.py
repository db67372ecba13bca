"""The mooncake flow through a live `pdproxy serve` and fake workers speaking vLLM's
MooncakeConnector protocol (pdproxy.fake_vllm.kv_mooncake): a transfer id per attempt in both
legs, the prefill's bootstrap address from its announcement, its engine id from the bootstrap
server's /query, both legs at once; mixed fleets where every pair is of one kind; retries per
kind with a new transfer id; a bootstrap server that does not answer."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pdproxy.demo.fleet import Worker, WorkerSpec
from pdproxy.demo.processes import free_ports, http_json
from pdproxy.http.upstream import Upstream
from pdproxy.ids import Address, parse_request_id
from pdproxy.proxy.bootstrap import BootstrapError, EngineIds
from tests.conftest import FleetFactory
from tests.integration.support import (
    ScriptedUpstream,
    json_answer,
    metric_value,
    post_json,
    set_behaviour,
)

MODEL = "fake-model"
ROUND_ROBIN = ["--prefill-policy", "round_robin", "--decode-policy", "round_robin"]
# A static prefill declares no geometry; the fake workers announce theirs.
UNKNOWN_GEOMETRY = ["--allow-unknown-geometry"]


def spec(role: str, connector: str, **kwargs: Any) -> WorkerSpec:
    return WorkerSpec(role, extra_args=("--connector", connector), **kwargs)  # type: ignore[arg-type]


def completion(stream: bool = False, chat: bool = False) -> tuple[str, dict[str, Any]]:
    words = " ".join(f"word{i}" for i in range(40))
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "stream": stream}
    if chat:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": words}]}
    return "/v1/completions", {**body, "prompt": words}


def legs(worker: Worker) -> list[dict[str, Any]]:
    """The completion legs `worker` received: X-Request-Id and kv_transfer_params."""
    return [
        {
            "id": r["headers"].get("x-request-id"),
            "params": (r["body"] or {}).get("kv_transfer_params"),
        }
        for r in worker.requests()
        if r["path"] in ("/v1/completions", "/v1/chat/completions")
    ]


def engine_id(worker: Worker) -> str:
    """What the fake prefill's bootstrap server says its engine is."""
    return str(http_json(f"http://{worker.http_address}/query")["0"]["engine_id"])


@pytest.mark.parametrize(("stream", "chat"), [(False, False), (True, True)])
def test_both_legs_carry_the_attempts_transfer_id_and_the_prefills_engine(
    fleet_factory: FleetFactory, stream: bool, chat: bool
) -> None:
    fleet = fleet_factory([spec("P", "mooncake", prefill_latency_ms=300.0), spec("D", "mooncake")])
    [prefill], [decode] = fleet.role("P"), fleet.role("D")
    path, body = completion(stream, chat)
    answer = post_json(fleet.proxy_url + path, body)
    assert answer.status == 200, answer.body
    [p_leg], [d_leg] = legs(prefill), legs(decode)
    transfer = p_leg["params"]["transfer_id"]
    assert p_leg["params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": transfer,
    }
    assert d_leg["params"] == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": transfer,
        "remote_bootstrap_addr": f"http://{prefill.http_address}",
        "remote_engine_id": engine_id(prefill),
    }
    # The transfer id is this attempt's uid, the one in the request id both legs carry.
    tagged = parse_request_id(p_leg["id"])
    assert tagged is not None and tagged.uid == transfer and d_leg["id"] == p_leg["id"]
    # The decode pulled the prefill's KV (held under the transfer id), nothing computed locally.
    events = decode.events()
    assert len(events["kv_ok"]) == 1 and not events.get("computed_locally")
    assert [e["transfer_id"] for e in prefill.events()["kv_served"]] == [transfer]
    # Both legs at once: the decode had its leg while the prefill still computed (300 ms).
    d_time = float(decode.requests()[0]["time"])
    held = float(prefill.events()["kv_held"][0]["time"])
    assert d_time < held


# A fleet mixing mooncake with the other kinds: tests/integration/test_nixl_push_flow.py.


@pytest.mark.parametrize("kind", ["mooncake", "nixl", "pdproxy"])
def test_a_failed_prefill_is_retried_on_another_with_a_new_transfer(
    fleet_factory: FleetFactory, kind: str
) -> None:
    fleet = fleet_factory([spec("P", kind), spec("P", kind), spec("D", kind)], ROUND_ROBIN)
    broken, healthy = fleet.role("P")
    set_behaviour(f"http://{broken.http_address}", status=500)
    path, body = completion()
    for _ in range(2):  # round robin: one of the two starts on the broken prefill
        answer = post_json(fleet.proxy_url + path, body)
        assert answer.status == 200, answer.body
    retried = metric_value(fleet.proxy_url, "pdproxy_retries_total", {"role": "prefill"})
    assert retried >= 1
    ids = [leg["id"] for leg in legs(broken)] + [leg["id"] for leg in legs(healthy)]
    assert len(set(ids)) == len(ids)  # every attempt its own request id
    assert legs(broken) and len(legs(healthy)) == 2
    if kind == "mooncake":
        transfers = [leg["params"]["transfer_id"] for w in (broken, healthy) for leg in legs(w)]
        assert len(set(transfers)) == len(transfers)  # a new transfer id per attempt
        # The decode pulled exactly the transfers the healthy prefill held.
        served = {leg["params"]["transfer_id"] for leg in legs(healthy)}
        assert {e["transfer_id"] for e in healthy.events()["kv_served"]} == served


def test_a_bootstrap_server_that_fails_is_a_prefill_failure_of_its_own_kind(
    fleet_factory: FleetFactory,
) -> None:
    (closed,) = free_ports(1)  # nothing listens there
    static = (
        f"http=127.0.0.1:{closed},zmq=127.0.0.1:{closed},model={MODEL},"
        f"connector=mooncake,bootstrap=127.0.0.1:{closed}"
    )
    fleet = fleet_factory(
        [spec("P", "mooncake"), spec("D", "mooncake")],
        [*ROUND_ROBIN, "--prefill", static, *UNKNOWN_GEOMETRY],
    )
    path, body = completion()
    for _ in range(2):  # one of them starts on the static prefill: its /query fails, retried
        answer = post_json(fleet.proxy_url + path, body)
        assert answer.status == 200, answer.body
    labels = {"role": "prefill", "reason": "bootstrap_query"}
    assert metric_value(fleet.proxy_url, "pdproxy_upstream_errors_total", labels) >= 1


def test_with_no_other_prefill_the_client_hears_the_bootstrap_failure(
    fleet_factory: FleetFactory,
) -> None:
    (closed,) = free_ports(1)
    static = (
        f"http=127.0.0.1:{closed},zmq=127.0.0.1:{closed},model={MODEL},"
        f"connector=mooncake,bootstrap=127.0.0.1:{closed}"
    )
    fleet = fleet_factory(
        [spec("D", "mooncake")], ["--prefill", static, "--max-attempts", "1", *UNKNOWN_GEOMETRY]
    )
    path, body = completion()
    answer = post_json(fleet.proxy_url + path, body)
    assert answer.status == 502, answer.body
    error = answer.json()["error"]
    assert error["code"] == "prefill_bootstrap_query"
    assert f"bootstrap server http://127.0.0.1:{closed}/query" in error["message"]


def test_the_engine_id_is_asked_once_cached_and_asked_again_once_forgotten() -> None:
    answers = iter([b'{"0": {"engine_id": "first"}}', b'{"0": {"engine_id": "second"}}'])
    asked: list[int] = []

    async def script(writer: asyncio.StreamWriter) -> None:
        asked.append(1)
        writer.write(json_answer(next(answers)))
        await writer.drain()

    async def run(port: int) -> list[str]:
        upstream = Upstream(1.0, 16, "test")
        ids = EngineIds(upstream, 2.0, asyncio.get_running_loop())
        where = Address("127.0.0.1", port)
        try:
            together = await asyncio.gather(*(ids.engine_id(where) for _ in range(3)))
            cached = await ids.engine_id(where)
            ids.forget(where)
            return [*together, cached, await ids.engine_id(where)]
        finally:
            await upstream.close()

    with ScriptedUpstream(script) as server:
        got = asyncio.run(run(server.port))
    assert got == ["first", "first", "first", "first", "second"]
    assert len(asked) == 2  # three at once shared one question; the cache answered the fourth


def test_a_silent_bootstrap_server_fails_within_the_bound() -> None:
    async def silent(writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(30)

    async def run(port: int) -> str:
        upstream = Upstream(1.0, 16, "test")
        ids = EngineIds(upstream, 0.3, asyncio.get_running_loop())
        try:
            async with asyncio.timeout(10):
                await ids.engine_id(Address("127.0.0.1", port))
        except BootstrapError as exc:
            return str(exc)
        finally:
            await upstream.close()
        return "answered"

    with ScriptedUpstream(silent) as server:
        message = asyncio.run(run(server.port))
    assert message == (
        f"bootstrap server http://127.0.0.1:{server.port}/query did not answer within 0.3s"
    )
