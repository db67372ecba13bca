"""A Kubernetes Pod, as the API serves it (a JSON object), read as a registry Instance. Pure:
Kubernetes discovery (pdproxy.registry.kubernetes) hands it each pod its watch sees.

What a pod says, each key looked up in its annotations first, then its labels (names
configurable, `PodKeys`): the HTTP port and the KV port (required), the connector kind and the
drain mark (optional), and, in an annotation only (JSON does not fit a label), the KV geometry
as a v1 announcement carries it. The pod IP is the host of both addresses. A pod is ready when
its Ready condition is True and it is not being deleted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdproxy.base.roles import Role
from pdproxy.ids import Address, AddressError, make_address
from pdproxy.registry.messages import Connector, Geometry, Rejected, parse_geometry
from pdproxy.registry.table import Instance, Source

# Values of the drain annotation that do not drain (any other value, empty included, does).
NOT_DRAINED = frozenset({"false", "0", "no"})
_MAX_GEOMETRY_TEXT = 4096


class PodError(ValueError):
    """A pod whose labels or annotations cannot make an instance (the message says which)."""


@dataclass(frozen=True, slots=True)
class PodKeys:
    """The label/annotation names discovery reads (Settings.kubernetes_*)."""

    http_port: str
    kv_port: str
    connector: str
    geometry: str
    drain: str


def pod_name(pod: dict[str, Any]) -> str:
    metadata = _map(pod.get("metadata"))
    return f"{metadata.get('namespace', '?')}/{metadata.get('name', '?')}"


def pod_uid(pod: dict[str, Any]) -> str:
    """The pod's identity across its life (its address may come later than the pod)."""
    uid = _map(pod.get("metadata")).get("uid")
    return uid if isinstance(uid, str) and uid else pod_name(pod)


def instance_from_pod(pod: dict[str, Any], role: Role, keys: PodKeys) -> Instance | None:
    """The instance `pod` serves as `role`; None while it has no IP yet (not scheduled or
    not started: nothing to route to). Raises PodError when its ports or marks are unusable."""
    metadata = _map(pod.get("metadata"))
    status = _map(pod.get("status"))
    ip = status.get("podIP")
    if not isinstance(ip, str) or not ip:
        return None
    labels = _strings(metadata.get("labels"))
    annotations = _strings(metadata.get("annotations"))

    def lookup(key: str) -> str | None:
        return annotations.get(key, labels.get(key))

    http = _address(ip, _port(lookup(keys.http_port), keys.http_port))
    kv = _address(ip, _port(lookup(keys.kv_port), keys.kv_port))
    drain = lookup(keys.drain)
    return Instance(
        role,
        http,
        kv,
        Source.DISCOVERED,
        connector=_connector(lookup(keys.connector), keys.connector),
        geometry=_geometry(annotations.get(keys.geometry), keys.geometry),
        ready=_ready(metadata, status),
        pod_drained=drain is not None and drain.strip().lower() not in NOT_DRAINED,
    )


def _ready(metadata: dict[str, Any], status: dict[str, Any]) -> bool:
    if metadata.get("deletionTimestamp"):
        return False  # terminating: its endpoints are being taken out everywhere
    conditions = status.get("conditions")
    if not isinstance(conditions, list):
        return False
    return any(
        isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True"
        for c in conditions
    )


def _port(text: str | None, key: str) -> int:
    if text is None:
        raise PodError(f"no {key} label or annotation")
    text = text.strip()
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= 65535:
        raise PodError(f"{key} must be a port number, got {text[:40]!r}")
    return int(text)


def _address(ip: str, port: int) -> Address:
    try:
        return make_address(ip, port)
    except AddressError as exc:
        raise PodError(f"pod IP {ip[:64]!r}: {exc}") from None


def _connector(text: str | None, key: str) -> Connector | None:
    if text is None:
        return None
    try:
        return Connector(text.strip())
    except ValueError:
        known = ", ".join(c.value for c in Connector)
        raise PodError(f"{key} must be one of {known}, got {text[:40]!r}") from None


def _geometry(text: str | None, key: str) -> Geometry | None:
    if text is None:
        return None
    if len(text) > _MAX_GEOMETRY_TEXT:
        raise PodError(f"{key} is longer than {_MAX_GEOMETRY_TEXT} characters")
    try:
        return parse_geometry(json.loads(text))
    except json.JSONDecodeError:
        raise PodError(f"{key} must be a JSON map (the v1 announcement's geometry)") from None
    except Rejected as exc:
        raise PodError(f"{key}: {exc}") from None


def _map(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _strings(value: object) -> dict[str, str]:
    return {k: v for k, v in _map(value).items() if isinstance(k, str) and isinstance(v, str)}
