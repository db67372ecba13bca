"""Workers sign their v1 registry messages when given the registry secret."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import pytest

from pdproxy.base.endpoints import Endpoint
from pdproxy.base.roles import Role
from pdproxy.base.secret_file import SECRET_ENV, SecretError, read_secret_file
from pdproxy.fake_vllm.announce import announce_message as fake_announce_message
from pdproxy.fake_vllm.config import Geometry, WorkerConfig
from pdproxy.ids import Address
from pdproxy.registry.auth import Verifier
from pdproxy.registry.messages import Load, Reason, Rejected
from pdproxy.vllm_side.announce import add_cli, registry_secret
from pdproxy.vllm_side.announcement import WorkerIdentity
from pdproxy.vllm_side.announcer import Announcer, LoadSample
from pdproxy.vllm_side.connector_settings import ConnectorConfigError, connector_settings

SECRET = b"worker-secret-0123456789"
NOW = 1_700_000_000.0
IDENTITY = WorkerIdentity(Role.PREFILL, "10.0.0.5:20001", "10.0.0.5:21001", model="m")


class Client:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, message: dict[str, Any]) -> bool:
        self.sent.append(message)
        return True

    def close(self) -> None:
        pass


def run_once(secret: bytes | None) -> list[dict[str, Any]]:
    client = Client()
    announcer = Announcer(
        client,  # type: ignore[arg-type]
        IDENTITY,
        lambda: LoadSample(Load(running=1)),
        interval_s=0.01,
        secret=secret,
        wall_clock=lambda: NOW,
    )
    announcer.announce_once()
    announcer.request_stop()
    announcer.run()  # stopped already: sends only `leave`
    return client.sent


def test_the_announcer_signs_announce_and_leave() -> None:
    sent = run_once(SECRET)
    assert [m["op"] for m in sent] == ["announce", "leave"]
    verifier = Verifier(SECRET)
    for message in sent:
        verifier.verify(message, NOW)
    assert sent[0]["auth"]["nonce"] != sent[1]["auth"]["nonce"]


def test_without_a_secret_nothing_is_signed() -> None:
    assert all("auth" not in m for m in run_once(None))


def test_secret_file_is_stripped_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    assert read_secret_file(path) == SECRET
    path.write_bytes(b"short\n")
    with pytest.raises(SecretError, match="shorter"):
        read_secret_file(path)
    with pytest.raises(SecretError, match="missing"):
        read_secret_file(tmp_path / "missing")


def announce_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    base = ["announce", "--role", "P", "--http-address", "h:1", "--zmq-address", "h:2"]
    return parser.parse_args([*base, "--registry", "r:3", *argv])


def test_announce_reads_the_secret_from_a_file_or_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    assert registry_secret(announce_args("--registry-secret-file", str(path)), {}) == SECRET
    assert registry_secret(announce_args(), {SECRET_ENV: SECRET.decode()}) == SECRET
    assert registry_secret(announce_args(), {}) is None
    with pytest.raises(SecretError):
        registry_secret(announce_args(), {SECRET_ENV: "tiny"})


def test_connector_reads_the_secret_file_setting() -> None:
    extra = {"proxy_ip": "p", "proxy_port": 1, "registry_secret_file": "/run/secret"}
    settings = connector_settings("kv_producer", None, None, extra, "h")
    assert settings.registry_secret_file == Path("/run/secret")
    assert connector_settings("kv_producer", None, None, {}, "h").registry_secret_file is None
    with pytest.raises(ConnectorConfigError, match="registry_secret_file"):
        connector_settings("kv_producer", None, None, {"registry_secret_file": " "}, "h")


def fake_config(secret: bytes | None, announce: str = "v1") -> WorkerConfig:
    return WorkerConfig(
        role=Role.DECODE,
        http=Address("127.0.0.1", 8000),
        kv=Address("127.0.0.1", 8001),
        proxy=Endpoint("127.0.0.1", 30001),
        announce=announce,  # type: ignore[arg-type]
        announce_interval_s=1.0,
        model="m",
        token_latency_s=0.0,
        prefill_latency_s=0.0,
        kv_timeout_s=1.0,
        max_model_len=128,
        kv_capacity_tokens=1024,
        connector="p2p_nccl",
        geometry=Geometry(),
        registry_secret=secret,
    )


def test_the_fake_worker_signs_v1_but_not_v0() -> None:
    cfg = fake_config(SECRET)
    assert SECRET.decode() not in repr(cfg)
    verifier = Verifier(SECRET, max_skew_s=3600)
    for op in ("announce", "leave"):
        verifier.verify(fake_announce_message(cfg, op, Load()), time.time())
    assert "auth" not in fake_announce_message(fake_config(SECRET, "v0"), "announce", Load())
    with pytest.raises(Rejected) as info:
        verifier.verify(fake_announce_message(fake_config(None), "announce", Load()), NOW)
    assert info.value.reason is Reason.UNSIGNED
