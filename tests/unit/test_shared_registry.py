"""The registry process's side of `--workers` without sockets: what it publishes, how the
operator's changes move the revision, and the frames between the processes."""

from __future__ import annotations

import msgpack
import pytest

from pdproxy.config import Settings
from pdproxy.ids import Address
from pdproxy.metrics import Metrics
from pdproxy.registry.hub import RegistryHub
from pdproxy.registry.messages import Role
from pdproxy.registry.shared_state import (
    ControlReply,
    ControlRequest,
    Operation,
    SharedState,
    decode,
    encode,
)
from pdproxy.registry.table import Instance, Source

DECODE = Address("10.0.0.2", 8200)
PREFILL = Address("10.0.0.1", 8100)
STATIC_DECODE = "http=10.0.0.2:8200,zmq=10.0.0.2:21001"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def hub(**options: object) -> RegistryHub:
    settings = Settings(**options)
    return RegistryHub(settings, "ipc://unused-a", "ipc://unused-b", Metrics(), Clock())


def static(address: Address, role: Role = Role.DECODE) -> Instance:
    return Instance(role, address, Address(address.host, 21001), Source.STATIC)


def test_static_instances_are_in_the_first_state() -> None:
    h = hub(decode=[STATIC_DECODE])
    state = h.state()
    assert state.revision == 100 * 10**9 + 1  # counted on from the clock (100 s here)
    assert [e.instance.http_address for e in state.entries] == [DECODE]
    assert state.drained == frozenset()


def test_the_revision_moves_only_with_the_content() -> None:
    h = hub()
    first = h.state().revision
    assert h.state().revision == first  # nothing changed: republishing keeps it
    h.registry.handle([b"w", _announce(PREFILL)])
    second = h.state().revision
    assert second == first + 1
    h.registry.handle([b"w", _announce(PREFILL)])  # a heartbeat
    assert h.state().revision == second


def test_a_registry_started_again_counts_on_from_higher_revisions() -> None:
    clock = Clock()
    first = RegistryHub(Settings(), "ipc://a", "ipc://b", Metrics(), clock)
    for _ in range(1000):
        first.control(ControlRequest(Operation.REGISTER, instance=static(DECODE)))
        first.control(ControlRequest(Operation.REMOVE, address=DECODE))
    clock.now += 0.001  # a millisecond later, after a crash
    again = RegistryHub(Settings(), "ipc://a", "ipc://b", Metrics(), clock, restarted=True)
    assert again.state().revision > first.state().revision


def test_operator_changes_reply_with_the_revision_that_shows_them() -> None:
    h = hub()
    start = h.state().revision
    reply = h.control(ControlRequest(Operation.REGISTER, instance=static(DECODE)))
    assert reply == ControlReply(True, start + 1, None)
    assert [e.instance.http_address for e in h.state().entries] == [DECODE]
    drained = h.control(ControlRequest(Operation.DRAIN, address=DECODE))
    assert drained.done and drained.revision == start + 2
    assert h.state().drained == {str(DECODE)}
    # Removing a drained instance undrains it too (its name may come back later).
    removed = h.control(ControlRequest(Operation.REMOVE, address=DECODE))
    assert removed.done and h.state().entries == () and h.state().drained == frozenset()


@pytest.mark.parametrize("operation", [Operation.REMOVE, Operation.DRAIN, Operation.UNDRAIN])
def test_nothing_to_do_is_not_done_and_keeps_the_revision(operation: Operation) -> None:
    h = hub()
    start = h.state().revision
    reply = h.control(ControlRequest(operation, address=DECODE))
    assert reply == ControlReply(False, start, None)


def test_a_full_registry_refuses_a_registration() -> None:
    h = hub(max_instances=1, decode=[STATIC_DECODE])
    reply = h.control(ControlRequest(Operation.REGISTER, instance=static(PREFILL, Role.PREFILL)))
    assert not reply.done and reply.refusal is not None and "full" in reply.refusal


def test_frames_round_trip_and_are_checked_for_their_kind() -> None:
    state = hub(decode=[STATIC_DECODE]).state()
    assert decode(encode(state), SharedState) == state
    request = ControlRequest(Operation.DRAIN, address=DECODE)
    assert decode(encode(request), ControlRequest) == request
    with pytest.raises(TypeError, match="expected ControlReply"):
        decode(encode(request), ControlReply)


def _announce(address: Address) -> bytes:
    """A v0 announcement of a prefill, as stock vLLM sends it."""
    v0 = {"type": "P", "http_address": str(address), "zmq_address": f"{address.host}:21001"}
    packed: bytes = msgpack.packb(v0)
    return packed
