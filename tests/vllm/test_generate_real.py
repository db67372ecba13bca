"""vLLM's token-in/token-out `/inference/v1/generate` disaggregated through the proxy between
two real vLLM servers (pdproxy's own connector; the endpoint needs `--enable-scale-out`): a
greedy answer's token ids are exactly those one vLLM computing everything gives, and the
decode loaded the prompt's KV from the prefill."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdproxy.base.roles import Role
from pdproxy.demo.processes import wait_until
from pdproxy.ids import parse_request_id
from tests.harness.vllm_cpu import MODEL_NAME
from tests.harness.vllm_env import VllmEnv
from tests.vllm.conftest import PairStack, pair_stack

pytestmark = pytest.mark.vllm

GENERATE = "/inference/v1/generate"
TOKENS = 12
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india"]
PROMPTS = (
    "The quick brown fox jumps over the lazy dog again and again",
    " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(150)),  # more than one 128-token block
)
LAYERS, KV_HEADS, HEAD_DIM, FLOAT32 = 2, 2, 32, 4  # the tiny model (tests.harness.tiny_model)
BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * FLOAT32
SCALE_OUT = {"extra_args": ("--enable-scale-out",)}


@pytest.fixture(scope="module")
def stack(
    vllm_env: VllmEnv, vllm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PairStack]:
    with pair_stack(
        vllm_env,
        vllm_model,
        tmp_path_factory.mktemp("generate-real"),
        ("vllm-P-generate", "vllm-D-generate"),
        prefill=SCALE_OUT,
        decode=SCALE_OUT,
    ) as made:
        yield made


def post(url: str, payload: Any) -> tuple[int, Any]:
    request = urllib.request.Request(
        url, json.dumps(payload).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def token_ids(stack: PairStack, prompt: str) -> list[int]:
    status, body = post(f"{stack.decode.url}/tokenize", {"model": MODEL_NAME, "prompt": prompt})
    assert status == 200, body
    ids: list[int] = body["tokens"]
    return ids


def generate_body(ids: list[int]) -> dict[str, Any]:
    sampling = {"max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True, "logprobs": 0}
    return {"model": MODEL_NAME, "token_ids": ids, "sampling_params": sampling}


def generated(answer: dict[str, Any]) -> tuple[list[int], list[float]]:
    (choice,) = answer["choices"]
    logprobs = [item["logprob"] for item in choice["logprobs"]["content"]]
    return choice["token_ids"], logprobs


def transfer_records(stack: PairStack, side: Role, uid: str) -> list[dict[str, Any]]:
    server = stack.prefill if side is Role.PREFILL else stack.decode
    return [
        row
        for row in server.records("transfer")
        if row["side"] == side and row["transfer"].startswith(uid)
    ]


def test_generate_through_the_proxy_equals_one_vllm_and_moves_the_kv(stack: PairStack) -> None:
    answers = []
    for prompt in PROMPTS:
        ids = token_ids(stack, prompt)
        body = generate_body(ids)
        status, through = post(stack.proxy.proxy_url + GENERATE, body)
        assert status == 200, through
        # One vLLM computing the prompt itself: the prefill instance, asked directly.
        status, alone = post(stack.prefill.url + GENERATE, body)
        assert status == 200, alone
        through_ids, through_logprobs = generated(through)
        alone_ids, alone_logprobs = generated(alone)
        assert len(through_ids) == TOKENS
        assert through_ids == alone_ids, (prompt, through_ids, alone_ids)
        # float32 on CPU: the decode computes the last prompt token alone, so the last bits
        # may round differently.
        pairs = zip(through_logprobs, alone_logprobs, strict=True)
        assert all(abs(a - b) <= 1e-3 for a, b in pairs)
        answers.append((through_ids, through_logprobs))

        # The engine's id is generate-tokens-{the proxy's tagged id}: its KV moved.
        tagged = parse_request_id(through["request_id"])
        assert tagged is not None, through["request_id"]
        uid = tagged.uid

        def recorded(uid: str = uid) -> bool:
            return bool(transfer_records(stack, Role.DECODE, uid))

        wait_until(recorded, 10, "the decode's transfer record")
        expected_bytes = (len(ids) - 1) * BYTES_PER_TOKEN
        received = transfer_records(stack, Role.DECODE, uid)
        sent = transfer_records(stack, Role.PREFILL, uid)
        assert [(r["outcome"], r["bytes"]) for r in received] == [("ok", expected_bytes)]
        assert [(r["outcome"], r["bytes"]) for r in sent] == [("ok", expected_bytes)]
    # The equality means something: the two prompts' answers differ.
    assert answers[0] != answers[1]
    assert answers[0][0] != answers[1][0]


def test_a_streamed_generate_gives_the_same_token_ids(stack: PairStack) -> None:
    ids = token_ids(stack, PROMPTS[0])
    body = {**generate_body(ids), "stream": True}
    request = urllib.request.Request(
        stack.proxy.proxy_url + GENERATE,
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        assert answer.headers["Content-Type"].startswith("text/event-stream")
        raw = answer.read()
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    streamed = [t for e in events[:-1] for c in json.loads(e)["choices"] for t in c["token_ids"]]
    status, alone = post(stack.prefill.url + GENERATE, {**body, "stream": False})
    assert status == 200, alone
    assert streamed == generated(alone)[0]


def test_bad_input_is_refused_like_vllm_refuses_it(stack: PairStack) -> None:
    body = {"model": MODEL_NAME, "sampling_params": {"max_tokens": 2}}
    status, through = post(stack.proxy.proxy_url + GENERATE, body)
    status_alone, alone = post(stack.decode.url + GENERATE, body)
    assert status == status_alone == 400, (through, alone)
    assert set(through["error"]) == set(alone["error"])
    for key in ("type", "param", "code"):
        assert through["error"][key] == alone["error"][key], (through, alone)
