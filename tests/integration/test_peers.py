"""Operator actions without Kubernetes (`--peers-dns`): an admin drain, undrain or removal
sent to one replica is applied by every replica the name resolves to.

Three real `pdproxy serve` replicas on 127.0.0.1, .2, .3 (all loopback on Linux), one port, each
with the same static prefill instance; the name `pdproxy-peers.test` resolves to them (and to
127.0.0.9, where nothing listens) through the test's own table (tests.harness.fake_dns), never
/etc/hosts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdproxy.proxy.peers import FORWARDED_BY
from tests.integration.replicas import Names, Replica, Replicas
from tests.integration.support import Answer, request

NAME = "pdproxy-peers.test"
TOKEN = "peers-admin-token-0123456789"
INSTANCE = "127.0.0.1:18300"
HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
UNREACHABLE = "127.0.0.9"


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[list[Replica]]:
    names = Names(tmp_path / "hosts.json")
    names.set(NAME, [*HOSTS, UNREACHABLE])
    extra = [
        "--peers-dns",
        NAME,
        "--admin-token",
        TOKEN,
        "--prefill",
        f"http={INSTANCE},zmq=127.0.0.1:18301",
    ]
    started = Replicas(tmp_path, names, extra)
    try:
        yield started.start(HOSTS)
    finally:
        started.close()


def admin(replica: Replica, method: str, path: str, **headers: str) -> Answer:
    sent = {"Authorization": f"Bearer {TOKEN}", **headers}
    return request(replica.url + path, method=method, body=b"", headers=sent, timeout=30)


def drained(replica: Replica) -> bool:
    return bool(replica.instances()[INSTANCE]["drained"])


def test_a_drain_sent_to_one_replica_is_applied_by_all(replicas: list[Replica]) -> None:
    one = replicas[0]
    everyone = [f"{r.host}:{r.http_port}" for r in replicas]
    answer = admin(one, "POST", f"/v1/instances/{INSTANCE}/drain")
    print(answer.body.decode())
    assert answer.status == 200, answer.body
    body = answer.json()
    assert body["drained"] == INSTANCE
    assert body["replicas"]["applied"] == everyone
    # The address nothing listens at is named, with why.
    (failed,) = body["replicas"]["failed"]
    assert failed == f"{UNREACHABLE}:{one.http_port}"
    assert body["replicas"]["failed"][failed]
    assert all(drained(r) for r in replicas)

    # Undrain through another replica: back everywhere.
    answer = admin(replicas[2], "DELETE", f"/v1/instances/{INSTANCE}/drain")
    assert answer.status == 200, answer.body
    assert answer.json()["replicas"]["applied"] == everyone
    assert not any(drained(r) for r in replicas)

    # Again: nothing is drained anywhere, so it is applied nowhere: a 404 in the API's shape.
    answer = admin(replicas[1], "DELETE", f"/v1/instances/{INSTANCE}/drain")
    assert answer.status == 404
    assert "not drained" in answer.json()["error"]["message"]


def test_a_forwarded_call_goes_no_further(replicas: list[Replica]) -> None:
    # As a peer receives it: applied there only, never sent on (no loops).
    answer = admin(
        replicas[1], "POST", f"/v1/instances/{INSTANCE}/drain", **{FORWARDED_BY: "another"}
    )
    assert answer.status == 200, answer.body
    assert answer.json() == {"drained": INSTANCE}
    assert [drained(r) for r in replicas] == [False, True, False]


def test_without_the_admin_token_nothing_is_applied_anywhere(replicas: list[Replica]) -> None:
    answer = request(
        replicas[0].url + f"/v1/instances/{INSTANCE}/drain",
        body=b"",
        headers={"Authorization": "Bearer wrong"},
    )
    assert answer.status == 401
    assert json.loads(answer.body)["error"]["message"] == "the admin token is required"
    assert not any(drained(r) for r in replicas)


def test_a_removal_reaches_every_replica_and_says_which_failed(replicas: list[Replica]) -> None:
    replicas[2].stop()  # one replica is down: the others still apply it, and it is named
    answer = admin(replicas[0], "DELETE", f"/v1/instances/{INSTANCE}")
    assert answer.status == 200, answer.body
    report = answer.json()["replicas"]
    assert report["applied"] == [f"{r.host}:{r.http_port}" for r in replicas[:2]]
    assert set(report["failed"]) == {
        f"{host}:{replicas[0].http_port}" for host in ("127.0.0.3", UNREACHABLE)
    }
    for replica in replicas[:2]:
        assert INSTANCE not in replica.instances()
