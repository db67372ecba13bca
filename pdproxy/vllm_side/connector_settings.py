"""The connector's settings, read from vLLM's --kv-transfer-config. Pure.

The keys are the ones P2pNcclConnector read (kv_role, kv_port and, in kv_connector_extra_config,
proxy_ip, proxy_port, http_port), so switching a deployment to pdproxy's connector changes only
the connector's name and module; proxy_ip may be a DNS name, and then every address it
resolves to (each proxy replica behind a headless Service) gets the announcements. vLLM 0.32
dropped the top-level kv_ip; where it still exists it is honoured. pdproxy's own extra keys:

- advertise_host (or kv_ip): the address peers and the proxy reach this instance at (default:
  kv_ip, else the local address of this host's route to the registry, else this host's address
  as vLLM itself finds it);
- connector_kind: the kind announced to the registry (default "pdproxy");
- announce_interval: seconds between announcements (default 3);
- prefill_work_report: a prefill's seconds between samples of its work, announced when it
  changed (default 0.01; each report costs every proxy replica tens of microseconds:
  docs/performance.md, "Several replicas");
- record_path: a JSON-lines file recording what the engine showed the connector (tests);
- registry_secret_file: a file holding the registry secret; when set, every v1 message is
  signed with it (pdproxy.registry.auth);
- kv_timeout: seconds a decode instance waits for a request's KV before failing it (30);
- on_missing_kv: "fail" (the request ends with an error) or "recompute" (the decode instance
  computes the prompt itself): sets vLLM's kv_load_failure_policy (default: vLLM's, "fail");
- kv_buffer_ttl: seconds received KV waits for its request before it is freed (60);
- kv_buffer_bytes: cap on KV held for requests that have not come yet (1 GiB);
- kv_send_timeout: seconds a decode rank may take to accept a frame before the send fails (10);
- kv_send_queue_bytes: cap on KV queued for sending (1 GiB);
- kv_send_delay: seconds every frame is held before it is sent (tests only: a window to kill
  a prefill in; 0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdproxy.base.roles import Role
from pdproxy.vllm_side.announcer import DEFAULT_INTERVAL_S, PREFILL_WORK_REPORT_S
from pdproxy.vllm_side.route import local_address_towards

# Where the advertised host came from (logged with it).
HOST_CONFIGURED = "configured"
HOST_ROUTE = "route to the registry"
HOST_DEFAULT = "this host's address"

ROLE_BY_KV_ROLE: dict[str, Role] = {"kv_producer": Role.PREFILL, "kv_consumer": Role.DECODE}
DEFAULT_KV_PORT = 14579  # vLLM's KVTransferConfig default


class ConnectorConfigError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    role: Role | None  # None for kv_both: such an instance is not announced
    host: str
    kv_port: int
    http_port: int | None
    registry: str | None  # "proxy_ip:proxy_port"
    connector_kind: str
    announce_interval_s: float
    prefill_work_report_s: float
    record_path: Path | None
    registry_secret_file: Path | None = None
    kv_timeout_s: float = 30.0
    on_missing_kv: str | None = None
    kv_buffer_ttl_s: float = 60.0
    kv_buffer_bytes: int = 1 << 30
    kv_send_timeout_s: float = 10.0
    kv_send_queue_bytes: int = 1 << 30
    kv_send_delay_s: float = 0.0
    host_origin: str = HOST_CONFIGURED  # which rule chose `host`

    @property
    def zmq_address(self) -> str:
        return f"{self.host}:{self.kv_port}"

    @property
    def http_address(self) -> str | None:
        return None if self.http_port is None else f"{self.host}:{self.http_port}"

    @property
    def announces(self) -> bool:
        return self.role is not None and self.registry is not None and self.http_port is not None


def connector_settings(
    kv_role: str | None,
    kv_ip: str | None,
    kv_port: int | None,
    extra: dict[str, Any] | None,
    default_host: str,
    route: Callable[[str, int], str | None] = local_address_towards,
) -> ConnectorSettings:
    """`default_host`: the host advertised when none is configured and there is no registry
    (or no route to it); `route`: the local address of the route to a registry host and port."""
    extra = dict(extra or {})
    role = ROLE_BY_KV_ROLE.get(kv_role or "")
    proxy_ip, proxy_port = extra.get("proxy_ip"), extra.get("proxy_port")
    if (proxy_ip is None) != (proxy_port is None):
        raise ConnectorConfigError("set both proxy_ip and proxy_port, or neither")
    if proxy_ip is not None and not str(proxy_ip).strip():
        raise ConnectorConfigError("proxy_ip must not be empty")
    registry = None if proxy_ip is None else f"{proxy_ip}:{_port(proxy_port, 'proxy_port')}"
    configured = extra.get("advertise_host") or extra.get("kv_ip") or kv_ip
    if configured:
        host, origin = str(configured), HOST_CONFIGURED
    else:
        routed = None if proxy_ip is None else route(str(proxy_ip), _port(proxy_port, "proxy_port"))
        host, origin = (routed, HOST_ROUTE) if routed else (default_host, HOST_DEFAULT)
    http_port = extra.get("http_port")
    record_path = extra.get("record_path")
    secret_file = extra.get("registry_secret_file")
    if secret_file is not None and not str(secret_file).strip():
        raise ConnectorConfigError("registry_secret_file must not be empty")
    interval = _seconds(extra.get("announce_interval", DEFAULT_INTERVAL_S), "announce_interval")
    return ConnectorSettings(
        role=role,
        host=host,
        host_origin=origin,
        kv_port=_port(DEFAULT_KV_PORT if kv_port is None else kv_port, "kv_port"),
        http_port=None if http_port is None else _port(http_port, "http_port"),
        registry=registry,
        connector_kind=str(extra.get("connector_kind", "pdproxy")),
        announce_interval_s=interval,
        prefill_work_report_s=_seconds(
            extra.get("prefill_work_report", PREFILL_WORK_REPORT_S), "prefill_work_report"
        ),
        record_path=None if record_path is None else Path(str(record_path)),
        registry_secret_file=None if secret_file is None else Path(str(secret_file)),
        kv_timeout_s=_seconds(extra.get("kv_timeout", 30.0), "kv_timeout"),
        on_missing_kv=_choice(extra.get("on_missing_kv"), "on_missing_kv", ("fail", "recompute")),
        kv_buffer_ttl_s=_seconds(extra.get("kv_buffer_ttl", 60.0), "kv_buffer_ttl"),
        kv_buffer_bytes=_size(extra.get("kv_buffer_bytes", 1 << 30), "kv_buffer_bytes"),
        kv_send_timeout_s=_seconds(extra.get("kv_send_timeout", 10.0), "kv_send_timeout"),
        kv_send_queue_bytes=_size(extra.get("kv_send_queue_bytes", 1 << 30), "kv_send_queue_bytes"),
        kv_send_delay_s=_delay(extra.get("kv_send_delay", 0.0)),
    )


def _choice(value: object, name: str, allowed: tuple[str, ...]) -> str | None:
    if value is None:
        return None
    if value not in allowed:
        raise ConnectorConfigError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    return str(value)


def _size(value: object, name: str) -> int:
    try:
        size = int(str(value))
    except ValueError:
        raise ConnectorConfigError(f"{name} must be a number of bytes, got {value!r}") from None
    if size < 1:
        raise ConnectorConfigError(f"{name} must be positive, got {size}")
    return size


def _delay(value: object) -> float:
    return 0.0 if value in (0, 0.0, "0", None) else _seconds(value, "kv_send_delay")


MAX_INTERVAL_S = 3600.0


def _seconds(value: object, name: str) -> float:
    try:
        seconds = float(str(value))
    except ValueError:
        raise ConnectorConfigError(f"{name} must be a number of seconds, got {value!r}") from None
    if not 0 < seconds <= MAX_INTERVAL_S:
        raise ConnectorConfigError(f"{name} must be in (0, {MAX_INTERVAL_S:g}], got {value!r}")
    return seconds


def _port(value: object, name: str) -> int:
    try:
        port = int(str(value))
    except ValueError:
        raise ConnectorConfigError(f"{name} must be a port number, got {value!r}") from None
    if not 0 < port < 65536:
        raise ConnectorConfigError(f"{name} must be in 1..65535, got {port}")
    return port
