"""The pure parts of pdproxy's KV connector: transfer keys, frame headers, the receive
buffer, and the scheduler-side plans."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.ids import Address
from pdproxy.vllm_side.kv_buffer import Loss, Transfer, TransferBuffer
from pdproxy.vllm_side.kv_keys import TransferKey, transfer_key
from pdproxy.vllm_side.kv_schedule import ConsumerSchedule, ProducerSchedule, decode_tp_size
from pdproxy.vllm_side.kv_wire import LayerHeader, WireError, decode_header

UID = "0123456789abcdef0123456789abcdef"
TAG = f"___prefill_addr_10.0.0.1:21001___decode_addr_10.0.0.2:22001_{UID}"


# -- keys ------------------------------------------------------------------------------------


def test_prefill_and_decode_engine_ids_give_the_same_key_despite_random_suffixes() -> None:
    on_prefill = transfer_key(f"cmpl-{TAG}-0-1a2b3c4d")
    on_decode = transfer_key(f"cmpl-{TAG}-0-99ff0011")
    assert on_prefill is not None and on_prefill == on_decode
    assert on_prefill.key == f"cmpl-{TAG}-0"
    assert on_prefill.uid == UID and on_prefill.index == "0"
    assert on_prefill.prefill == Address("10.0.0.1", 21001)
    assert on_prefill.decode == Address("10.0.0.2", 22001)
    assert on_prefill.stats_id == f"{UID}-0"


def test_prompts_of_one_batch_get_their_own_keys() -> None:
    first, second = (transfer_key(f"cmpl-{TAG}-{i}-1a2b3c4d") for i in (0, 1))
    assert first is not None and second is not None and first.key != second.key


def test_chat_ids_and_ids_without_a_random_suffix() -> None:
    chat = transfer_key(f"chatcmpl-{TAG}-1a2b3c4d")
    assert chat is not None and chat.key == f"chatcmpl-{TAG}" and chat.index == ""
    plain = transfer_key(f"chatcmpl-{TAG}")  # VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1
    assert plain == chat


def test_external_id_wins_when_vllm_gives_one() -> None:
    key = transfer_key("anything-else", external_id=f"cmpl-{TAG}-0")
    assert key is not None and key.key == f"cmpl-{TAG}-0"


@pytest.mark.parametrize("engine_id", ["cmpl-abc-0-1a2b3c4d", "", f"cmpl-{TAG[:-1]}-0-1a2b3c4d"])
def test_untagged_requests_have_no_key(engine_id: str) -> None:
    assert transfer_key(engine_id) is None


# -- headers ---------------------------------------------------------------------------------


def header(
    key: str = "k", layer: int = 0, layers: int = 2, read: int = 0, reads: int = 1, tokens: int = 3
) -> LayerHeader:
    return LayerHeader(
        key, layer, layers, read, reads, (2, tokens, 2, 4), "float32", (0, 2), "10.0.0.1:21001"
    )


def test_a_header_round_trips() -> None:
    original = header(layer=1, read=0, reads=2)
    assert decode_header(original.encode()) == original
    assert original.payload_bytes == 2 * 3 * 2 * 4 * 4


@pytest.mark.parametrize(
    "frame",
    [b"", b"\xc1", b"\x90", header().encode()[:-3]],
)
def test_garbage_is_refused(frame: bytes) -> None:
    with pytest.raises(WireError):
        decode_header(frame)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_escape_as_anything_but_a_wire_error(frame: bytes) -> None:
    try:
        decoded = decode_header(frame)
    except WireError:
        return
    assert 0 <= decoded.layer < decoded.layers and 0 <= decoded.read < decoded.reads


# -- buffer ----------------------------------------------------------------------------------


def payload(h: LayerHeader) -> bytes:
    return bytes(h.payload_bytes)


def test_a_transfer_is_taken_once_whole() -> None:
    buffer = TransferBuffer(max_bytes=10_000, ttl=5.0)
    first, second = header(layer=0), header(layer=1)
    assert buffer.add(first, payload(first), 0.0) is None
    assert buffer.take("k") is None  # half of it
    buffer.add(second, payload(second), 0.1)
    taken = buffer.take("k")
    assert isinstance(taken, Transfer) and taken.complete and taken.size == 2 * first.payload_bytes
    assert buffer.take("k") is None and buffer.size == 0


def test_unclaimed_transfers_expire_and_the_loss_is_remembered() -> None:
    buffer = TransferBuffer(max_bytes=10_000, ttl=5.0)
    h = header()
    buffer.add(h, payload(h), 0.0)
    assert buffer.expire(4.9) == []
    assert buffer.expire(5.0) == ["k"]
    assert buffer.size == 0 and buffer.take("k") is Loss.EXPIRED
    assert buffer.add(header(layer=1), payload(h), 6.0) is Loss.EXPIRED  # late frames too


def test_a_full_buffer_refuses_the_new_transfer_whole() -> None:
    h = header()
    buffer = TransferBuffer(max_bytes=h.payload_bytes * 2, ttl=5.0)
    buffer.add(header("a", 0), payload(h), 0.0)
    buffer.add(header("a", 1), payload(h), 0.0)
    assert buffer.add(header("b", 0), payload(h), 0.0) is Loss.OVER_CAPACITY
    assert buffer.take("b") is Loss.OVER_CAPACITY
    assert isinstance(buffer.take("a"), Transfer)


def test_frames_that_disagree_lose_the_transfer() -> None:
    buffer = TransferBuffer(max_bytes=10_000, ttl=5.0)
    buffer.add(header(), payload(header()), 0.0)
    assert buffer.add(header(layer=1, layers=3), payload(header()), 0.0) is Loss.INCONSISTENT
    assert buffer.add(header("x"), b"short", 0.0) is Loss.INCONSISTENT
    assert buffer.size == 0


def test_forgotten_keys_drop_what_arrives_later() -> None:
    buffer = TransferBuffer(max_bytes=10_000, ttl=5.0)
    buffer.forget("k")
    assert buffer.add(header(), payload(header()), 0.0) is Loss.EXPIRED and buffer.size == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 2), st.floats(0, 3)), max_size=40))
def test_the_buffer_never_holds_more_than_its_cap(frames: list[tuple[str, int, float]]) -> None:
    h = header()
    buffer = TransferBuffer(max_bytes=h.payload_bytes * 3, ttl=2.0)
    now = 0.0
    for key, layer, step in frames:
        now += step
        buffer.add(header(key, layer, layers=3), payload(h), now)
        buffer.expire(now)
        assert 0 <= buffer.size <= h.payload_bytes * 3


# -- scheduling ------------------------------------------------------------------------------


def key() -> TransferKey:
    found = transfer_key(f"cmpl-{TAG}-0-1a2b3c4d")
    assert found is not None
    return found


def test_a_prefill_sends_once_in_the_step_that_completes_its_prompt() -> None:
    plan = ProducerSchedule()
    plan.arrived("r", key(), prompt_tokens=300)
    assert plan.scheduled("r", [1, 2], True, computed=0, scheduled=256) is None  # chunked
    spec = plan.scheduled("r", [3], False, computed=256, scheduled=44)
    assert spec is not None and spec.block_ids == (1, 2, 3) and spec.num_tokens == 299
    assert plan.scheduled("r", None, False, computed=300, scheduled=1) is None
    plan.finished("r")
    assert len(plan) == 0


def test_the_send_carries_the_decode_tp_the_proxy_gave() -> None:
    plan = ProducerSchedule()
    plan.arrived("r", key(), 10, decode_tp=decode_tp_size({"pdproxy": {"decode_tp_size": 4}}))
    plan.arrived("s", key(), 10)
    told, untold = plan.scheduled("r", [1], True, 0, 10), plan.scheduled("s", [2], True, 0, 10)
    assert told is not None and told.decode_tp == 4
    assert untold is not None and untold.decode_tp is None


@pytest.mark.parametrize(
    ("params", "size"),
    [
        ({"pdproxy": {"decode_tp_size": 2}}, 2),
        ({"pdproxy": {"decode_tp_size": 1024}, "other": 1}, 1024),
        (None, None),
        ({}, None),
        ({"decode_tp_size": 2}, None),  # not under "pdproxy"
        ({"pdproxy": {"decode_tp_size": 0}}, None),
        ({"pdproxy": {"decode_tp_size": 1025}}, None),
        ({"pdproxy": {"decode_tp_size": True}}, None),
        ({"pdproxy": {"decode_tp_size": "2"}}, None),
        ({"pdproxy": {"decode_tp_size": 2.0}}, None),
        ({"pdproxy": [2]}, None),
        ("pdproxy", None),
    ],
)
def test_decode_tp_size_is_read_strictly(params: object, size: int | None) -> None:
    assert decode_tp_size(params) == size


def test_untagged_and_one_token_prompts_are_never_sent() -> None:
    plan = ProducerSchedule()
    plan.arrived("a", None, 100)
    plan.arrived("b", key(), 1)
    assert plan.scheduled("a", [1], True, 0, 100) is None
    assert plan.scheduled("b", [1], True, 0, 1) is None


def test_a_resumed_request_replaces_its_blocks() -> None:
    plan = ProducerSchedule()
    plan.arrived("r", key(), 40)
    plan.scheduled("r", [1], True, 0, 16)
    spec = plan.scheduled("r", [7, 8, 9], True, 0, 40)
    assert spec is not None and spec.block_ids == (7, 8, 9)


def test_a_decode_loads_all_but_the_last_prompt_token_asynchronously() -> None:
    plan = ConsumerSchedule(block_size=16)
    assert plan.matched("r", key(), prompt_tokens=40, computed=0) == 39
    plan.allocated("r", [4, 5, 6], external_tokens=39)
    loads, cancelled = plan.take()
    assert cancelled == [] and len(loads) == 1
    assert loads[0].block_ids == (4, 5, 6) and loads[0].num_tokens == 39
    assert plan.take() == ([], [])
    assert plan.matched("r", key(), 40, 39) == 0  # asked again after its load began


def test_a_local_prefix_hit_is_skipped() -> None:
    plan = ConsumerSchedule(block_size=16)
    assert plan.matched("r", key(), 40, computed=16) == 23
    plan.allocated("r", [4, 5, 6], 23)
    loads, _ = plan.take()
    assert loads[0].skip_tokens == 16


def test_nothing_to_load_computes_locally() -> None:
    plan = ConsumerSchedule(block_size=16)
    assert plan.matched("a", None, 40, 0) == 0
    assert plan.matched("b", key(), 1, 0) == 0
    assert plan.matched("c", key(), 40, 39) == 0
    assert plan.matched("d", key(), 40, 5) == 0  # not block-aligned: would overwrite


def test_asked_again_before_allocation_the_answer_is_fresh() -> None:
    plan = ConsumerSchedule(block_size=16)
    plan.matched("r", key(), 40, 0)
    assert plan.matched("r", key(), 40, 16) == 23
    assert len(plan) == 1


def test_a_request_ending_while_its_load_runs_cancels_it_on_the_workers() -> None:
    plan = ConsumerSchedule(block_size=16)
    plan.matched("r", key(), 40, 0)
    plan.allocated("r", [1, 2, 3], 39)
    plan.take()
    plan.finished("r")
    assert plan.take() == ([], ["r"])
    plan.matched("s", key(), 40, 0)
    plan.finished("s")  # never allocated: nothing reached the workers
    assert plan.take() == ([], [])
