"""One wire schema: whatever the registry's typed messages hold, `to_map` writes a map that
`parse_message` reads back as the same message (and msgpack carries it unchanged)."""

from __future__ import annotations

import json
import subprocess
import sys

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.base.roles import Role
from pdproxy.ids import Address
from pdproxy.registry.messages import (
    MAX_MODEL_LEN,
    MAX_TP_SIZE,
    MAX_TRANSFER_COUNT,
    MAX_TRANSFERS,
    REQUIRED_COORDINATES,
    Announcement,
    Connector,
    Geometry,
    KvCoordinates,
    Leave,
    Message,
    Stats,
    TransferOutcome,
    TransferReport,
    decode_frame,
    parse_message,
    to_map,
)
from tests.unit.test_worker_messages import GEOMETRIES, LOADS

addresses = st.builds(
    Address,
    st.sampled_from(["10.0.0.5", "worker-1.svc", "127.0.0.1", "decode-3.pd.svc.cluster.local"]),
    st.integers(1, 65535),
)


full_coordinates = st.builds(
    KvCoordinates,
    bootstrap=addresses,
    engine_id=st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=128),
    side_channel=addresses,
)
# Any coordinates, or none: a prefill that must announce them always does.
coordinates = st.none() | full_coordinates | st.builds(KvCoordinates, bootstrap=addresses)


@st.composite
def v1_announcements(draw: st.DrawFn) -> Announcement:
    role = draw(st.sampled_from(Role))
    connector = draw(st.none() | st.sampled_from(Connector))
    needs = role is Role.PREFILL and connector in REQUIRED_COORDINATES
    return Announcement(
        version=1,
        role=role,
        http_address=draw(addresses),
        zmq_address=draw(addresses),
        model=draw(st.none() | st.text(min_size=1, max_size=256)),
        connector=connector,
        geometry=draw(st.none() | GEOMETRIES),
        load=draw(st.none() | LOADS),
        healthy=draw(st.booleans()),
        max_model_len=draw(st.none() | st.integers(1, MAX_MODEL_LEN)),
        coordinates=draw(full_coordinates if needs else coordinates),
    )


# Stock vLLM's message carries only these three fields.
v0_announcements = st.builds(Announcement, st.just(0), st.sampled_from(Role), addresses, addresses)
transfers = st.builds(
    TransferReport,
    transfer_id=st.from_regex(r"[0-9a-f]{32}-[A-Za-z0-9_.-]{0,63}", fullmatch=True),
    peer=addresses,
    bytes=st.integers(0, MAX_TRANSFER_COUNT),
    blocks=st.integers(0, MAX_TRANSFER_COUNT),
    seconds=st.floats(0.0, 1e9),
    outcome=st.sampled_from(TransferOutcome),
)


@st.composite
def stats(draw: st.DrawFn) -> Stats:
    ranks = draw(st.integers(1, MAX_TP_SIZE))
    return Stats(
        role=draw(st.sampled_from(Role)),
        http_address=draw(addresses),
        rank=draw(st.integers(0, ranks - 1)),
        ranks=ranks,
        transfers=tuple(draw(st.lists(transfers, max_size=MAX_TRANSFERS // 16))),
    )


messages = v1_announcements() | v0_announcements | st.builds(Leave, addresses) | stats()


@settings(derandomize=True, database=None, deadline=None, max_examples=400)
@given(message=messages)
def test_every_message_round_trips(message: Message) -> None:
    wire = to_map(message)
    assert parse_message(wire) == message
    assert decode_frame(msgpack.packb(wire)) == message


def test_the_role_travels_as_its_wire_letter() -> None:
    http, zmq = Address("10.0.0.5", 8100), Address("10.0.0.5", 21001)
    assert to_map(Announcement(0, Role.PREFILL, http, zmq)) == {
        "type": "P",
        "http_address": "10.0.0.5:8100",
        "zmq_address": "10.0.0.5:21001",
    }
    assert to_map(Announcement(1, Role.DECODE, http, zmq))["type"] == "D"


def test_unknown_and_default_fields_stay_off_the_wire() -> None:
    http, zmq = Address("10.0.0.5", 8100), Address("10.0.0.5", 21001)
    announcement = Announcement(1, Role.DECODE, http, zmq, geometry=Geometry(tp_size=2))
    assert to_map(announcement) == {
        "v": 1,
        "op": "announce",
        "type": "D",
        "http_address": "10.0.0.5:8100",
        "zmq_address": "10.0.0.5:21001",
        "geometry": {"tp_size": 2},
    }


def test_the_wire_module_loads_nothing_heavy() -> None:
    """The vLLM side loads the schema inside vLLM: only msgpack and pdproxy's base types."""
    probe = (
        "import sys, json, pdproxy.registry.messages; "
        "print(json.dumps(sorted(m.split('.')[0] if not m.startswith('pdproxy') else m "
        "for m in sys.modules)))"
    )
    before = _modules("import sys, json; print(json.dumps(sorted(sys.modules)))")
    loaded = set(_modules(probe)) - {m.split(".")[0] for m in before} - set(before)
    assert {m for m in loaded if m.startswith("pdproxy")} == {
        "pdproxy",
        "pdproxy.base",
        "pdproxy.base.roles",
        "pdproxy.ids",
        "pdproxy.registry",
        "pdproxy.registry.messages",
    }
    assert loaded.isdisjoint({"starlette", "httpx", "pydantic", "prometheus_client", "zmq"})


def _modules(code: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    return list(json.loads(done.stdout))
