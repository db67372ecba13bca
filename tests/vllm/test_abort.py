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
ATTEMPTS = 3


def _leave_mid_stream(stack: RealStack) -> tuple[str, bool]:
    """Start a long generation through the proxy and leave after its first chunk.

    Returns the request's tag and whether the decode was still generating when the client left:
    on a loaded machine the API server, sharing its core with the engine, may fall so far
    behind that the first chunk arrives after the whole generation ended (vLLM merges what the
    client has not read yet), and then there is nothing left to abort."""
    stream = stack.client().completions.create(
        model=MODEL_NAME,
        prompt="Tell me a very long story",
        max_tokens=LONG,
        stream=True,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    chunk = next(iter(stream))
    tag = chunk.id.removeprefix("cmpl-")
    finished_before = any(
        row["event"] == "finished" for row in stack.records_for(stack.decode, tag)
    )
    stream.close()
    return tag, not finished_before


def test_disconnect_mid_stream_aborts_decode_in_vllm(real_stack: RealStack) -> None:
    decode = real_stack.decode
    for attempt in range(1, ATTEMPTS + 1):
        tag, running = _leave_mid_stream(real_stack)
        left = time.monotonic()
        if running:
            break
        print(f"\nattempt {attempt}: the generation had ended before its first chunk arrived")
    else:
        pytest.fail(f"in {ATTEMPTS} attempts the generation always ended before the client left")

    wait_until(lambda: metric_sum(decode, RUNNING) == 0, 5.0, "vLLM to stop running the request")
    stopped_after = time.monotonic() - left
    finished = real_stack.wait_finished(decode, tag)
    assert "ABORTED" in finished[0]["status"]
    assert 1 <= finished[0]["output_tokens"] < LONG
    # And nothing generates any more.
    generated = metric_sum(decode, GENERATED)
    time.sleep(1.0)
    assert metric_sum(decode, GENERATED) == generated
    print(
        f"\nvLLM aborted {stopped_after:.2f} s after the client left, "
        f"{finished[0]['output_tokens']} of {LONG} tokens generated"
    )
