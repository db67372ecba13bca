"""vLLM's tokenize, detokenize and version endpoints passed through the proxy, against the
session's real stack (no vLLM started for this): the proxy's answers are the decode
instance's own, byte for byte, errors included."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from tests.harness.vllm_cpu import MODEL_NAME
from tests.vllm.conftest import RealStack

pytestmark = pytest.mark.vllm

PROMPTS = ("The quick brown fox jumps over the lazy dog", "Colourless green ideas sleep")
TIMEOUT_S = 60.0


def exchange(base: str, path: str, payload: Any | None = None) -> tuple[int, str, bytes]:
    """(status, content type, body) of one request; errors are answers too."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(
        base + path, data=data, headers={"Content-Type": "application/json"} if data else {}
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
            return answer.status, answer.headers.get("Content-Type", ""), answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers.get("Content-Type", ""), error.read()


def both(stack: RealStack, path: str, payload: Any | None = None) -> tuple[int, str, bytes]:
    """The proxy's answer, asserted equal to the decode instance's own."""
    through = exchange(stack.proxy.proxy_url, path, payload)
    direct = exchange(stack.decode.url, path, payload)
    assert through == direct, (through, direct)
    return through


def test_tokenize_and_detokenize_through_the_proxy_are_the_decodes_own(
    real_stack: RealStack,
) -> None:
    tokens = []
    for prompt in PROMPTS:
        status, _, body = both(real_stack, "/tokenize", {"model": MODEL_NAME, "prompt": prompt})
        assert status == 200, body
        ids = json.loads(body)["tokens"]
        assert ids and all(isinstance(t, int) for t in ids)
        tokens.append(ids)
        status, _, body = both(real_stack, "/detokenize", {"model": MODEL_NAME, "tokens": ids})
        assert status == 200, body
        assert json.loads(body)["prompt"].strip() == prompt
    assert tokens[0] != tokens[1]  # different prompts really tokenize differently


def test_version_passes_through(real_stack: RealStack) -> None:
    status, content_type, body = both(real_stack, "/version")
    assert status == 200 and content_type.startswith("application/json")
    assert json.loads(body)["version"].startswith("0.32")


def test_vllms_own_error_comes_back_verbatim(real_stack: RealStack) -> None:
    status, content_type, body = both(real_stack, "/tokenize", {"model": MODEL_NAME})
    assert 400 <= status < 500 and content_type.startswith("application/json")
    assert "prompt" in body.decode() or "messages" in body.decode()
