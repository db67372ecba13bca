"""Geometry-aware pairing, the NIXL flow, conditional disaggregation and prefix affinity,
through a live `pdproxy serve` and fake workers announcing their geometry."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, Literal

from pdproxy.demo.fleet import LocalFleet, WorkerSpec
from pdproxy.demo.processes import http_get, http_json, wait_until
from pdproxy.ids import parse_request_id
from tests.conftest import FleetFactory
from tests.integration.support import metric_value, post_json, set_behaviour

MODEL = "fake-model"


def geometry(connector: str, tp: int, *more: str) -> tuple[str, ...]:
    return ("--connector", connector, "--tp-size", str(tp), "--num-kv-heads", "8", *more)


def completion(fleet: LocalFleet, prompt: str, **extra: Any) -> dict[str, Any]:
    answer = post_json(
        fleet.proxy_url + "/v1/completions",
        {"model": MODEL, "prompt": prompt, "max_tokens": 3, **extra},
    )
    assert answer.status == 200, answer.body
    body: dict[str, Any] = answer.json()
    return body


def legs(fleet: LocalFleet, role: str) -> list[dict[str, Any]]:
    return fleet.completion_requests(role)


def test_mixed_tp_fleet_under_p2p_nccl_never_uses_the_orphan(
    fleet_factory: FleetFactory,
) -> None:
    fleet = fleet_factory(
        [
            WorkerSpec("P", extra_args=geometry("p2p_nccl", 2)),
            WorkerSpec("P", extra_args=geometry("p2p_nccl", 4)),
            WorkerSpec("D", extra_args=geometry("p2p_nccl", 2)),
        ]
    )
    good, orphan = fleet.role("P")
    for i in range(12):
        completion(fleet, f"mixed fleet request {i}")
    assert len(legs(fleet, "D")) == 12
    assert [r for r in orphan.requests() if r["path"] != "/health"] == []
    assert len([r for r in good.requests() if r["path"] == "/v1/completions"]) == 12
    decode_events = fleet.role("D")[0].events()
    assert decode_events["kv_failed"] == []
    assert len(decode_events["kv_ok"]) == 12

    status, body = http_get(fleet.proxy_url + "/ready")
    ready = json.loads(body)
    assert status == 200 and ready["status"] == "ready"
    assert len(ready["orphans"]) == 1
    sentence = ready["orphans"][0]
    assert sentence.startswith(f"prefill {orphan.http_address} (p2p_nccl, tp 4")
    assert sentence.endswith("has no compatible decode: decodes have tp 2")

    pairs = {
        p["prefill"]: p for p in http_json(fleet.proxy_url + "/v1/instances/pairs")["prefills"]
    }
    assert pairs[good.http_address]["compatible"][0]["decodes"] == [fleet.role("D")[0].http_address]
    assert pairs[good.http_address]["compatible"][0]["tp_ratio"] == 1
    assert pairs[orphan.http_address]["compatible"] == []
    assert pairs[orphan.http_address]["incompatible"][0]["mismatch"] == "tp"


def test_an_incompatible_fleet_is_refused_with_reasons(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory(
        [
            WorkerSpec("P", extra_args=geometry("p2p_nccl", 4)),
            WorkerSpec("D", extra_args=geometry("p2p_nccl", 2)),
        ]
    )
    answer = post_json(
        fleet.proxy_url + "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}
    )
    assert answer.status == 503
    message = answer.json()["error"]["message"]
    assert "no decode instance is compatible" in message
    assert "decodes have tp 2" in message
    assert answer.headers.get("retry-after")
    assert (
        metric_value(fleet.proxy_url, "pdproxy_unpaired_requests_total", {"reason": "incompatible"})
        == 1
    )
    assert fleet.completion_requests() == []
    status, body = http_get(fleet.proxy_url + "/ready")
    assert status == 503
    assert "decodes have tp 2" in json.loads(body)["reason"]


def test_nixl_flow_hands_the_prefills_kv_transfer_params_to_decode(
    fleet_factory: FleetFactory,
) -> None:
    hnd = ("--kv-layout", "HND")
    fleet = fleet_factory(
        [
            WorkerSpec("P", extra_args=geometry("nixl", 2, *hnd)),
            WorkerSpec("D", extra_args=geometry("nixl", 4, *hnd)),
        ]
    )
    body = completion(fleet, "a nixl prompt")
    assert len(body["choices"][0]["text"].split()) == 3
    prefill_leg, decode_leg = legs(fleet, "P")[0], legs(fleet, "D")[0]
    sent_to_prefill = prefill_leg["body"]["kv_transfer_params"]
    assert sent_to_prefill == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    handed = decode_leg["body"]["kv_transfer_params"]
    assert handed["do_remote_prefill"] is True
    assert handed["remote_port"] == fleet.role("P")[0].kv_port
    # The tag is still sent on both legs, so logs correlate.
    assert parse_request_id(prefill_leg["headers"]["x-request-id"]) is not None
    assert decode_leg["headers"]["x-request-id"] == prefill_leg["headers"]["x-request-id"]
    events = fleet.role("D")[0].events()
    assert len(events["kv_ok"]) == 1 and events["kv_failed"] == []


def test_nixl_flow_streams(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory(
        [
            WorkerSpec("P", extra_args=geometry("nixl", 1)),
            WorkerSpec("D", extra_args=geometry("nixl", 1)),
        ]
    )
    answer = post_json(
        fleet.proxy_url + "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "stream me"}],
            "max_tokens": 4,
            "stream": True,
        },
    )
    assert answer.status == 200
    assert answer.body.rstrip().endswith(b"data: [DONE]")
    assert "kv_transfer_params" in legs(fleet, "D")[0]["body"]
    assert len(fleet.role("D")[0].events()["kv_ok"]) == 1


def test_a_fleet_may_mix_connector_kinds(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory(
        [
            WorkerSpec("P", extra_args=geometry("nixl", 1)),
            WorkerSpec("P", extra_args=geometry("p2p_nccl", 1)),
            WorkerSpec("D", extra_args=geometry("nixl", 1)),
            WorkerSpec("D", extra_args=geometry("p2p_nccl", 1)),
        ],
        proxy_args=["--prefill-policy", "round_robin", "--decode-policy", "round_robin"],
    )
    for i in range(8):
        completion(fleet, f"mixed kinds {i}")
    nixl_p, nccl_p = fleet.role("P")
    nixl_d, nccl_d = fleet.role("D")
    for prefill, decode, with_params in ((nixl_p, nixl_d, True), (nccl_p, nccl_d, False)):
        p_legs = [r for r in prefill.requests() if r["path"] == "/v1/completions"]
        d_legs = [r for r in decode.requests() if r["path"] == "/v1/completions"]
        assert len(p_legs) == len(d_legs) == 4
        assert all(("kv_transfer_params" in r["body"]) is with_params for r in p_legs + d_legs)
        for record in p_legs:
            tagged = parse_request_id(record["headers"]["x-request-id"])
            assert tagged is not None and str(tagged.decode) == decode.zmq_address
        assert decode.events()["kv_failed"] == []


HEADS_24 = ("--num-kv-heads", "24")


def test_pdproxy_pairs_across_tp_tell_the_prefill_the_decodes_tp(
    fleet_factory: FleetFactory,
) -> None:
    # pdproxy's own connector pairs TP sizes that divide each other, in any layout; the prefill
    # leg says the decode's TP size (the fake decode fails loudly if the prefill was told
    # another), the decode leg carries no kv_transfer_params.
    fleet = fleet_factory(
        [
            WorkerSpec("P", extra_args=geometry("pdproxy", 2, *HEADS_24, "--kv-layout", "NHD")),
            WorkerSpec("D", extra_args=geometry("pdproxy", 4, *HEADS_24)),
            WorkerSpec("D", extra_args=geometry("pdproxy", 3, *HEADS_24)),  # 2 vs 3: never used
        ],
        proxy_args=["--decode-policy", "round_robin"],
    )
    for i in range(6):
        completion(fleet, f"across tp {i}")
    good, orphan = fleet.role("D")
    p_legs = legs(fleet, "P")
    assert len(p_legs) == 6
    for record in p_legs:
        assert record["body"]["kv_transfer_params"] == {"pdproxy": {"decode_tp_size": 4}}
    d_legs = [r for r in good.requests() if r["path"] == "/v1/completions"]
    assert len(d_legs) == 6
    assert all("kv_transfer_params" not in r["body"] for r in d_legs)
    assert len(good.events()["kv_ok"]) == 6 and good.events()["kv_failed"] == []
    assert [r for r in orphan.requests() if r["path"] == "/v1/completions"] == []
    pairs = http_json(fleet.proxy_url + "/v1/instances/pairs")["prefills"]
    [compatible] = pairs[0]["compatible"]
    assert compatible["decodes"] == [good.http_address] and compatible["tp_ratio"] == 2
    assert pairs[0]["incompatible"][0]["mismatch"] == "tp"


def test_short_prompts_skip_prefill_only_where_decode_computes_locally(
    fleet_factory: FleetFactory,
) -> None:
    fleet = fleet_factory(
        [
            WorkerSpec("P", extra_args=geometry("nixl", 1)),
            WorkerSpec("D", extra_args=geometry("nixl", 1)),
        ],
        proxy_args=["--disagg-min-tokens", "20"],
    )
    completion(fleet, "short")  # 2 estimated tokens
    assert legs(fleet, "P") == []
    (direct,) = legs(fleet, "D")
    assert parse_request_id(direct["headers"]["x-request-id"]) is None
    assert "kv_transfer_params" not in direct["body"]
    assert metric_value(fleet.proxy_url, "pdproxy_direct_requests_total") == 1
    completion(fleet, "a much longer prompt " * 10)  # about 53 tokens: disaggregated
    assert len(legs(fleet, "P")) == 1
    assert len(legs(fleet, "D")) == 2
    assert metric_value(fleet.proxy_url, "pdproxy_direct_requests_total") == 1


def test_p2p_nccl_decodes_never_get_a_prompt_without_kv(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory(
        [WorkerSpec("P"), WorkerSpec("D")], proxy_args=["--disagg-min-tokens", "1000"]
    )
    completion(fleet, "short")
    assert len(legs(fleet, "P")) == 1
    assert metric_value(fleet.proxy_url, "pdproxy_direct_requests_total") == 0


def test_prefix_affinity_keeps_a_shared_prefix_on_one_prefill(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory([WorkerSpec("P"), WorkerSpec("P"), WorkerSpec("P"), WorkerSpec("D")])
    system = "You are a careful assistant. " * 60  # far longer than the hashed prefix
    for i in range(9):
        completion(fleet, system + f"user question {i}")
    per_prefill = Counter(
        worker.http_address
        for worker in fleet.role("P")
        for r in worker.requests()
        if r["path"] == "/v1/completions"
    )
    # Sequential requests: no load ever builds up, so the prefix owner takes them all.
    assert list(per_prefill.values()) == [9], per_prefill
    for i in range(60):
        completion(fleet, f"distinct prompt number {i} " * 3)
    spread = Counter(
        worker.http_address
        for worker in fleet.role("P")
        for r in worker.requests()
        if r["path"] == "/v1/completions"
    )
    assert len(spread) == 3, spread


def test_default_policies_are_reported_and_used(fleet_factory: FleetFactory) -> None:
    fleet = fleet_factory([WorkerSpec("P"), WorkerSpec("D")])
    completion(fleet, "hello")
    # Written by the log thread: waited for, boundedly, as the other log checks do.
    log_file = fleet.log_dir / "pdproxy.log"
    wanted = "prefill policy prefix_affinity, decode policy least_kv"
    wait_until(lambda: wanted in log_file.read_text(), 10, "the policies' log line")


def test_a_nixl_prefill_answer_without_kv_transfer_params_is_a_prefill_failure(
    fleet_factory: FleetFactory,
) -> None:
    fleet = fleet_factory(
        [
            WorkerSpec("P", extra_args=geometry("nixl", 1)),
            WorkerSpec("D", extra_args=geometry("nixl", 1)),
        ]
    )
    prefill = fleet.role("P")[0]
    plain_answer = {
        "id": "cmpl-x",
        "object": "text_completion",
        "model": MODEL,
        "choices": [{"index": 0, "text": " a", "finish_reason": "length"}],
    }
    set_behaviour(prefill.url, status=200, error_body=plain_answer)
    answer = post_json(
        fleet.proxy_url + "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}
    )
    assert answer.status == 502
    error = answer.json()["error"]
    assert error["code"] == "prefill_no_kv_transfer_params"
    assert prefill.http_address in error["message"]
    assert legs(fleet, "D") == []  # no decode leg without a KV location
    assert (
        metric_value(
            fleet.proxy_url,
            "pdproxy_upstream_errors_total",
            {"role": "prefill", "reason": "no_kv_transfer_params"},
        )
        == 3  # a misconfigured prefill is retried (here on itself) for the default 3 attempts
    )


def test_a_registration_contradicting_its_models_geometry_is_logged(
    fleet_factory: FleetFactory,
) -> None:
    fleet = fleet_factory(
        [
            WorkerSpec("P", extra_args=geometry("p2p_nccl", 1, "--num-layers", "32")),
            WorkerSpec("D", extra_args=geometry("p2p_nccl", 1, "--num-layers", "40")),
        ]
    )
    log_file = fleet.log_dir / "pdproxy.log"
    # Log lines are written by a thread of their own: wait for the line, boundedly.
    wait_until(lambda: "contradicts" in log_file.read_text(), 10, "the contradiction log line")
    log = log_file.read_text()
    assert "num_layers 40 vs 32" in log or "num_layers 32 vs 40" in log
    # And such a pair is never formed.
    answer = post_json(
        fleet.proxy_url + "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}
    )
    assert answer.status == 503
    assert "layers" in answer.json()["error"]["message"]


def static_geometry(connector: str, tp: int, *more: str) -> tuple[str, ...]:
    """The static-spec keys saying what `geometry(connector, tp, *more)` makes a worker
    announce (the fake worker's defaults for the rest: a geometry known in full is checked,
    a partial one is paired on trust)."""
    return (
        f"connector={connector}",
        f"tp_size={tp}",
        "num_kv_heads=8",
        "block_size=16",
        "num_layers=2",
        "head_dim=32",
        "kv_dtype=float16",
        "is_mla=false",
        "kv_layout=NHD",
        *more,
    )


def test_a_static_fleet_is_paired_by_its_declared_connector_and_geometry(
    fleet_factory: FleetFactory,
) -> None:
    """Nothing announces: the operator's --prefill/--decode specs carry the connector and the
    geometry, and the proxy pairs them by the same rules as announced instances: the p2p_nccl
    prefill of TP 4 is never paired with the TP 2 decode, nixl only with nixl (and with the
    kv_transfer_params flow), and /v1/instances/pairs says the same."""

    def static(role: Literal["P", "D"], connector: str, tp: int) -> WorkerSpec:
        return WorkerSpec(
            role,
            announce="static",
            extra_args=geometry(connector, tp),
            static_keys=static_geometry(connector, tp),
        )

    fleet = fleet_factory(
        [
            static("P", "nixl", 1),
            static("P", "p2p_nccl", 2),
            static("P", "p2p_nccl", 4),
            static("D", "nixl", 1),
            static("D", "p2p_nccl", 2),
        ],
        proxy_args=["--prefill-policy", "round_robin", "--decode-policy", "round_robin"],
    )
    nixl_p, nccl_p, orphan = fleet.role("P")
    nixl_d, nccl_d = fleet.role("D")
    listed = {item["http_address"]: item for item in fleet.instances()}
    assert listed[orphan.http_address]["source"] == "static"
    assert listed[orphan.http_address]["connector"] == "p2p_nccl"
    assert listed[orphan.http_address]["geometry"]["tp_size"] == 4
    for i in range(8):
        completion(fleet, f"static fleet {i}")
    assert [r for r in orphan.requests() if r["path"] != "/health"] == []
    for prefill, decode, with_params in ((nixl_p, nixl_d, True), (nccl_p, nccl_d, False)):
        p_legs = [r for r in prefill.requests() if r["path"] == "/v1/completions"]
        d_legs = [r for r in decode.requests() if r["path"] == "/v1/completions"]
        assert len(p_legs) == len(d_legs) == 4
        assert all(("kv_transfer_params" in r["body"]) is with_params for r in p_legs + d_legs)
        for record in p_legs:
            tagged = parse_request_id(record["headers"]["x-request-id"])
            assert tagged is not None and str(tagged.decode) == decode.zmq_address
        events = decode.events()
        assert events["kv_failed"] == [] and len(events["kv_ok"]) == 4

    pairs = {
        p["prefill"]: p for p in http_json(fleet.proxy_url + "/v1/instances/pairs")["prefills"]
    }
    compatible = {
        prefill: sorted(d for group in item["compatible"] for d in group["decodes"])
        for prefill, item in pairs.items()
    }
    assert compatible == {
        nixl_p.http_address: [nixl_d.http_address],
        nccl_p.http_address: [nccl_d.http_address],
        orphan.http_address: [],
    }
    mismatches = {
        decode: group["mismatch"]
        for group in pairs[orphan.http_address]["incompatible"]
        for decode in group["decodes"]
    }
    assert mismatches[nccl_d.http_address] == "tp"
    assert set(mismatches) == {nccl_d.http_address, nixl_d.http_address}
