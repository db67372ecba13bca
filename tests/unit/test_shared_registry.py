"""The registry process's side of `--workers` without sockets: what it publishes, how the
operator's changes move the revision, and the frames between the processes."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from pdproxy.base.roles import Role
from pdproxy.config import Settings
from pdproxy.ids import Address
from pdproxy.metrics import Metrics
from pdproxy.multiworker.hub import REPUBLISH_SECONDS, RegistryHub
from pdproxy.multiworker.shared_state import SharedState, decode, encode
from pdproxy.registry.operator import ControlReply, ControlRequest, Operation
from pdproxy.registry.table import LOAD_REFRESH_SECONDS, Instance, Source

DECODE = Address("10.0.0.2", 8200)
PREFILL = Address("10.0.0.1", 8100)
STATIC_DECODE = "http=10.0.0.2:8200,zmq=10.0.0.2:21001"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def admin_path(tmp_path: Path) -> str:
    return str(tmp_path / "admin-state")


def hub(admin_path: str, **options: object) -> RegistryHub:
    settings = Settings(**options)
    return RegistryHub(
        settings,
        "ipc://unused-a",
        "ipc://unused-b",
        "ipc://unused-c",
        admin_path,
        Metrics(),
        Clock(),
    )


def static(address: Address, role: Role = Role.DECODE) -> Instance:
    return Instance(role, address, Address(address.host, 21001), Source.STATIC)


def test_static_instances_are_in_the_first_state(admin_path: str) -> None:
    h = hub(admin_path, decode=[STATIC_DECODE])
    state = h.state()
    assert state.revision == 100 * 10**9 + 1  # counted on from the clock (100 s here)
    assert [e.instance.http_address for e in state.entries] == [DECODE]
    assert state.drained == frozenset()


def test_the_revision_moves_only_with_the_content(admin_path: str) -> None:
    h = hub(admin_path)
    first = h.state().revision
    assert h.state().revision == first  # nothing changed: republishing keeps it
    h.registry.handle([b"w", _announce(PREFILL)])
    second = h.state().revision
    assert second == first + 1
    h.registry.handle([b"w", _announce(PREFILL)])  # a heartbeat
    assert h.state().revision == second


def test_a_registry_started_again_counts_on_from_higher_revisions(admin_path: str) -> None:
    clock = Clock()
    first = RegistryHub(Settings(), "ipc://a", "ipc://b", "ipc://c", admin_path, Metrics(), clock)
    for _ in range(1000):
        first.control(ControlRequest(Operation.REGISTER, instance=static(DECODE)))
        first.control(ControlRequest(Operation.REMOVE, address=DECODE))
    clock.now += 0.001  # a millisecond later, after a crash
    again = RegistryHub(
        Settings(), "ipc://a", "ipc://b", "ipc://c", admin_path, Metrics(), clock, True
    )
    assert again.state().revision > first.state().revision


def test_what_an_operator_said_survives_a_restart(admin_path: str) -> None:
    clock = Clock()
    first = RegistryHub(Settings(), "ipc://a", "ipc://b", "ipc://c", admin_path, Metrics(), clock)
    assert first.control(ControlRequest(Operation.REGISTER, instance=static(DECODE)))
    assert first.control(ControlRequest(Operation.REGISTER, instance=static(PREFILL)))
    assert first.control(ControlRequest(Operation.DRAIN, address=DECODE))
    assert first.control(ControlRequest(Operation.REMOVE, address=PREFILL))
    again = RegistryHub(
        Settings(), "ipc://a", "ipc://b", "ipc://c", admin_path, Metrics(), clock, True
    )
    state = again.state()
    assert [e.instance.http_address for e in state.entries] == [DECODE]
    assert state.drained == {str(DECODE)}


def test_a_restarted_registry_holds_back_for_one_ttl(admin_path: str) -> None:
    clock = Clock()
    h = RegistryHub(
        Settings(ttl=4), "ipc://a", "ipc://b", "ipc://c", admin_path, Metrics(), clock, True
    )
    reply = h.control(ControlRequest(Operation.DRAIN, address=DECODE))
    assert reply is not None and not reply.done and reply.unavailable is not None
    assert "try again in 4s" in reply.unavailable
    assert not h.due(clock.now + 3.9)  # the workers keep routing on their copy
    assert h.due(clock.now + 4.0)


def test_publications_follow_changes_loads_and_a_heartbeat(admin_path: str) -> None:
    h = hub(admin_path)
    now = 100.0
    assert h.due(now)  # nothing published yet
    h.published(now)
    assert not h.due(now + 1.0)
    assert h.due(now + REPUBLISH_SECONDS)  # the heartbeat, for late subscribers
    h.registry.handle([b"w", _announce(PREFILL, running=1)])
    assert h.due(now + 0.05)  # membership: at once
    h.published(now + 0.05)
    h.registry.handle([b"w", _announce(PREFILL, running=3)])
    assert not h.due(now + 0.1)  # a load change waits its turn
    assert h.due(now + 0.05 + LOAD_REFRESH_SECONDS)


def test_a_request_that_arrives_too_late_is_never_applied(admin_path: str) -> None:
    h = hub(admin_path)
    late = ControlRequest(Operation.REGISTER, instance=static(DECODE), expires_at=99.0)
    assert h.control(late) is None
    assert h.state().entries == ()


def test_operator_changes_reply_with_the_revision_that_shows_them(admin_path: str) -> None:
    h = hub(admin_path)
    start = h.state().revision
    reply = h.control(ControlRequest(Operation.REGISTER, instance=static(DECODE)))
    assert reply == ControlReply(True, start + 1, None)
    assert [e.instance.http_address for e in h.state().entries] == [DECODE]
    drained = h.control(ControlRequest(Operation.DRAIN, address=DECODE))
    assert drained is not None and drained.done and drained.revision == start + 2
    assert h.state().drained == {str(DECODE)}
    # Removing a drained instance undrains it too (its name may come back later).
    removed = h.control(ControlRequest(Operation.REMOVE, address=DECODE))
    assert (
        removed is not None
        and removed.done
        and h.state().entries == ()
        and h.state().drained == frozenset()
    )


@pytest.mark.parametrize("operation", [Operation.REMOVE, Operation.DRAIN, Operation.UNDRAIN])
def test_nothing_to_do_is_not_done_and_keeps_the_revision(
    operation: Operation, admin_path: str
) -> None:
    h = hub(admin_path)
    start = h.state().revision
    reply = h.control(ControlRequest(operation, address=DECODE))
    assert reply == ControlReply(False, start, None)


def test_a_full_registry_refuses_a_registration(admin_path: str) -> None:
    h = hub(admin_path, max_instances=1, decode=[STATIC_DECODE])
    reply = h.control(ControlRequest(Operation.REGISTER, instance=static(PREFILL, Role.PREFILL)))
    assert reply is not None and not reply.done
    assert reply.refusal is not None and "full" in reply.refusal


def test_frames_round_trip_and_are_checked_for_their_kind(admin_path: str) -> None:
    state = hub(admin_path, decode=[STATIC_DECODE]).state()
    assert decode(encode(state), SharedState) == state
    request = ControlRequest(Operation.DRAIN, address=DECODE)
    assert decode(encode(request), ControlRequest) == request
    with pytest.raises(TypeError, match="expected ControlReply"):
        decode(encode(request), ControlReply)


def _announce(address: Address, running: int | None = None) -> bytes:
    """An announcement of a prefill: stock vLLM's v0, or v1 with a load."""
    message: dict[str, object] = {
        "type": "P",
        "http_address": str(address),
        "zmq_address": f"{address.host}:21001",
    }
    if running is not None:
        message |= {"v": 1, "op": "announce", "load": {"running": running}}
    packed: bytes = msgpack.packb(message)
    return packed
