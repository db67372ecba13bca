"""The fake worker's KV handoff as a test oracle: the KV carries the prefill's connector and
geometry, a decode refuses what does not fit its own cache (loudly: HTTP 500 and a kv_failed
event), nixl workers follow vLLM's NIXL flow (kv_transfer_params, the decode reads from the
prefill), and pdproxy-connector workers push by tag under nixl's geometry rules. Real processes
over loopback, driven directly over HTTP; no proxy."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgpack
import pytest

from pdproxy.demo.processes import (
    LOOPBACK,
    ManagedProcess,
    free_ports,
    http_json,
    pdproxy_command,
    wait_http_ok,
)
from pdproxy.fake_vllm.config import Geometry
from pdproxy.fake_vllm.deterministic_text import generated_words
from pdproxy.fake_vllm.kv_compat import incompatibility
from pdproxy.fake_vllm.kv_payload import KvPayload
from pdproxy.fake_vllm.kv_wire import (
    MAX_KV_MESSAGE_BYTES,
    Message,
    Pull,
    PullReply,
    Push,
    WireError,
    decode,
    encode,
)
from tests.integration.support import Answer, post_json

UID = "0123456789abcdef0123456789abcdef"
KV_TIMEOUT = "2"  # long enough for a loaded machine, short enough for the timeout test
PROMPT = "check the geometry of the handoff"
MAX_TOKENS = 3
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass
class Fake:
    role: str
    http_port: int
    kv_port: int
    process: ManagedProcess

    @property
    def kv(self) -> str:
        return f"{LOOPBACK}:{self.kv_port}"

    def post(
        self, body: dict[str, Any], request_id: str | None = None, chat: bool = False
    ) -> Answer:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        headers = None if request_id is None else {"X-Request-Id": request_id}
        return post_json(f"http://{LOOPBACK}:{self.http_port}{path}", body, headers=headers)

    def get(self, path: str) -> Any:
        return http_json(f"http://{LOOPBACK}:{self.http_port}{path}")

    def events(self) -> dict[str, list[Any]]:
        events: dict[str, list[Any]] = self.get("/_fake/events")
        return events

    def failures(self) -> list[str]:
        return [f["reason"] for f in self.events()["kv_failed"]]


Starter = Callable[[Sequence[tuple[str, Sequence[str]]]], list[Fake]]


@pytest.fixture
def start_fakes(tmp_path: Path) -> Iterator[Starter]:
    """Start fake workers, each (role, extra flags); all are stopped by PID at teardown."""
    started: list[Fake] = []

    def start(specs: Sequence[tuple[str, Sequence[str]]]) -> list[Fake]:
        ports = iter(free_ports(2 * len(specs)))
        fakes = []
        for role, extra in specs:
            http_port, kv_port = next(ports), next(ports)
            name = f"fake-{role}{len(started)}"
            argv = pdproxy_command(
                "fake-worker",
                *("--role", role, "--port", str(http_port), "--kv-port", str(kv_port)),
                *("--kv-timeout", KV_TIMEOUT),
                *extra,
            )
            fake = Fake(
                role, http_port, kv_port, ManagedProcess(name, argv, tmp_path / f"{name}.log")
            )
            started.append(fake)
            fakes.append(fake)
            fake.process.start()
        procs = [f.process for f in started]
        for fake in fakes:
            wait_http_ok(f"http://{LOOPBACK}:{fake.http_port}/health", 20, procs)
        return fakes

    yield start
    for fake in reversed(started):
        fake.process.stop()


def tagged(prefill: Fake, decode: Fake) -> str:
    return f"___prefill_addr_{prefill.kv}___decode_addr_{decode.kv}_{UID}"


def body(prompt: str = PROMPT, **extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "prompt": prompt, "max_tokens": MAX_TOKENS, **extra}


def expected_text(prompt: str = PROMPT) -> str:
    return "".join(f" {w}" for w in generated_words(prompt, MAX_TOKENS))


def error_message(answer: Answer) -> str:
    message: str = answer.json()["error"]["message"]
    return message


# -- p2p_nccl: push by request id, geometry checked by the decode -----------------------------


def told(decode_tp: int) -> dict[str, Any]:
    """The prefill leg's kv_transfer_params pdproxy sends to a pdproxy-connector prefill."""
    return {"kv_transfer_params": {"pdproxy": {"decode_tp_size": decode_tp}}}


@pytest.mark.parametrize(("p_tp", "d_tp", "layout"), [("2", "4", "NHD"), ("4", "1", "HND")])
def test_pdproxy_connector_pushes_by_tag_across_tp(
    start_fakes: Starter, p_tp: str, d_tp: str, layout: str
) -> None:
    # pdproxy's own connector: the tag's flow; one TP divides the other, any layout; the
    # prefill splits heads for the decode TP the proxy told it.
    prefill, decode = start_fakes(
        [
            ("P", ("--connector", "pdproxy", "--tp-size", p_tp, "--kv-layout", layout)),
            ("D", ("--connector", "pdproxy", "--tp-size", d_tp, "--kv-layout", "HND")),
        ]
    )
    rid = tagged(prefill, decode)
    prefilled = prefill.post(body(max_tokens=1, **told(int(d_tp))), rid)
    assert prefilled.status == 200
    assert "kv_transfer_params" not in prefilled.json()
    answer = decode.post(body(), rid)
    assert answer.status == 200, answer.body
    assert decode.events()["kv_ok"] == [rid]
    untagged = decode.post(body(), None)  # no tag: computed locally (conditional disagg)
    assert untagged.status == 200
    assert len(decode.events()["computed_locally"]) == 1


@pytest.mark.parametrize("params", [told(2), {}], ids=["told_wrong", "not_told"])
def test_pdproxy_prefill_told_the_wrong_decode_tp_fails_loudly(
    start_fakes: Starter, params: dict[str, Any]
) -> None:
    prefill, decode = start_fakes(
        [
            ("P", ("--connector", "pdproxy", "--tp-size", "2")),
            ("D", ("--connector", "pdproxy", "--tp-size", "4")),
        ]
    )
    rid = tagged(prefill, decode)
    assert prefill.post(body(max_tokens=1, **params), rid).status == 200
    answer = decode.post(body(), rid)
    assert answer.status == 500
    assert "split for decode tp 2, this decode has tp 4" in error_message(answer)
    assert decode.failures() == ["decode_tp_mismatch"]


HND_TP2 = ("--tp-size", "2", "--kv-layout", "HND")


def test_p2p_compatible_pair_hands_kv_over(start_fakes: Starter) -> None:
    prefill, decode = start_fakes([("P", HND_TP2), ("D", HND_TP2)])
    rid = tagged(prefill, decode)
    assert prefill.post(body(max_tokens=1), rid).status == 200
    answer = decode.post(body(), rid)
    assert answer.status == 200, answer.body
    assert answer.json()["choices"][0]["text"] == expected_text()
    assert decode.events()["kv_ok"] == [rid]
    assert decode.failures() == []


@pytest.mark.parametrize(
    ("p_flags", "d_flags", "named"),
    [
        (("--tp-size", "2"), ("--tp-size", "4"), "tp_size prefill=2 decode=4"),
        (("--block-size", "16"), ("--block-size", "32"), "block_size prefill=16 decode=32"),
        (("--kv-dtype", "float16"), ("--kv-dtype", "bfloat16"), "kv_dtype prefill='float16'"),
    ],
    ids=["tp", "block_size", "dtype"],
)
def test_p2p_incompatible_pair_fails_loudly(
    start_fakes: Starter, p_flags: tuple[str, ...], d_flags: tuple[str, ...], named: str
) -> None:
    prefill, decode = start_fakes([("P", p_flags), ("D", d_flags)])
    rid = tagged(prefill, decode)
    assert prefill.post(body(max_tokens=1), rid).status == 200
    answer = decode.post(body(), rid)
    assert answer.status == 500
    message = error_message(answer)
    assert named in message and "geometry_mismatch" in message
    assert prefill.kv in message  # which prefill sent the misfit
    failed = decode.events()["kv_failed"]
    assert [(f["request_id"], f["reason"]) for f in failed] == [(rid, "geometry_mismatch")]
    assert named in failed[0]["detail"]
    assert decode.events()["kv_ok"] == []


def test_p2p_workers_ignore_kv_transfer_params(start_fakes: Starter) -> None:
    prefill, decode = start_fakes([("P", ()), ("D", ())])
    rid = tagged(prefill, decode)
    prefilled = prefill.post(body(max_tokens=1, kv_transfer_params=REMOTE_DECODE), rid)
    assert prefilled.status == 200
    assert "kv_transfer_params" not in prefilled.json()  # P2pNcclConnector answers none
    bogus = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1}
    answer = decode.post(body(kv_transfer_params=bogus), rid)
    assert answer.status == 200, answer.body  # it waited for the push, as the tag says
    assert decode.events()["kv_ok"] == [rid]


# -- nixl: kv_transfer_params, the decode reads from the prefill --------------------------------

NIXL = ("--connector", "nixl")


def prefill_leg(prefill: Fake, request_id: str | None = None, **extra: Any) -> dict[str, Any]:
    """The prefill's answer's kv_transfer_params, as vLLM's toy proxy asks for them."""
    leg = body(**{"max_tokens": 1, "stream": False, "kv_transfer_params": REMOTE_DECODE, **extra})
    answer = prefill.post(leg, request_id)
    assert answer.status == 200, answer.body
    params: dict[str, Any] = answer.json()["kv_transfer_params"]
    return params


def test_nixl_flow_end_to_end(start_fakes: Starter) -> None:
    prefill, decode = start_fakes([("P", NIXL), ("D", NIXL)])
    # The proxy may still tag the id for its logs: with nixl it must not cause a push.
    rid = tagged(prefill, decode)
    params = prefill_leg(prefill, rid)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert isinstance(params["remote_engine_id"], str) and params["remote_engine_id"]
    assert params["remote_block_ids"] and all(
        isinstance(b, int) for b in params["remote_block_ids"]
    )
    assert (params["remote_host"], params["remote_port"]) == (LOOPBACK, prefill.kv_port)
    assert params["tp_size"] == 1
    assert isinstance(params["remote_request_id"], str)

    answer = decode.post(body(kv_transfer_params=params), rid)
    assert answer.status == 200, answer.body
    assert answer.json()["choices"][0]["text"] == expected_text()
    d_events, p_events = decode.events(), prefill.events()
    assert d_events["kv_ok"] == [rid] and d_events["kv_failed"] == []
    assert [e["transfer_id"] for e in p_events["kv_held"]] == [params["remote_request_id"]]
    assert [e["requester"] for e in p_events["kv_served"]] == [decode.kv]
    assert p_events["kv_sent"] == [] and d_events["kv_received"] == []  # no push by tag
    assert d_events["computed_locally"] == []


def test_nixl_flow_chat_and_streamed_decode(start_fakes: Starter) -> None:
    prefill, decode = start_fakes([("P", ("--connector", "nixl")), ("D", ("--connector", "nixl"))])
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": PROMPT}]}
    leg = {**chat, "max_tokens": 1, "kv_transfer_params": REMOTE_DECODE}
    prefilled = prefill.post(leg, chat=True)
    assert prefilled.status == 200, prefilled.body
    params = prefilled.json()["kv_transfer_params"]
    answer = decode.post(
        {**chat, "max_tokens": MAX_TOKENS, "stream": True, "kv_transfer_params": params},
        chat=True,
    )
    assert answer.status == 200, answer.body
    assert answer.body.endswith(b"data: [DONE]\n\n")
    assert len(decode.events()["kv_ok"]) == 1


def test_nixl_decode_without_params_computes_locally(start_fakes: Starter) -> None:
    prefill, decode = start_fakes([("P", NIXL), ("D", NIXL)])
    # Tagged but no kv_transfer_params: a short prompt sent straight to the decode.
    rid = tagged(prefill, decode)
    answer = decode.post(body(), rid)
    assert answer.status == 200, answer.body
    assert answer.json()["choices"][0]["text"] == expected_text()
    untagged = decode.post(body())
    assert untagged.status == 200
    events = decode.events()
    first, second = (e["request_id"] for e in events["computed_locally"])
    assert first == rid and second == untagged.json()["id"]
    assert events["kv_ok"] == [] and events["kv_failed"] == []


def changed(params: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**params, **changes}


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (
            lambda p, other: changed(p, remote_request_id="cmpl-nothing-0-00000000"),
            "missing_transfer",
        ),
        (
            lambda p, other: changed(p, remote_block_ids=[b + 1 for b in p["remote_block_ids"]]),
            "block_ids_mismatch",
        ),
        (lambda p, other: changed(p, remote_port=other.kv_port), "engine_id_mismatch"),
        (lambda p, other: changed(p, remote_engine_id="someone-else"), "engine_id_mismatch"),
        (lambda p, other: changed(p, remote_block_ids=None), "bad_params"),
    ],
    ids=["transfer", "blocks", "other_prefill", "engine_id", "no_blocks"],
)
def test_nixl_decode_refuses_params_of_another_transfer(
    start_fakes: Starter, mutate: Callable[[dict[str, Any], Fake], dict[str, Any]], reason: str
) -> None:
    prefill, other, decode = start_fakes([("P", NIXL), ("P", NIXL), ("D", NIXL)])
    params = prefill_leg(prefill)
    answer = decode.post(body(kv_transfer_params=mutate(params, other)))
    assert answer.status == 500
    assert reason in error_message(answer)
    assert decode.failures() == [reason]


def test_nixl_decode_refuses_kv_for_another_prompt_and_a_second_read(start_fakes: Starter) -> None:
    prefill, decode = start_fakes([("P", NIXL), ("D", NIXL)])
    params = prefill_leg(prefill, prompt="some other prompt")
    wrong = decode.post(body(kv_transfer_params=params))
    assert wrong.status == 500
    assert "different prompt" in error_message(wrong)
    # The prefill let go of the blocks once read, as vLLM's does: a retry finds nothing.
    again = decode.post(body(prompt="some other prompt", kv_transfer_params=params))
    assert again.status == 500
    assert decode.failures() == ["payload_mismatch", "missing_transfer"]
    assert prefill.failures() == ["missing_transfer"]


def test_nixl_decode_gives_up_on_a_silent_prefill_within_its_bound(start_fakes: Starter) -> None:
    prefill, decode = start_fakes([("P", NIXL), ("D", NIXL)])
    params = prefill_leg(prefill)
    nobody = free_ports(1)[0]
    answer = decode.post(body(kv_transfer_params=changed(params, remote_port=nobody)))
    assert answer.status == 500
    assert f"{LOOPBACK}:{nobody}" in error_message(answer)
    assert decode.failures() == ["timeout"]


def test_nixl_workers_refuse_the_wrong_leg(start_fakes: Starter) -> None:
    prefill, decode = start_fakes([("P", NIXL), ("D", NIXL)])
    params = prefill_leg(prefill)
    assert decode.post(body(kv_transfer_params=REMOTE_DECODE)).status == 500
    assert prefill.post(body(kv_transfer_params=params)).status == 500
    assert decode.failures() == ["wrong_role"] and prefill.failures() == ["wrong_role"]


def test_nixl_heterogeneous_tp_pair_passes(start_fakes: Starter) -> None:
    p_flags = (*NIXL, "--tp-size", "2", "--kv-layout", "HND", "--block-size", "16")
    d_flags = (*NIXL, "--tp-size", "4", "--kv-layout", "HND", "--block-size", "32")
    prefill, decode = start_fakes([("P", p_flags), ("D", d_flags)])
    params = prefill_leg(prefill)
    assert params["tp_size"] == 2
    answer = decode.post(body(kv_transfer_params=params))
    assert answer.status == 200, answer.body
    assert decode.failures() == []


def test_nixl_larger_prefill_tp_with_other_block_size_fails(start_fakes: Starter) -> None:
    p_flags = (*NIXL, "--tp-size", "4", "--kv-layout", "HND", "--block-size", "16")
    d_flags = (*NIXL, "--tp-size", "2", "--kv-layout", "HND", "--block-size", "32")
    prefill, decode = start_fakes([("P", p_flags), ("D", d_flags)])
    answer = decode.post(body(kv_transfer_params=prefill_leg(prefill)))
    assert answer.status == 500
    assert "block_size prefill=16 decode=32" in error_message(answer)
    assert decode.failures() == ["geometry_mismatch"]


# -- the oracle's rules and the wire format, without processes -----------------------------

BASE = Geometry(tp_size=2, block_size=16, kv_layout="HND")


@pytest.mark.parametrize(
    ("connector", "prefill", "decode", "broken"),
    [
        ("p2p_nccl", BASE, BASE, None),
        ("p2p_nccl", BASE, replace(BASE, tp_size=4), "tp_size"),
        ("p2p_nccl", BASE, replace(BASE, kv_layout="NHD"), "kv_layout"),
        ("nixl", BASE, replace(BASE, tp_size=4, block_size=32), None),
        ("nixl", BASE, replace(BASE, tp_size=3), "tp_size"),
        ("nixl", BASE, replace(BASE, block_size=24), "block_size"),
        ("nixl", replace(BASE, block_size=32), BASE, "block_size"),
        ("nixl", replace(BASE, tp_size=4), BASE, None),
        ("nixl", replace(BASE, tp_size=4), replace(BASE, block_size=32), "block_size"),
        ("nixl", replace(BASE, kv_layout="NHD"), replace(BASE, kv_layout="NHD", tp_size=4), "HND"),
        ("nixl", BASE, replace(BASE, kv_layout="NHD"), "kv_layout"),
        ("nixl", BASE, replace(BASE, num_kv_heads=4), "num_kv_heads"),
        ("pdproxy", BASE, replace(BASE, head_dim=64), "head_dim"),
        ("nixl", BASE, replace(BASE, is_mla=True), "is_mla"),
        (
            "nixl",
            replace(BASE, is_mla=True, tp_size=4, kv_layout="NHD"),
            replace(BASE, is_mla=True, block_size=32),
            None,
        ),
    ],
)
def test_compatibility_rules(
    connector: str, prefill: Geometry, decode: Geometry, broken: str | None
) -> None:
    problem = incompatibility(connector, prefill, connector, decode)
    if broken is None:
        assert problem is None
    else:
        assert problem is not None and broken in problem


def test_connectors_must_match() -> None:
    problem = incompatibility("nixl", BASE, "pdproxy", BASE)
    assert problem == "connector prefill='nixl' decode='pdproxy'"


def test_wire_round_trip_and_refusals() -> None:
    payload = KvPayload(bytes(32), "nixl", BASE)
    messages: list[Message] = [
        Push("rid", "127.0.0.1:1", payload),
        Pull("t", "e", (1, 2), "127.0.0.1:2"),
        PullReply("t", "e", payload, None),
        PullReply("t", "e", None, "missing_transfer"),
    ]
    for message in messages:
        assert decode(encode(message)) == message
    for frame in (
        b"\xc1",
        msgpack.packb({"v": 2, "op": "push"}),
        msgpack.packb({"v": 1, "op": "pull", "transfer_id": "t"}),
        msgpack.packb({"v": 1, "op": "pull_reply", "transfer_id": "t", "engine_id": "e"}),
        bytes(MAX_KV_MESSAGE_BYTES + 1),
    ):
        with pytest.raises(WireError):
            decode(frame)
    with pytest.raises(WireError):
        encode(Pull("t", "e", tuple(range(MAX_KV_MESSAGE_BYTES)), "x"))
