"""An operator's drain, undrain or removal applied by every replica of the proxy (`peers_dns`).

Each replica keeps its own table and drained set (docs/architecture.md, "Scaling out"), so an
admin call that reached one replica through a load balancer is sent on to every address the
replicas' headless name resolves to, at this proxy's port, with the caller's own admin token.
The call sent on carries FORWARDED_BY, this replica's id: a replica that receives it applies the
call and sends it nowhere (no loops), and the replica that sent it recognises its own id and
answers without applying twice. Every wait is bounded: the lookup (BoundedResolver), each call
(PEER_TIMEOUT_S), the number of peers (MAX_PEERS).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import orjson

from pdproxy.base.resolve import BoundedResolver, ResolveError
from pdproxy.http.upstream import UpstreamClient, UpstreamError

log = logging.getLogger("pdproxy.peers")

FORWARDED_BY = "x-pdproxy-forwarded-by"
PEER_TIMEOUT_S = 5.0
MAX_PEERS = 64
_ANSWER_LIMIT = 16 * 1024
LOCAL = "local"  # this replica, when its own name does not list it (yet)


@dataclass(frozen=True, slots=True)
class PeerAddress:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class PeerOutcome:
    replica: str  # "host:port", or LOCAL
    applied: bool
    why: str | None = None  # why not
    is_self: bool = False  # the replica that fanned the call out


def replica_id(host: str, port: int) -> str:
    """The same in every HTTP worker of one replica, different between replicas: a pod's
    hostname is its own, and replicas on one host listen on different addresses or ports."""
    return f"{socket.gethostname()}/{host}:{port}"


def report(outcomes: list[PeerOutcome]) -> dict[str, object]:
    """What the admin answer says of the replicas: which applied the call, which did not and
    why."""
    return {
        "applied": sorted(o.replica for o in outcomes if o.applied),
        "failed": {o.replica: o.why for o in sorted(outcomes, key=_by_name) if not o.applied},
    }


def _by_name(outcome: PeerOutcome) -> str:
    return outcome.replica


class Peers:
    def __init__(
        self, name: str, port: int, own_id: str, resolver: BoundedResolver | None = None
    ) -> None:
        self._name = name
        self._port = port
        self.own_id = own_id
        self._resolver = resolver or BoundedResolver()

    async def fan_out(
        self,
        upstream: UpstreamClient,
        method: str,
        path: str,
        headers: Mapping[str, str],
        local: PeerOutcome,
    ) -> list[PeerOutcome]:
        """Send the call to every replica; `local` is what this one made of it. The outcome
        of each replica, this one included (by its address when the name lists it)."""
        try:
            addresses = await asyncio.to_thread(self._resolver.resolve, self._name)
        except ResolveError as exc:
            log.warning("peers %s: %s: applied here only", self._name, exc)
            return [local, PeerOutcome(self._name, False, f"lookup failed: {exc}")]
        peers = [PeerAddress(address, self._port) for address in addresses[:MAX_PEERS]]
        sent = {**headers, FORWARDED_BY: self.own_id}
        outcomes = await asyncio.gather(
            *(self._call(upstream, p, method, path, sent) for p in peers)
        )
        merged = [
            PeerOutcome(o.replica, local.applied, local.why, is_self=True) if o.is_self else o
            for o in outcomes
        ]
        if not any(o.is_self for o in merged):
            merged.append(local)
        return merged

    async def _call(
        self,
        upstream: UpstreamClient,
        peer: PeerAddress,
        method: str,
        path: str,
        headers: Mapping[str, str],
    ) -> PeerOutcome:
        where = str(peer)
        try:
            async with asyncio.timeout(PEER_TIMEOUT_S):
                async with upstream.stream(method, peer, path, b"", headers) as answer:
                    status = answer.status
                    body = await answer.read_all(_ANSWER_LIMIT)
        except TimeoutError:
            return PeerOutcome(where, False, f"no answer within {PEER_TIMEOUT_S:g}s")
        except (UpstreamError, OSError, ValueError) as exc:
            return PeerOutcome(where, False, str(exc) or type(exc).__name__)
        if status == 200:
            return PeerOutcome(where, True, is_self=_is_self(body))
        return PeerOutcome(where, False, f"HTTP {status}: {_message(body)}")


def self_answer() -> dict[str, object]:
    """What a replica answers a call it fanned out itself (it applied it already)."""
    return {"self": True}


def _is_self(body: bytes) -> bool:
    try:
        return bool(orjson.loads(body) == self_answer())
    except orjson.JSONDecodeError:
        return False


def _message(body: bytes) -> str:
    """The OpenAI-style error message a replica answered, else the start of its body."""
    try:
        parsed = orjson.loads(body)
        message = parsed["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return body[:200].decode("utf-8", "replace")
    return str(message)[:200]
