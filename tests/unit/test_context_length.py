"""How the proxy learns a model's context length (max_model_len) from its workers."""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgpack
import pytest

from pdproxy.base.endpoints import Endpoint
from pdproxy.base.roles import Role
from pdproxy.fake_vllm.announce import announce_message as fake_announce_message
from pdproxy.fake_vllm.config import Geometry, WorkerConfig
from pdproxy.ids import Address
from pdproxy.registry.messages import MAX_MODEL_LEN, Announcement, Load, decode_frame
from pdproxy.vllm_side.announce import (
    ContextLengthProbe,
    add_cli,
    build_identity,
    context_length_from_models,
)
from pdproxy.vllm_side.announcement import WorkerIdentity, announce_message, context_length
from pdproxy.vllm_side.announcer import Announcer, LoadSample

IDENTITY = WorkerIdentity(Role.DECODE, "10.0.0.6:8200", "10.0.0.6:22001", model="m")


def decoded(message: dict[str, Any]) -> Announcement:
    announcement = decode_frame(msgpack.packb(message))
    assert isinstance(announcement, Announcement)
    return announcement


# --- what workers announce ---------------------------------------------------------------------


def test_an_identity_with_a_context_length_announces_it() -> None:
    identity = WorkerIdentity(Role.DECODE, "10.0.0.6:8200", "10.0.0.6:22001", max_model_len=32768)
    message = announce_message(identity)
    assert message["max_model_len"] == 32768
    assert decoded(message).max_model_len == 32768
    assert "max_model_len" not in announce_message(IDENTITY)


ACCEPTED = [(4096, 4096), (1, 1), (MAX_MODEL_LEN, MAX_MODEL_LEN)]
REFUSED = [(0, None), (-5, None), (MAX_MODEL_LEN + 1, None), (True, None), (4096.0, None)]


@pytest.mark.parametrize(("value", "expected"), [*ACCEPTED, *REFUSED, ("4096", None), (None, None)])
def test_context_length_takes_only_what_the_registry_accepts(
    value: object, expected: object
) -> None:
    assert context_length(value) == expected


class Client:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, message: dict[str, Any]) -> bool:
        self.sent.append(message)
        return True


def test_the_announcer_announces_what_its_sample_learned() -> None:
    samples = iter([LoadSample(None), LoadSample(Load(running=1), max_model_len=2048)])
    client = Client()
    announcer = Announcer(client, IDENTITY, lambda: next(samples))  # type: ignore[arg-type]
    announcer.announce_once()
    announcer.announce_once()
    assert ["max_model_len" in m for m in client.sent] == [False, True]
    assert client.sent[1]["max_model_len"] == 2048


def fake_config(max_model_len: int) -> WorkerConfig:
    return WorkerConfig(
        role=Role.DECODE,
        http=Address("127.0.0.1", 8000),
        kv=Address("127.0.0.1", 8001),
        proxy=Endpoint("127.0.0.1", 30001),
        announce="v1",
        announce_interval_s=1.0,
        model="m",
        token_latency_s=0.0,
        prefill_latency_s=0.0,
        kv_timeout_s=1.0,
        max_model_len=max_model_len,
        kv_capacity_tokens=1024,
        connector="p2p_nccl",
        geometry=Geometry(),
    )


def test_the_fake_worker_announces_its_own_max_model_len() -> None:
    message = fake_announce_message(fake_config(640), "announce", Load())
    assert decoded(message).max_model_len == 640


# --- `pdproxy announce`: --max-model-len, else the server's /v1/models ------------------------

MODELS = {
    "object": "list",
    "data": [
        {"id": "base", "object": "model", "root": "/models/base", "max_model_len": 8192},
        {"id": "served", "object": "model", "root": "/models/base", "max_model_len": 4096},
    ],
}


@pytest.mark.parametrize(
    ("body", "model", "expected"),
    [
        (json.dumps(MODELS).encode(), "served", 4096),
        (json.dumps(MODELS).encode(), None, 8192),  # no --model: the first one listed
        (json.dumps(MODELS).encode(), "other", None),
        (b'{"data": [{"id": "m", "max_model_len": null}]}', "m", None),
        (b'{"data": [{"id": "m", "max_model_len": "4096"}]}', "m", None),
        (b'{"data": [{"id": "m", "max_model_len": 0}]}', "m", None),
        (b'{"data": {"id": "m"}}', "m", None),
        (b"[1, 2]", None, None),
        (b"<html>not json", None, None),
        (b"", None, None),
    ],
)
def test_context_length_from_models(body: bytes, model: str | None, expected: int | None) -> None:
    assert context_length_from_models(body, model) == expected


def announce_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    base = ["announce", "--role", "D", "--http-address", "h:1", "--zmq-address", "h:2"]
    return parser.parse_args([*base, "--registry", "r:3", *argv])


def test_max_model_len_flag() -> None:
    assert build_identity(announce_args("--max-model-len", "4096")).max_model_len == 4096
    assert build_identity(announce_args()).max_model_len is None
    with pytest.raises(ValueError, match="max-model-len"):
        build_identity(announce_args("--max-model-len", str(MAX_MODEL_LEN + 1)))


class ModelsServer:
    """GET /v1/models on loopback, answering what the test sets; counts the requests."""

    def __init__(self) -> None:
        self.body = json.dumps(MODELS).encode()
        self.requests = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.requests += 1
                self.send_response(200)
                self.send_header("Content-Length", str(len(owner.body)))
                self.end_headers()
                self.wfile.write(owner.body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/models"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)


@pytest.fixture
def models_server() -> Iterator[ModelsServer]:
    server = ModelsServer()
    server.thread.start()
    try:
        yield server
    finally:
        server.server.shutdown()
        server.server.server_close()
        server.thread.join(5)


def test_the_probe_reads_once_and_again_after_the_server_was_away(
    models_server: ModelsServer,
) -> None:
    probe = ContextLengthProbe(models_server.url, "served", timeout_s=5.0)
    assert probe(healthy=True) == 4096
    assert probe(healthy=True) == 4096
    assert models_server.requests == 1  # known: not asked again
    models_server.body = json.dumps({"data": [{"id": "served", "max_model_len": 16384}]}).encode()
    assert probe(healthy=False) == 4096  # away: the last known is kept, nothing is asked
    assert models_server.requests == 1
    assert probe(healthy=True) == 16384  # back, maybe restarted: asked again
    assert models_server.requests == 2


def test_the_probe_keeps_asking_until_it_learns() -> None:
    probe = ContextLengthProbe("http://127.0.0.1:1/v1/models", "m", timeout_s=1.0)
    assert probe(healthy=True) is None  # refused: unknown, asked again next period
    assert probe(healthy=True) is None
