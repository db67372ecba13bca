"""Registry fuzzing through a live `pdproxy serve`, over real ZMQ DEALER sockets on loopback.

100,000 messages (random bytes of every length up to and past the size limit, garbled msgpack,
msgpack of every wrong shape, multi-frame messages, near-valid v0/v1 maps with one hostile
field each) are sent from a seeded generator while a few legitimate workers keep announcing
and a thread polls the HTTP side. The registry must stay up, register exactly the legitimate
workers with exactly what they said, keep answering HTTP promptly, and count every message
once under the reason the pure decoder gives it.

With a registry secret, thousands each of forged, replayed, stale, unsigned, v0 and
out-of-network messages mixed with signed announcements are refused and counted by reason.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import msgpack
import pytest
import yaml
import zmq

from pdproxy.demo.fleet import LocalFleet
from pdproxy.demo.processes import http_get, wait_until
from pdproxy.registry.auth import new_nonce, signed
from pdproxy.registry.messages import Reason, Rejected, decode_frame
from tests.conftest import FleetFactory
from tests.integration.support import metric_value

ACCEPTED = "ok"  # the reason label of accepted messages
MESSAGES = 100_000
BATCH = 5_000
LEGIT_EVERY = 100  # one legitimate announcement per this many fuzz messages
OVERSIZED = 20  # frames past the size limit: ZMQ drops them (and their connection) uncounted
MAX_MESSAGE_BYTES = 65536  # passed explicitly so the generator knows the limit
FUZZ_SOCKETS = 16
SEND_TIMEOUT_MS = 10_000  # a send that blocks this long fails the test instead of hanging
DRAIN_TIMEOUT_S = 60.0
HEALTH_BOUND_S = 2.0  # "never stalls": a behaviour bound, not a performance target
PROBE_TIMEOUT_S = 5.0
PROBE_PATHS = ("/health", "/v1/instances", "/ready", "/v1/instances/pairs")
SEED = 20_240_607

MODEL = "fuzz-model"
# Geometry the legitimate workers announce. A near-valid decode carrying it with one field
# blown up pairs with the legitimate prefill if the registry lets it in, so planning (/ready,
# /v1/instances/pairs) would feel it.
GEOMETRY = MappingProxyType(
    {
        "tp_size": 1,
        "block_size": 16,
        "num_layers": 2,
        "num_kv_heads": 8,
        "head_dim": 64,
        "kv_dtype": "bfloat16",
        "is_mla": False,
        "kv_layout": "HND",
    }
)

Parts = tuple[bytes, ...]
ZmqContext = zmq.Context[zmq.Socket[bytes]]


def pack(value: object) -> bytes:
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


def expected_label(parts: Sequence[bytes]) -> str:
    """The label the registry must count a message under, without a secret: what the pure
    decoder says of its one payload frame (FRAMING for any other number of frames)."""
    if len(parts) != 1:
        return Reason.FRAMING.value
    try:
        decode_frame(parts[0])
    except Rejected as exc:
        return exc.reason.value
    return ACCEPTED


# -- sockets ----------------------------------------------------------------------------------


@pytest.fixture
def zmq_context() -> Iterator[ZmqContext]:
    context: ZmqContext = zmq.Context()
    yield context
    context.destroy(linger=0)


def dealer(context: ZmqContext, fleet: LocalFleet, identity: bytes | None) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = context.socket(zmq.DEALER)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    sock.connect(f"tcp://{fleet.registry_address}")
    return sock


def send(sock: zmq.Socket[bytes], parts: Parts) -> None:
    if len(parts) == 1:
        sock.send(parts[0])
    else:
        sock.send_multipart(list(parts))


# -- the HTTP side, watched from a thread -----------------------------------------------------


@dataclass
class HttpProbe:
    """Polls the proxy's HTTP endpoints until stopped; records every answer and its latency,
    and any instance listed that is not one of the legitimate workers."""

    url: str
    legit: frozenset[str]
    stop: threading.Event = field(default_factory=threading.Event)
    samples: list[tuple[str, int, float]] = field(default_factory=list)
    foreign: set[str] = field(default_factory=set)

    def run(self) -> None:
        while not self.stop.is_set():
            for path in PROBE_PATHS:
                started = time.monotonic()
                status, body = http_get(self.url + path, timeout=PROBE_TIMEOUT_S)
                self.samples.append((path, status, time.monotonic() - started))
                if path == "/v1/instances" and status == 200:
                    self.check_listing(body)
            self.stop.wait(0.02)

    def check_listing(self, body: bytes) -> None:
        try:
            listed = {item["http_address"] for item in json.loads(body)["instances"]}
        except (ValueError, KeyError, TypeError):
            # Recorded as a failed answer: an exception would end the thread unseen.
            self.samples.append(("/v1/instances (unreadable)", -1, 0.0))
            return
        self.foreign |= listed - self.legit

    def latencies(self, path: str) -> list[float]:
        return [latency for p, _, latency in self.samples if p == path]

    def failures(self) -> list[tuple[str, int, float]]:
        """Answers that were no answer, a server error, or slower than the bound (/ready may
        say 503 while the legitimate fleet is still registering: that is an answer)."""
        return [
            (path, status, latency)
            for path, status, latency in self.samples
            if status not in (200, 503)
            or (status == 503 and path != "/ready")
            or latency > HEALTH_BOUND_S
        ]


@contextlib.contextmanager
def probing(fleet: LocalFleet, legit: Sequence[str]) -> Iterator[HttpProbe]:
    probe = HttpProbe(fleet.proxy_url, frozenset(legit))
    thread = threading.Thread(target=probe.run, name="http-probe", daemon=True)
    thread.start()
    try:
        yield probe
    finally:
        probe.stop.set()
        thread.join(PROBE_TIMEOUT_S * len(PROBE_PATHS) + 5)


def assert_survived(fleet: LocalFleet, probe: HttpProbe) -> float:
    """The proxy is up, never listed a stranger, and always answered HTTP promptly; returns
    the worst /health latency."""
    assert fleet.proxy is not None and fleet.proxy.alive(), "pdproxy died"
    assert not probe.foreign, f"listed at some point: {sorted(probe.foreign)[:10]}"
    health = probe.latencies("/health")
    assert len(health) >= 10, f"the probe barely ran ({len(health)} /health samples)"
    assert not probe.failures(), f"slow or failed HTTP answers: {probe.failures()[:10]}"
    return max(health)


def report(name: str, summary: dict[str, Any], record: Callable[[str, object], None]) -> None:
    """The run's numbers: in the JUnit report, and one line for `pytest -rP` or `-s`."""
    for key, value in summary.items():
        record(key, value)
    print(f"{name}:", json.dumps(summary))


# -- counting ---------------------------------------------------------------------------------


def processed(fleet: LocalFleet) -> float:
    return metric_value(fleet.proxy_url, "pdproxy_registry_messages_total")


def counted_by_label(fleet: LocalFleet, labels: Sequence[str]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for label in labels:
        outcome = "accepted" if label == ACCEPTED else "rejected"
        value = metric_value(
            fleet.proxy_url,
            "pdproxy_registry_messages_total",
            {"outcome": outcome, "reason": label},
        )
        if value:
            counts[label] = int(value)
    return counts


def wait_processed(fleet: LocalFleet, total: int, timeout: float = DRAIN_TIMEOUT_S) -> None:
    wait_until(
        lambda: processed(fleet) >= total,
        timeout,
        f"the registry to count {total} messages",
        fleet.processes(),
        interval=0.1,
    )


def assert_counted_exactly(fleet: LocalFleet, expected: Counter[str]) -> None:
    wait_processed(fleet, sum(expected.values()))
    time.sleep(0.3)  # anything counted twice, or dropped frames counted late, shows up now
    labels = [ACCEPTED, *(reason.value for reason in Reason)]
    assert counted_by_label(fleet, labels) == expected


# -- legitimate workers -----------------------------------------------------------------------


@dataclass
class Announcer:
    """A legitimate worker: its own DEALER (identity = its zmq address, as vLLM does), the
    n-th message it sends, and the last one (what /v1/instances must show at the end)."""

    socket: zmq.Socket[bytes]
    message: Callable[[int], dict[str, Any]]
    encode: Callable[[dict[str, Any]], bytes] = pack
    sent: int = 0
    last: dict[str, Any] = field(default_factory=dict)
    frames: list[bytes] = field(default_factory=list)  # every frame sent, for replays
    confirmed: int = 0  # how many of `frames` the registry has counted

    def announce(self) -> None:
        self.last = self.message(self.sent)
        frame = self.encode(self.last)
        self.socket.send(frame)
        self.frames.append(frame)
        self.sent += 1

    @property
    def http_address(self) -> str:
        return str(self.last["http_address"])


def v1_worker(role: str, port: int, tp_size: int) -> Callable[[int], dict[str, Any]]:
    def message(n: int) -> dict[str, Any]:
        return {
            "v": 1,
            "op": "announce",
            "type": role,
            "http_address": f"127.0.0.1:{port}",
            "zmq_address": f"127.0.0.1:{port + 1}",
            "model": MODEL,
            "connector": "nixl",
            "geometry": {**GEOMETRY, "tp_size": tp_size},
            "load": {"running": n % 7, "waiting": n % 3, "kv_usage": (n % 10) / 10},
            "healthy": n % 5 != 4,
        }

    return message


def v0_worker(role: str, port: int) -> Callable[[int], dict[str, Any]]:
    def message(_n: int) -> dict[str, Any]:
        return {
            "type": role,
            "http_address": f"127.0.0.1:{port}",
            "zmq_address": f"127.0.0.1:{port + 1}",
        }

    return message


def start_announcers(
    context: ZmqContext,
    fleet: LocalFleet,
    messages: Sequence[Callable[[int], dict[str, Any]]],
    encode: Callable[[dict[str, Any]], bytes] = pack,
) -> list[Announcer]:
    announcers = []
    for message in messages:
        zmq_address = message(0)["zmq_address"]
        sock = dealer(context, fleet, zmq_address.encode())
        announcers.append(Announcer(sock, message, encode))
    for announcer in announcers:
        announcer.announce()
    expected = {a.http_address for a in announcers}
    wait_until(
        lambda: fleet.registered() >= expected, 10, "the legitimate workers", fleet.processes()
    )
    confirm(announcers)
    return announcers


def confirm(announcers: Sequence[Announcer]) -> None:
    """The registry has counted every frame sent so far: replaying them is fair game."""
    for announcer in announcers:
        announcer.confirmed = len(announcer.frames)


def assert_listed_as_announced(fleet: LocalFleet, announcers: Sequence[Announcer]) -> None:
    """Exactly the legitimate workers, each with exactly what it last announced."""
    listed = {item["http_address"]: item for item in fleet.instances()}
    assert set(listed) == {a.http_address for a in announcers}
    for announcer in announcers:
        item, last = listed[announcer.http_address], announcer.last
        assert item["type"] == last["type"] and item["zmq_address"] == last["zmq_address"]
        if last.get("v") == 1:
            assert item["source"] == "v1"
            assert (item["model"], item["connector"]) == (last["model"], last["connector"])
            assert item["geometry"] == last["geometry"]
            assert item["load"] == last["load"] and item["healthy"] == last["healthy"]
        else:
            assert item["source"] == "v0" and item["model"] is None and item["geometry"] is None


# -- the fuzz generator -----------------------------------------------------------------------

BAD_VERSIONS: tuple[Any, ...] = (2, -1, "1", 1.0, 0.0, True, False, None, 2**64 - 1, math.nan, [1])
WRONG_TYPES: tuple[Any, ...] = (8100, None, b"P", ["P"], True, 1.5, {"P": 1}, -(2**63))
UNKNOWN_ROLES = ("p", "d", "PD", "", "prefill", "\uff30", "P\x00", " P", "P\n")
BAD_ADDRESSES = (
    "",
    ":8100",
    "127.0.0.1",
    "127.0.0.1:",
    "127.0.0.1:0",
    "127.0.0.1:65536",
    "127.0.0.1:99999999",
    "127.0.0.1:+80",
    "127.0.0.1:-1",
    "127.0.0.1: 80",
    "127.0.0.1:1e3",
    "127.0.0.1:٨٠",
    "127.0.0.1:\uff18\uff10",
    "[::1]:8100",
    "::1:8100",
    "fe80::1%eth0:80",
    "a__b:1",
    "a___b:1",
    "-h:1",
    "h-:1",
    "h .x:1",
    "héllo:1",
    "\uff57\uff4f\uff52\uff4b\uff45\uff52:8100",
    "x" * 254 + ":1",
    "127.0.0.1:8100\x00",
    "💥:1",
)
UNKNOWN_OPS: tuple[Any, ...] = ("join", "LEAVE", "", None, 1, ["leave"], "announce\x00")
BAD_MODELS: tuple[Any, ...] = (7, "", "m" * 257, "m" * 60_000, ["m"], b"m", True, 1.5, {})
BAD_CONNECTORS: tuple[Any, ...] = (3, True, ["nixl"], "nccl", "NIXL", "", "P2pNccl", "nixl ")
NOT_MAPS: tuple[Any, ...] = ([2, 16], "tp=2", 3, True, b"x", 1.5)
BAD_GEOMETRY_FIELDS: Mapping[str, tuple[Any, ...]] = MappingProxyType(
    {
        # 2**40 ranks and 64-bit layer counts once got in: see tests/unit/test_registry_fuzz.py.
        "tp_size": (0, -1, True, 2.0, "2", 2**40, 2**64 - 1),
        "block_size": (0, -16, False, 16.0, 2**64 - 1),
        "num_layers": (0, -(2**63), "2", 2**64 - 1),
        "num_kv_heads": (0, True, [8], 2**48),
        "head_dim": (0, -64, 64.5, 2**64 - 1),
        "kv_dtype": ("", 16, "x" * 33, ["bfloat16"], b"bf16"),
        "is_mla": (1, 0, "false", [], 1.0),
        "kv_layout": ("XYZ", "nhd", 1, ["HND"], "HND\x00"),
    }
)
BAD_LOAD_FIELDS: Mapping[str, tuple[Any, ...]] = MappingProxyType(
    {
        "running": (-1, True, 1.0, "3", -(2**63)),
        "waiting": (-3, False, math.inf, [0]),
        "kv_usage": (math.nan, math.inf, -math.inf, -0.01, 1.0001, 2, True, "0.5", 2**64 - 1),
    }
)
BAD_HEALTH: tuple[Any, ...] = (1, 0, "true", None, [], 1.0)


@dataclass
class Fuzzer:
    """Seeded generator of hostile registry messages. Near-valid maps carry exactly one
    hostile field (plus harmless noise), so each of them is invalid by construction."""

    rng: random.Random
    legit_addresses: Sequence[str]
    oversized_made: int = 0

    def message(self) -> Parts:
        roll = self.rng.random()
        if roll < 0.25:
            return (self.random_bytes(),)
        if roll < 0.40:
            return (self.garbled(),)
        if roll < 0.50:
            return (pack(self.junk(depth=3)),)
        if roll < 0.95:
            return (pack(self.near_valid()),)
        return self.multi_frame()

    # -- bytes

    def random_bytes(self) -> bytes:
        roll = self.rng.random()
        if roll < 0.05:
            return b""
        if roll < 0.85:
            return self.rng.randbytes(self.rng.randint(1, 256))
        if roll < 0.995:
            return self.rng.randbytes(self.rng.randint(257, 8192))
        # Up to the limit, inclusive: ZMQ drops only what is larger.
        return self.rng.randbytes(self.rng.choice([MAX_MESSAGE_BYTES, MAX_MESSAGE_BYTES - 1]))

    def garbled(self) -> bytes:
        """A valid map with byte-level damage. Damage inside a string can leave a valid
        message (another port, another model name): such frames are drawn again, so that
        every fuzz message is one the registry must refuse."""
        for _ in range(20):
            data = self.damaged(pack(self.valid_map()))
            if expected_label((data,)) != ACCEPTED:
                return data
        return b"\xc1"  # msgpack's never-used byte

    def damaged(self, frame: bytes) -> bytes:
        data = bytearray(frame)
        for _ in range(self.rng.randint(1, 3)):
            at = self.rng.randrange(len(data) + 1)
            kind = self.rng.randrange(4)
            if kind == 0:
                del data[at:]
            elif kind == 1:
                data[at : at + 1] = bytes([self.rng.randrange(256)])
            elif kind == 2:
                data[at:at] = self.rng.randbytes(self.rng.randint(1, 8))
            else:
                del data[at : at + self.rng.randint(1, 8)]
        return bytes(data)

    def multi_frame(self) -> Parts:
        count = self.rng.choice([2, 2, 3, 5, 17, 40, self.rng.randint(100, 600)])
        parts = [self.random_bytes() if self.rng.random() < 0.5 else pack(self.valid_map())]
        parts += [self.rng.randbytes(self.rng.randint(0, 64)) for _ in range(count - 1)]
        return tuple(parts)

    def oversized(self) -> bytes:
        """A valid announcement past the size limit: it would register if it got through."""
        self.oversized_made += 1
        message = {
            **self.v1_map(f"127.0.0.1:{17_000 + 2 * self.oversized_made}"),
            "padding": "x" * (MAX_MESSAGE_BYTES + self.rng.randint(1, 5000)),
        }
        return pack(message)

    # -- values

    def scalar(self) -> Any:
        choices: list[Callable[[], Any]] = [
            lambda: None,
            lambda: self.rng.random() < 0.5,
            lambda: self.rng.randint(-(2**63), 2**64 - 1),
            lambda: self.rng.choice([math.nan, math.inf, -math.inf, -0.0, 1e308]),
            lambda: self.rng.uniform(-1e6, 1e6),
            lambda: "".join(
                chr(self.rng.randint(1, 0xD7FF)) for _ in range(self.rng.randint(0, 12))
            ),
            lambda: self.rng.randbytes(self.rng.randint(0, 12)),
            lambda: msgpack.ExtType(self.rng.randint(0, 127), self.rng.randbytes(4)),
        ]
        return self.rng.choice(choices)()

    def junk(self, depth: int) -> Any:
        roll = self.rng.random()
        if depth <= 0 or roll < 0.6:
            return self.scalar()
        size = self.rng.randint(0, 4)
        if roll < 0.8:
            return [self.junk(depth - 1) for _ in range(size)]
        return {self.key(): self.junk(depth - 1) for _ in range(size)}

    def key(self) -> Any:
        return self.rng.choice(
            [
                "x" + str(self.rng.randint(0, 99)),
                self.rng.randint(-5, 5),
                None,
                b"type",
                "stats",
                "auth",
                1.5,
                "тип",
            ]
        )

    def address(self) -> str:
        roll = self.rng.random()
        if roll < 0.3:
            return self.rng.choice(list(self.legit_addresses))  # hijack attempts
        if roll < 0.8:
            return f"127.0.0.1:{self.rng.randint(19_000, 19_999)}"
        return f"fuzz-worker-{self.rng.randint(0, 99)}.svc:{self.rng.randint(1, 65535)}"

    # -- valid maps, then broken ones

    def v1_map(self, http_address: str | None = None) -> dict[Any, Any]:
        return {
            "v": 1,
            "op": "announce",
            "type": self.rng.choice(["P", "D"]),
            "http_address": http_address or self.address(),
            "zmq_address": self.address(),
            "model": MODEL,
            "connector": "nixl",
            "geometry": {**GEOMETRY, "tp_size": self.rng.choice([1, 2, 4])},
            "load": {"running": self.rng.randint(0, 9), "kv_usage": self.rng.random()},
            "healthy": True,
        }

    def valid_map(self) -> dict[Any, Any]:
        shape = self.rng.randrange(3)
        if shape == 0:
            return {
                "type": self.rng.choice("PD"),
                "http_address": self.address(),
                "zmq_address": self.address(),
            }
        if shape == 1:
            return self.v1_map()
        return {"v": 1, "op": "leave", "http_address": self.address()}

    def near_valid(self) -> dict[Any, Any]:
        message = self.valid_map()
        for _ in range(self.rng.randint(0, 3)):  # harmless: unknown fields are ignored
            message.setdefault(self.key(), self.junk(depth=3))
        if "v" not in message and self.rng.random() < 0.3:
            # v1-only fields on a v0 map are ignored too, however hostile.
            message["model"] = self.rng.choice(BAD_MODELS)
            message["geometry"] = self.junk(depth=2)
        self.break_one_field(message)
        return message

    def break_one_field(self, message: dict[Any, Any]) -> None:
        kind = "leave" if message.get("op") == "leave" else "v1" if "v" in message else "v0"
        required = ["http_address"] if kind == "leave" else ["type", "http_address", "zmq_address"]
        breakers: list[Callable[[], None]] = [
            lambda: message.pop(self.rng.choice(required)),
            lambda: message.__setitem__(self.rng.choice(required), self.rng.choice(WRONG_TYPES)),
            lambda: message.__setitem__("v", self.rng.choice(BAD_VERSIONS)),
        ]
        if kind != "leave":
            breakers.append(lambda: message.__setitem__("type", self.rng.choice(UNKNOWN_ROLES)))
            breakers.append(lambda: self.bad_address(message, "zmq_address"))
        breakers.append(lambda: self.bad_address(message, "http_address"))
        if kind != "v0":
            breakers.append(lambda: message.__setitem__("op", self.rng.choice(UNKNOWN_OPS)))
        if kind == "v1":
            breakers += [
                lambda: message.__setitem__("model", self.rng.choice(BAD_MODELS)),
                lambda: message.__setitem__("connector", self.rng.choice(BAD_CONNECTORS)),
                lambda: message.__setitem__("geometry", self.rng.choice(NOT_MAPS)),
                lambda: message.__setitem__("load", self.rng.choice(NOT_MAPS)),
                lambda: message.__setitem__("healthy", self.rng.choice(BAD_HEALTH)),
                lambda: self.bad_nested(message, "geometry", BAD_GEOMETRY_FIELDS),
                lambda: self.bad_nested(message, "geometry", BAD_GEOMETRY_FIELDS),
                lambda: self.bad_nested(message, "load", BAD_LOAD_FIELDS),
            ]
        self.rng.choice(breakers)()

    def bad_address(self, message: dict[Any, Any], key: str) -> None:
        message[key] = self.rng.choice(BAD_ADDRESSES)

    def bad_nested(
        self, message: dict[Any, Any], key: str, fields: Mapping[str, tuple[Any, ...]]
    ) -> None:
        name = self.rng.choice(sorted(fields))
        message[key] = {**message[key], name: self.rng.choice(fields[name])}


# -- 1. no secret: 100,000 hostile messages ---------------------------------------------------


@dataclass
class Sent:
    """The fuzz messages sent (not the legitimate ones) and how each must be counted."""

    messages: int = 0
    frames: int = 0
    labels: Counter[str] = field(default_factory=Counter)

    def record(self, parts: Parts) -> None:
        self.messages += 1
        self.frames += len(parts)
        self.labels[expected_label(parts)] += 1


def send_fuzz(
    fleet: LocalFleet, context: ZmqContext, fuzzer: Fuzzer, announcers: Sequence[Announcer]
) -> Sent:
    """Send MESSAGES fuzz messages, legitimate announcements interleaved; return what was
    sent once the registry has counted all of it."""
    sockets = [dealer(context, fleet, f"fuzz-{i}".encode()) for i in range(FUZZ_SOCKETS)]
    sockets += [dealer(context, fleet, None) for _ in range(2)]  # ROUTER-assigned identities
    # An oversized frame costs its sender the connection: one socket each, kept open (and
    # unused) until the counts are checked, so a frame that got through would be counted.
    oversized = [dealer(context, fleet, f"big-{i}".encode()) for i in range(OVERSIZED)]
    oversized_every = MESSAGES // OVERSIZED
    fuzz = Sent()
    counted_before = 0
    for index in range(MESSAGES):
        parts = fuzzer.message()
        send(sockets[index % len(sockets)], parts)
        fuzz.record(parts)
        if index % LEGIT_EVERY == 0:
            announcers[(index // LEGIT_EVERY) % len(announcers)].announce()
        if index % oversized_every == 0:
            oversized[index // oversized_every].send(fuzzer.oversized())
        if (index + 1) % BATCH == 0:
            # At most two batches in flight: bounded queues, bounded waits.
            wait_processed(fleet, counted_before)
            counted_before = fuzz.messages + sum(a.sent for a in announcers)
    legit_sent = sum(a.sent for a in announcers)
    assert_counted_exactly(fleet, fuzz.labels + Counter({ACCEPTED: legit_sent}))
    return fuzz


def test_hostile_frames_neither_crash_nor_stall_nor_register(
    fleet_factory: FleetFactory,
    zmq_context: ZmqContext,
    record_property: Callable[[str, object], None],
) -> None:
    fleet = fleet_factory(
        [], proxy_args=["--ttl", "60", "--registry-max-message-bytes", str(MAX_MESSAGE_BYTES)]
    )
    workers = [
        v1_worker("P", 18_100, tp_size=1),
        v1_worker("D", 18_200, tp_size=2),
        v1_worker("D", 18_300, tp_size=1),
        v0_worker("P", 18_400),
    ]
    announcers = start_announcers(zmq_context, fleet, workers)
    legit = [a.http_address for a in announcers]
    fuzzer = Fuzzer(random.Random(SEED), legit)

    with probing(fleet, legit) as probe:
        started = time.monotonic()
        fuzz = send_fuzz(fleet, zmq_context, fuzzer, announcers)
        elapsed = time.monotonic() - started
        assert_listed_as_announced(fleet, announcers)

    worst_health = assert_survived(fleet, probe)
    # The decoder refuses every fuzz message (so the registry, counting exactly as the decoder
    # judges, accepted only the legitimate ones), and the mix reached every stage of
    # validation, not just the msgpack parser.
    assert ACCEPTED not in fuzz.labels, f"{fuzz.labels[ACCEPTED]} fuzz messages are valid"
    deep = ("wrong_type", "unknown_type", "unknown_op", "bad_address", "bad_geometry", "bad_load")
    for reason in ("not_msgpack", "not_a_map", "missing_field", "framing", *deep):
        assert fuzz.labels[reason] > 100, reason
    legit_sent = sum(a.sent for a in announcers)
    report(
        "registry fuzz",
        {
            "messages": fuzz.messages + legit_sent,
            "frames": fuzz.frames + legit_sent + OVERSIZED,
            "oversized_dropped": OVERSIZED,
            "seconds": round(elapsed, 2),
            "messages_per_second": round((fuzz.messages + legit_sent) / elapsed),
            "frames_per_second": round((fuzz.frames + legit_sent) / elapsed),
            "worst_health_ms": round(worst_health * 1000, 1),
            "health_polls": len(probe.latencies("/health")),
            "by_reason": dict(sorted(fuzz.labels.items())),
        },
        record_property,
    )


# -- 2. with a secret: forged, replayed, stale, unsigned, v0, out-of-network ------------------

SECRET = "fuzz-registry-secret-0123456789"
KEY = SECRET.encode()
SKEW_S = 300.0  # generous: replays of frames signed earlier in the test must not turn stale
ATTACKS_PER_KIND = 2_000
SECRET_BATCH = 2_000
LEGIT_EVERY_SIGNED = 20
OUTSIDE_HOSTS = (
    "10.1.2.3",
    "192.168.0.1",
    "169.254.169.254",
    "0.0.0.0",
    "128.0.0.1",
    "localhost",
    "metadata.google.internal",
    "fuzz.example",
)


def sign_now(message: dict[str, Any], offset: float = 0.0) -> dict[str, Any]:
    return signed(message, KEY, time.time() + offset, new_nonce())


@dataclass
class Attacker:
    """Builds attack frames of one kind each, from the legitimate workers' own messages."""

    rng: random.Random
    announcers: Sequence[Announcer]
    v0_allowed: bool

    def template(self) -> dict[str, Any]:
        announcer = self.rng.choice(list(self.announcers))
        message = dict(announcer.message(self.rng.randint(0, 1000)))
        if message.get("v") != 1:  # a v0 worker's address, in a v1 message
            message.update(v=1, op="announce", model=MODEL)
        if self.rng.random() < 0.5:
            message["http_address"] = f"127.0.0.1:{self.rng.randint(29_000, 29_999)}"
        return message

    def forged(self) -> bytes:
        message = sign_now(self.template())
        auth = message["auth"]
        variant = self.rng.randrange(8)
        if variant == 0:
            auth["mac"] = f"{self.rng.getrandbits(256):064x}"
        elif variant == 1:
            message = signed(self.template(), b"not-the-registry-secret", time.time(), new_nonce())
        elif variant == 2:  # signed, then altered: hijack a legitimate address
            others = [a.http_address for a in self.announcers]
            message["http_address"] = self.rng.choice(
                [other for other in others if other != message["http_address"]]
            )
        elif variant == 3:
            message["op"] = "leave"
        elif variant == 4:
            message["geometry"] = {**GEOMETRY, "tp_size": 8}
        elif variant == 5:
            auth["ts"] += 1.5  # still fresh: only the MAC can tell
        elif variant == 6:
            auth["nonce"] = new_nonce()
        else:
            message["auth"] = self.rng.choice(
                [
                    "token",
                    [auth["mac"]],
                    {"ts": auth["ts"], "nonce": auth["nonce"]},
                    {**auth, "mac": auth["mac"].upper()},
                    {**auth, "mac": auth["mac"][:-1]},
                    {**auth, "ts": math.nan},
                    {**auth, "ts": True},
                    {**auth, "ts": str(auth["ts"])},
                    {**auth, "nonce": auth["nonce"] + "0"},
                ]
            )
        return pack(message)

    def replayed(self) -> bytes:
        announcer = self.rng.choice(list(self.announcers))
        return self.rng.choice(announcer.frames[: announcer.confirmed][-50:])

    def stale(self) -> bytes:
        offset = SKEW_S + self.rng.choice([1.0, 60.0, 3600.0, 86_400.0 * 365, 1e9])
        return pack(sign_now(self.template(), offset if self.rng.random() < 0.5 else -offset))

    def unsigned(self) -> bytes:
        message = self.template()
        if self.rng.random() < 0.3:  # an unsigned leave must not remove a legitimate worker
            message = {"v": 1, "op": "leave", "http_address": message["http_address"]}
        return pack(message)

    def v0(self) -> bytes:
        """Refused: unsigned when v0 is not allowed, else from outside the v0 networks."""
        http = f"127.0.0.1:{self.rng.randint(29_000, 29_999)}"
        zmq_address = f"127.0.0.1:{self.rng.randint(29_000, 29_999)}"
        outside = self.rng.choice(["127.0.0.2", "127.1.2.3", "10.0.0.1", "localhost"])
        if self.rng.random() < 0.5:
            http = f"{outside}:{self.rng.randint(1, 65535)}"
        else:
            zmq_address = f"{outside}:{self.rng.randint(1, 65535)}"
        return pack(
            {"type": self.rng.choice("PD"), "http_address": http, "zmq_address": zmq_address}
        )

    def outside(self) -> bytes:
        message = self.template()
        key = self.rng.choice(["http_address", "zmq_address"])
        message[key] = f"{self.rng.choice(OUTSIDE_HOSTS)}:{self.rng.randint(1, 65535)}"
        return pack(sign_now(message))

    def kinds(self) -> dict[str, tuple[Callable[[], bytes], str]]:
        v0_reason = Reason.FORBIDDEN_ADDRESS if self.v0_allowed else Reason.UNSIGNED
        return {
            "forged": (self.forged, Reason.BAD_SIGNATURE.value),
            "replayed": (self.replayed, Reason.REPLAYED.value),
            "stale": (self.stale, Reason.STALE.value),
            "unsigned": (self.unsigned, Reason.UNSIGNED.value),
            "v0": (self.v0, v0_reason.value),
            "outside": (self.outside, Reason.FORBIDDEN_ADDRESS.value),
        }


def secret_config(path: Path, v0_allowed: bool) -> list[str]:
    settings: dict[str, Any] = {
        "registry_secret": SECRET,
        "registry_max_skew_seconds": SKEW_S,
        "registry_address_cidrs": ["127.0.0.0/8"],
        "ttl": 60,
    }
    if v0_allowed:
        settings.update(registry_allow_unsigned_v0=True, registry_v0_cidrs=["127.0.0.1/32"])
    path.write_text(yaml.safe_dump(settings))
    return ["--config", str(path)]


def send_attacks(
    fleet: LocalFleet, context: ZmqContext, attacker: Attacker, announcers: Sequence[Announcer]
) -> Counter[str]:
    """ATTACKS_PER_KIND of each kind, shuffled, signed announcements interleaved; return the
    label each message must be counted under, once the registry has counted them all."""
    kinds = attacker.kinds()
    plan = [kind for kind in kinds for _ in range(ATTACKS_PER_KIND)]
    attacker.rng.shuffle(plan)
    sockets = [dealer(context, fleet, f"attacker-{i}".encode()) for i in range(4)]
    expected: Counter[str] = Counter({ACCEPTED: sum(a.sent for a in announcers)})
    for index, kind in enumerate(plan):
        build, reason = kinds[kind]
        sockets[index % len(sockets)].send(build())
        expected[reason] += 1
        if index % LEGIT_EVERY_SIGNED == 0:
            announcers[(index // LEGIT_EVERY_SIGNED) % len(announcers)].announce()
            expected[ACCEPTED] += 1
        if (index + 1) % SECRET_BATCH == 0:
            # Replays in the next batch copy only frames this wait saw counted.
            wait_processed(fleet, sum(expected.values()))
            confirm(announcers)
    assert_counted_exactly(fleet, expected)
    return expected


@pytest.mark.parametrize("v0_allowed", [False, True], ids=["v0-refused", "v0-from-cidrs"])
def test_forged_replayed_stale_and_foreign_announcements_at_volume(
    fleet_factory: FleetFactory,
    zmq_context: ZmqContext,
    tmp_path: Path,
    v0_allowed: bool,
    record_property: Callable[[str, object], None],
) -> None:
    fleet = fleet_factory([], proxy_args=secret_config(tmp_path / "proxy.yaml", v0_allowed))
    workers = [
        v1_worker("P", 28_100, tp_size=1),
        v1_worker("D", 28_200, tp_size=2),
        v1_worker("D", 28_300, tp_size=1),
    ]
    signers = start_announcers(zmq_context, fleet, workers, encode=lambda m: pack(sign_now(m)))
    announcers = signers + (
        start_announcers(zmq_context, fleet, [v0_worker("P", 28_400)]) if v0_allowed else []
    )
    attacker = Attacker(random.Random(SEED), signers, v0_allowed)

    with probing(fleet, [a.http_address for a in announcers]) as probe:
        started = time.monotonic()
        expected = send_attacks(fleet, zmq_context, attacker, announcers)
        elapsed = time.monotonic() - started
        # No forgery, replay or unsigned leave moved, renamed or removed a signed worker.
        assert_listed_as_announced(fleet, announcers)

    worst_health = assert_survived(fleet, probe)
    total = sum(expected.values())
    report(
        "registry auth fuzz",
        {
            "messages": total,
            "by_reason": dict(sorted(expected.items())),
            "seconds": round(elapsed, 2),
            "messages_per_second": round(total / elapsed),
            "worst_health_ms": round(worst_health * 1000, 1),
        },
        record_property,
    )
