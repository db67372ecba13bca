"""A client that goes away mid-stream makes real vLLM abort the decode request."""

from __future__ import annotations

import time

import pytest

from pdproxy.demo.processes import wait_until
from tests.harness.vllm_cpu import MAX_MODEL_LEN, MODEL_NAME
from tests.vllm.conftest import RealStack, metric_sum

pytestmark = pytest.mark.vllm

LONG = MAX_MODEL_LEN - 100  # several seconds of generation on this machine
RUNNING = "vllm:num_requests_running"
GENERATED = "vllm:generation_tokens_total"


def test_disconnect_mid_stream_aborts_decode_in_vllm(real_stack: RealStack) -> None:
    decode = real_stack.decode
    stream = real_stack.client().completions.create(
        model=MODEL_NAME,
        prompt="Tell me a very long story",
        max_tokens=LONG,
        stream=True,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    tag = ""
    for received, chunk in enumerate(stream, start=1):
        tag = chunk.id.removeprefix("cmpl-")
        if received == 5:
            break
    # The client leaves right after its fifth chunk. (It used to wait first for vLLM's running
    # gauge, which may trail the first chunks: in one CI run that wait outlasted the whole
    # generation, and the request finished before anyone left. ABORTED below shows the request
    # was still running when the abort reached it.)
    stream.close()
    left = time.monotonic()

    wait_until(lambda: metric_sum(decode, RUNNING) == 0, 5.0, "vLLM to stop running the request")
    stopped_after = time.monotonic() - left
    finished = real_stack.wait_finished(decode, tag)
    assert "ABORTED" in finished[0]["status"]
    assert 5 <= finished[0]["output_tokens"] < LONG
    # And nothing generates any more.
    generated = metric_sum(decode, GENERATED)
    time.sleep(1.0)
    assert metric_sum(decode, GENERATED) == generated
    print(
        f"\nvLLM aborted {stopped_after:.2f} s after the client left, "
        f"{finished[0]['output_tokens']} of {LONG} tokens generated"
    )
