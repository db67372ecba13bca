"""The one Settings object every part of the proxy reads.

Precedence, lowest first: defaults, the YAML file given with --config, PDPROXY_<NAME>
environment variables, command-line flags. The CLI flags are generated from the fields below, so
`pdproxy serve --help` documents every option and no option exists in one place only.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import os
import typing
from collections.abc import Mapping
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from pdproxy.base.endpoints import parse_endpoint
from pdproxy.base.roles import WIRE_LETTERS, Role
from pdproxy.base.secret_file import MIN_SECRET_BYTES, read_secret_file
from pdproxy.ids import Address, AddressError, parse_address
from pdproxy.pairing.policies import DecodePolicyName, PrefillPolicyName
from pdproxy.registry.auth import AuthConfigError, parse_cidrs
from pdproxy.registry.messages import (
    GEOMETRY_LIMITS,
    MAX_DTYPE_NAME,
    MAX_ENGINE_ID,
    MAX_MODEL_LEN,
    Connector,
    Geometry,
    KvCoordinates,
    missing_coordinates,
)

ENV_PREFIX = "PDPROXY_"
MiB = 1024 * 1024


# The registry's geometry fields, each a key of a static instance too (same names and bounds as
# an announcement's), so that a fleet that does not announce is still paired by geometry.
_GEOMETRY_KEYS = tuple(f.name for f in dataclass_fields(Geometry))
# A prefill's connector coordinates (mooncake: bootstrap; nixl_push: engine_id, side_channel).
_COORDINATE_KEYS = ("bootstrap", "engine_id", "side_channel")
_INSTANCE_KEYS = (
    "http",
    "zmq",
    "model",
    "max_model_len",
    "connector",
    *_COORDINATE_KEYS,
    *_GEOMETRY_KEYS,
)
_INSTANCE_SYNTAX = (
    "http=HOST:PORT,zmq=HOST:PORT[,model=NAME][,max_model_len=N][,connector=KIND]"
    "[,bootstrap=HOST:PORT][,engine_id=ID][,side_channel=HOST:PORT]"
    f"[,GEOMETRY=VALUE...] (connector: {'|'.join(c.value for c in Connector)}; "
    f"geometry: {', '.join(_GEOMETRY_KEYS)})"
)


def _bound(name: str) -> Any:
    return Field(None, ge=1, le=GEOMETRY_LIMITS[name])


class StaticInstance(BaseModel):
    """An instance the operator configured; it never expires.

    Written on the command line as `http=HOST:PORT,zmq=HOST:PORT[,model=NAME][,KEY=VALUE...]`
    with the keys of `_INSTANCE_KEYS`; in YAML as a map of the same keys.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    http: str
    zmq: str
    model: str | None = Field(None, min_length=1, max_length=256)
    # The context length the instance runs its model with (vLLM's --max-model-len): with it,
    # the proxy refuses requests for more output tokens itself, before any prefill.
    max_model_len: int | None = Field(None, ge=1, le=MAX_MODEL_LEN)
    # What an announcement would say: the KV connector, where a mooncake or nixl_push prefill's
    # connector is reached, and the KV cache geometry.
    connector: Connector | None = None
    bootstrap: str | None = None
    engine_id: str | None = Field(None, min_length=1, max_length=MAX_ENGINE_ID)
    side_channel: str | None = None
    tp_size: int | None = _bound("tp_size")
    block_size: int | None = _bound("block_size")
    num_layers: int | None = _bound("num_layers")
    num_kv_heads: int | None = _bound("num_kv_heads")
    head_dim: int | None = _bound("head_dim")
    kv_dtype: str | None = Field(None, min_length=1, max_length=MAX_DTYPE_NAME)
    is_mla: bool | None = None
    kv_layout: Literal["NHD", "HND"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        fields: dict[str, str] = {}
        for part in value.split(","):
            key, sep, item = part.strip().partition("=")
            if not sep or key not in _INSTANCE_KEYS or key in fields:
                raise ValueError(f"bad instance {value!r}: expected {_INSTANCE_SYNTAX}")
            fields[key] = item
        return fields

    @property
    def geometry(self) -> Geometry | None:
        """The geometry fields given, as the registry holds them; None when none is."""
        given = {key: getattr(self, key) for key in _GEOMETRY_KEYS}
        if all(value is None for value in given.values()):
            return None
        return Geometry(**given)

    @model_validator(mode="after")
    def _addresses_valid(self) -> StaticInstance:
        for key in ("http", "zmq", "bootstrap", "side_channel"):
            text = getattr(self, key)
            if text is None:
                continue
            try:
                parse_address(text)
            except AddressError as exc:
                raise ValueError(f"{key} address: {exc}") from None
        return self

    @property
    def coordinates(self) -> KvCoordinates | None:
        if self.bootstrap is None and self.engine_id is None and self.side_channel is None:
            return None
        return KvCoordinates(
            bootstrap=None if self.bootstrap is None else parse_address(self.bootstrap),
            engine_id=self.engine_id,
            side_channel=None if self.side_channel is None else parse_address(self.side_channel),
        )

    def missing_prefill_coordinates(self) -> str:
        """What this instance lacks to be a routable prefill of its connector ("" if none)."""
        return missing_coordinates(self.connector, self.coordinates)

    @property
    def http_address(self) -> Address:
        return parse_address(self.http)

    @property
    def zmq_address(self) -> Address:
        return parse_address(self.zmq)


def _secret_of_file(path: Path) -> str:
    # read_secret_file's SecretError is a ValueError: pydantic reports it as the field's.
    return read_secret_file(path).decode("utf-8", "replace")


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field("0.0.0.0", description="HTTP bind address.")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port.")
    registry_bind: str = Field(
        "tcp://0.0.0.0:30001",
        description="Address the registry listens on for workers' announcements (vLLM's "
        "proxy_ip:proxy_port): [tcp://]HOST:PORT, `*` or 0.0.0.0 for every interface.",
    )
    ttl: float = Field(
        10.0, gt=0, description="Seconds without a message after which an instance expires."
    )
    prefill: list[StaticInstance] = Field(
        default_factory=list,
        description=f"Static prefill instance {_INSTANCE_SYNTAX}; repeatable; never expires.",
    )
    decode: list[StaticInstance] = Field(
        default_factory=list,
        description=f"Static decode instance {_INSTANCE_SYNTAX}; repeatable; never expires.",
    )
    max_instances: int = Field(4096, ge=1, description="Cap on registered instances.")
    registry_max_message_bytes: int = Field(
        65536, ge=256, description="Registry frames larger than this are dropped by ZMQ."
    )
    registry_secret: SecretStr | None = Field(
        None,
        description="Shared secret (at least 16 characters) workers sign v1 registry messages "
        "with (HMAC-SHA256); when set, unsigned or badly signed v1 messages are refused. As a "
        "flag it is visible in `ps`: prefer registry_secret_file or the environment.",
    )
    registry_secret_file: Path | None = Field(
        None, description="File holding the registry secret (surrounding whitespace ignored)."
    )
    registry_allow_unsigned_v0: bool = Field(
        False,
        description="With registry_secret set, still accept unsigned v0 announcements (stock "
        "vLLM cannot sign); without a secret everything is accepted anyway.",
    )
    registry_max_unsigned_instances: int = Field(
        0,
        ge=0,
        description="With registry_secret set: cap on instances registered by unsigned v0 "
        "announcements, apart from max_instances, so they never take signed instances' room; "
        "0: a quarter of max_instances (at least 1).",
    )
    registry_v0_cidrs: list[str] = Field(
        default_factory=list,
        description="CIDR (repeatable, or comma-separated) a v0 announcement must come from "
        "(the connection's address) and its addresses fall in; none: any.",
    )
    registry_address_cidrs: list[str] = Field(
        default_factory=list,
        description="CIDR (repeatable, or comma-separated) every announced http and zmq "
        "address must fall in (host names are then refused); none: any.",
    )
    registry_max_skew_seconds: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="How far a signed message's timestamp may be from the proxy's clock.",
    )
    discovery: Literal["registry", "kubernetes"] = Field(
        "registry",
        description="Where instances come from besides the static ones: registry (their "
        "announcements) or kubernetes (also Pods watched by label selector, needs the "
        "`kubernetes` extra: only Ready pods are routed to, deleted ones leave at once; "
        "announcements still add model, geometry and load).",
    )
    kubernetes_namespace: str = Field(
        "",
        max_length=63,
        description="Namespace whose pods Kubernetes discovery watches; empty: the proxy's own "
        "(its service account's), else `default`.",
    )
    kubernetes_prefill_selector: str = Field(
        "app.kubernetes.io/component=prefill",
        min_length=1,
        max_length=1024,
        description="Label selector of the prefill pods (Kubernetes discovery).",
    )
    kubernetes_decode_selector: str = Field(
        "app.kubernetes.io/component=decode",
        min_length=1,
        max_length=1024,
        description="Label selector of the decode pods (Kubernetes discovery).",
    )
    kubernetes_http_port_annotation: str = Field(
        "pdproxy.io/http-port",
        min_length=1,
        max_length=253,
        description="Pod annotation (or label) holding the vLLM HTTP port (Kubernetes "
        "discovery; a pod without it is not routed to).",
    )
    kubernetes_kv_port_annotation: str = Field(
        "pdproxy.io/kv-port",
        min_length=1,
        max_length=253,
        description="Pod annotation (or label) holding the KV port (rank 0's; the zmq address "
        "of the request id).",
    )
    kubernetes_connector_annotation: str = Field(
        "pdproxy.io/connector",
        min_length=1,
        max_length=253,
        description="Pod annotation (or label) naming the connector kind: p2p_nccl, nixl or "
        "pdproxy (optional: else what the pod announces).",
    )
    kubernetes_geometry_annotation: str = Field(
        "pdproxy.io/geometry",
        min_length=1,
        max_length=253,
        description="Pod annotation holding the KV geometry as JSON, as a v1 announcement "
        "carries it (optional: else what the pod announces).",
    )
    kubernetes_drain_annotation: str = Field(
        "pdproxy.io/drain",
        min_length=1,
        max_length=253,
        description="Pod annotation (or label) that drains the pod in every proxy replica: no "
        "new requests while it is there, unless its value is false, 0 or no.",
    )
    max_body_bytes: int = Field(
        32 * MiB, ge=1024, description="Largest request body accepted (413 above)."
    )
    max_response_bytes: int = Field(
        64 * MiB, ge=1024, description="Largest non-streaming upstream answer relayed."
    )
    upstream_api_key: SecretStr | None = Field(
        None,
        description="Bearer key sent to P and D instead of the client's Authorization header.",
    )
    connect_timeout: float = Field(5.0, gt=0, description="Seconds to connect to an instance.")
    prefill_timeout: float = Field(
        600.0, gt=0, description="Seconds the whole prefill leg may take (long prompts are slow)."
    )
    decode_first_byte_timeout: float = Field(
        120.0,
        gt=0,
        description="Seconds until the decode leg's first body byte (bounds a KV handoff hang; "
        "with both legs at once, counted from the prefill's answer).",
    )
    decode_timeout: float = Field(
        600.0,
        gt=0,
        description="Seconds a non-streaming decode leg may take (its answer comes whole).",
    )
    stream_idle_timeout: float = Field(
        120.0, gt=0, description="Seconds allowed between two chunks of the decode stream."
    )
    request_timeout: float = Field(
        3600.0, gt=0, description="Seconds a whole request may take, both legs included."
    )
    body_timeout: float = Field(
        60.0,
        gt=0,
        description="Seconds a client may take to send its request body (408 after; it holds "
        "an admission slot meanwhile).",
    )
    retry_after_seconds: int = Field(
        2, ge=1, description="Retry-After sent with 503 when no pair can serve a request."
    )
    upstream_max_connections: int = Field(
        4096,
        ge=1,
        description="Cap on upstream exchanges in flight, all instances together; a held "
        "stream keeps one for its whole life, so this also caps concurrent streams.",
    )
    workers: int = Field(
        1,
        ge=1,
        le=64,
        description="HTTP worker processes sharing the port (SO_REUSEPORT). Above 1, a "
        "registry process owns the table and publishes it to the workers; metrics are summed "
        "over all of them.",
    )
    backlog: int = Field(
        2048,
        ge=1,
        le=65535,
        description="Listen backlog of the HTTP socket (the kernel caps it at somaxconn).",
    )
    otel_exporter: Literal["none", "otlp", "console"] = Field(
        "none",
        description="OpenTelemetry spans for each request and its prefill and decode legs "
        "(needs the `otel` extra): otlp (configured by OTEL_EXPORTER_OTLP_* variables) or "
        "console; W3C traceparent is passed to vLLM either way.",
    )
    prefill_policy: PrefillPolicyName = Field(
        "prefix_affinity",
        description="How a prefill instance is chosen among compatible ones: round_robin, "
        "least_loaded, power_of_two or prefix_affinity.",
    )
    decode_policy: DecodePolicyName = Field(
        "least_kv",
        description="How a decode instance is chosen among compatible ones: round_robin, "
        "least_loaded, power_of_two or least_kv.",
    )
    prefix_affinity_tokens: int = Field(
        256,
        ge=1,
        le=65536,
        description="Leading prompt tokens (about 4 characters each) that identify a prefix "
        "for prefix_affinity.",
    )
    prefix_affinity_load_factor: float = Field(
        1.25,
        ge=1.0,
        le=100.0,
        description="prefix_affinity passes over a prefill holding more than this many times "
        "the mean load (bounded-load consistent hashing).",
    )
    decode_kv_capacity_tokens: int = Field(
        262144,
        ge=1,
        description="KV capacity of one decode instance in tokens; least_kv weighs tokens in "
        "flight against announced kv_usage with it.",
    )
    allow_unknown_geometry: bool = Field(
        False,
        description="Pair an instance of unknown KV geometry (v0) with one whose geometry is "
        "known (normally they pair only with each other).",
    )
    disagg_min_tokens: int = Field(
        0,
        ge=0,
        description="Prompts estimated shorter than this go straight to a decode instance that "
        "can compute them itself (nixl or pdproxy connector), with no prefill leg; 0: never.",
    )
    concurrent_decode_connectors: list[Connector] = Field(
        default_factory=lambda: [Connector.PDPROXY, Connector.MOONCAKE, Connector.NIXL_PUSH],
        description="Connector kinds (p2p_nccl, pdproxy, mooncake, nixl_push; repeatable, or "
        "comma-separated) whose pairs get the decode leg at the same time as the prefill leg "
        "instead of after its answer: saves the decode leg's way in from the time to first "
        "token. Only for connectors that load KV asynchronously (pdproxy, mooncake, nixl_push): "
        "p2p_nccl's decode blocks its forward pass until the KV arrived; nixl is refused (its "
        "decode needs the prefill's answer).",
    )
    bootstrap_query_timeout: float = Field(
        5.0,
        gt=0,
        le=600,
        description="Seconds a mooncake prefill's bootstrap server may take to answer /query "
        "(its engine id, asked once per prefill and cached); past it the prefill counts as "
        "failed (bootstrap_query) and the request is retried.",
    )
    max_attempts: int = Field(
        3,
        ge=1,
        le=10,
        description="Attempts per request: a prefill leg that fails before answering (refused, "
        "reset, timeout, 5xx) is retried on another compatible prefill, a decode leg that "
        "fails before its first byte with a new pair; never after a byte reached the client, "
        "never on 4xx.",
    )
    migration: Literal["on", "off"] = Field(
        "on",
        description="Request migration: a streamed answer whose decode fails after bytes reached "
        "the client (reset, closed, idle timeout, a malformed or cut event) is continued on "
        "another pair from the prompt's token ids plus those generated so far, as the rest "
        "of the same answer (docs/reference/reliability.md says what a client can observe).",
    )
    migration_limit: int = Field(
        3,
        ge=0,
        le=10,
        description="Migrations per request at most (a continuation that fails too is migrated "
        "again, within the request's deadline); 0 is the same as migration off.",
    )
    migration_whole_min_tokens: int = Field(
        256,
        ge=0,
        description="With migration on, a whole (non-streamed) answer that may run this many "
        "output tokens or more is read from its decode as a stream, so that it can be "
        "continued too; a shorter one is computed again from its prompt if its decode fails. "
        "0: every whole answer.",
    )
    retry_backoff_base_seconds: float = Field(
        0.025,
        ge=0,
        le=60,
        description="Wait before the first retry; doubles per retry, with jitter.",
    )
    retry_backoff_max_seconds: float = Field(
        1.0, ge=0, le=600, description="Longest wait between two attempts."
    )
    outlier_consecutive_failures: int = Field(
        5,
        ge=1,
        description="Failures in a row (connection, timeout, 5xx) that eject an instance "
        "from routing.",
    )
    outlier_base_ejection_seconds: float = Field(
        5.0,
        gt=0,
        description="First ejection's cool-down; each repeated ejection doubles it. After it "
        "the instance is half-open: one success brings it back, one failure ejects it again.",
    )
    outlier_max_ejection_seconds: float = Field(
        300.0, gt=0, description="Longest cool-down of an ejected instance."
    )
    outlier_max_ejection_percent: int = Field(
        50,
        ge=0,
        le=100,
        description="At most this share of a role's instances is ejected at a time (retries "
        "route around the others).",
    )
    health_check_interval: float = Field(
        0.0,
        ge=0,
        description="Seconds between active GET /health probes of every registered instance; "
        "failures count toward ejection, a success closes a half-open circuit; 0: off.",
    )
    health_check_timeout: float = Field(
        2.0, gt=0, description="Seconds an active /health probe may take."
    )
    max_inflight_requests: int = Field(
        10000,
        ge=1,
        description="Completion requests served at once; more wait in a bounded queue "
        "(with several workers: per worker).",
    )
    max_queued_requests: int = Field(
        1000,
        ge=0,
        description="Requests waiting for a slot (proxy-wide or on a full instance); beyond "
        "it 429 with Retry-After. With several workers: per worker.",
    )
    queue_timeout: float = Field(
        10.0,
        gt=0,
        description="Seconds a request may wait for a slot before 503 with Retry-After.",
    )
    instance_max_inflight: int = Field(
        0,
        ge=0,
        description="Legs in flight on one instance before it is passed over (requests then "
        "wait in the queue for one to free up); 0: no cap. With several workers: per worker.",
    )
    drain_seconds: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM: /ready turns 503 and new requests are refused at once; "
        "requests in flight get this long to finish before the process exits.",
    )
    passthrough_role: list[str] = Field(
        default_factory=list,
        description="Which role serves a passed-through path (vLLM's endpoints other than "
        "completions and chat, e.g. /tokenize, /v1/embeddings), as PATH=ROLE (e.g. "
        "/tokenize=prefill; repeatable, or comma-separated); paths not named go to a decode "
        "instance.",
    )
    passthrough_unknown_paths: bool = Field(
        False,
        description="Pass paths pdproxy does not know through to an instance (decode, unless "
        "passthrough_role names the path) instead of answering 404.",
    )
    api_key: list[SecretStr] = Field(
        default_factory=list,
        description="Client API key (repeatable; env: several separated by ';'); when any is "
        "set, completion and model endpoints need `Authorization: Bearer KEY`. As a flag it "
        "is visible in `ps`: prefer api_key_file or the environment.",
    )
    api_key_file: Path | None = Field(
        None, description="File with client API keys, one per line (# comments allowed)."
    )
    open_paths: list[str] = Field(
        default_factory=lambda: ["/health", "/ready", "/metrics"],
        description="Paths served without an API key when keys are configured (repeatable).",
    )
    admin_token: SecretStr | None = Field(
        None,
        description="Bearer token for admin endpoints (registering, removing and draining "
        "instances); without one they answer 403. As a flag it is visible in `ps`: prefer "
        "admin_token_file or the environment.",
    )
    admin_token_file: Path | None = Field(
        None, description="File holding the admin token (its first line)."
    )
    peers_dns: str = Field(
        "",
        max_length=253,
        pattern=r"^([A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?)?$",
        description="DNS name resolving to every replica of this proxy (a headless Service): "
        "an admin drain, undrain or removal is then applied by each of them (at this proxy's "
        "port, with the same admin token) and the answer says which did. Empty: off.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level."
    )
    log_format: Literal["text", "json"] = Field(
        "text",
        description="text: human-readable lines; json: one JSON object per line.",
    )
    access_log: bool = Field(
        True,
        description="One line per request on the pdproxy.access logger (ids, chosen pair, "
        "leg timings, outcome): key=value pairs in text, fields of the JSON object in json.",
    )

    @property
    def unsigned_instance_cap(self) -> int | None:
        """How many instances unsigned v0 announcements may hold, apart from max_instances;
        None without a secret (nothing is signed then: one cap for all, as ever)."""
        if not self.registry_signed:
            return None
        return self.registry_max_unsigned_instances or max(1, self.max_instances // 4)

    @field_validator(
        "registry_v0_cidrs",
        "registry_address_cidrs",
        "open_paths",
        "concurrent_decode_connectors",
        "passthrough_role",
        mode="before",
    )
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        """Each item may hold several, comma-separated (one env variable, one flag)."""
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            return value
        return [part.strip() for item in value for part in str(item).split(",") if part.strip()]

    @field_validator("registry_bind")
    @classmethod
    def _registry_endpoint(cls, value: str) -> str:
        # One syntax for every command: tcp:// optional; stored as what ZMQ binds.
        return parse_endpoint(value, wildcard=True).zmq()

    @field_validator("registry_v0_cidrs", "registry_address_cidrs")
    @classmethod
    def _cidrs_valid(cls, value: list[str]) -> list[str]:
        try:
            return [str(network) for network in parse_cidrs(value)]
        except AuthConfigError as exc:
            raise ValueError(f"{exc} (expected e.g. 10.0.0.0/8 or fd00::/8)") from None

    @model_validator(mode="after")
    def _secret_file_readable(self) -> Settings:
        if self.registry_secret_file is not None:
            if self.registry_secret is not None:
                raise ValueError("give registry_secret or registry_secret_file, not both")
            _secret_of_file(self.registry_secret_file)
        return self

    @property
    def registry_signed(self) -> bool:
        """Whether a registry secret is set, directly or in a file (without reading it)."""
        return self.registry_secret is not None or self.registry_secret_file is not None

    @property
    def registry_key(self) -> SecretStr | None:
        """The registry secret, given directly or in registry_secret_file (read at start-up
        only: a few reads of a small file)."""
        if self.registry_secret_file is None:
            return self.registry_secret
        return SecretStr(_secret_of_file(self.registry_secret_file))

    @field_validator("registry_secret", "admin_token", mode="before")
    @classmethod
    def _strip_secret(cls, value: Any) -> Any:
        # A secret mounted from a file or a Kubernetes Secret usually ends with a newline the
        # workers (which strip theirs) never sign with.
        return value.strip() if isinstance(value, str) else value

    @field_validator("registry_secret")
    @classmethod
    def _secret_long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value().encode()) < MIN_SECRET_BYTES:
            raise ValueError(f"must be at least {MIN_SECRET_BYTES} characters")
        return value

    @model_validator(mode="after")
    def _connect_within_leg_timeouts(self) -> Settings:
        # Connecting (and waiting for a free upstream slot) happens inside every leg's bound;
        # a leg bound shorter than it would blame instances for the proxy's own waiting.
        for name in (
            "prefill_timeout",
            "decode_first_byte_timeout",
            "decode_timeout",
            "request_timeout",
        ):
            if getattr(self, name) <= self.connect_timeout:
                raise ValueError(f"{name} must be longer than connect_timeout")
        return self

    @model_validator(mode="after")
    def _static_instances_distinct(self) -> Settings:
        # The table keys instances by HTTP address: a second spec would silently replace the
        # first (or turn a prefill into a decode).
        seen: dict[str, str] = {}
        for role, specs in (("prefill", self.prefill), ("decode", self.decode)):
            for spec in specs:
                if spec.http in seen:
                    raise ValueError(
                        f"static instance {spec.http} is given twice (as {seen[spec.http]} "
                        f"and as {role})"
                    )
                seen[spec.http] = role
        return self

    @model_validator(mode="after")
    def _static_prefills_reachable(self) -> Settings:
        # A mooncake/nixl_push decode leg names its prefill's connector: without its
        # coordinates no request could be routed to that prefill.
        for spec in self.prefill:
            missing = spec.missing_prefill_coordinates()
            if missing:
                assert spec.connector is not None
                raise ValueError(
                    f"static prefill {spec.http}: a {spec.connector.value} prefill needs {missing}"
                )
        return self

    @model_validator(mode="after")
    def _discovery_installed(self) -> Settings:
        if (
            self.discovery == "kubernetes"
            and importlib.util.find_spec("kubernetes_asyncio") is None
        ):
            raise ValueError(
                "discovery kubernetes needs the `kubernetes` extra: "
                "pip install 'pdproxy[kubernetes]'"
            )
        return self

    @model_validator(mode="after")
    def _ranges_ordered(self) -> Settings:
        if self.retry_backoff_base_seconds > self.retry_backoff_max_seconds:
            raise ValueError("retry_backoff_base_seconds must not exceed retry_backoff_max_seconds")
        if self.outlier_base_ejection_seconds > self.outlier_max_ejection_seconds:
            raise ValueError(
                "outlier_base_ejection_seconds must not exceed outlier_max_ejection_seconds"
            )
        return self

    @field_validator("api_key", mode="before")
    @classmethod
    def _one_key_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("api_key")
    @classmethod
    def _keys_usable(cls, value: list[SecretStr]) -> list[SecretStr]:
        for key in value:
            text = key.get_secret_value()
            if not text or text != text.strip() or any(c.isspace() for c in text):
                raise ValueError("an API key must be non-empty and contain no whitespace")
        return value

    @field_validator("concurrent_decode_connectors")
    @classmethod
    def _connectors_can_overlap(cls, value: list[Connector]) -> list[Connector]:
        if Connector.NIXL in value:
            raise ValueError(
                "nixl cannot run its legs concurrently: its decode leg carries the "
                "kv_transfer_params of the prefill's answer"
            )
        return list(dict.fromkeys(value))

    @field_validator("open_paths")
    @classmethod
    def _paths_absolute(cls, value: list[str]) -> list[str]:
        for path in value:
            if not path.startswith("/"):
                raise ValueError(f"open path {path!r} must start with /")
        return value

    @field_validator("passthrough_role")
    @classmethod
    def _passthrough_roles_valid(cls, value: list[str]) -> list[str]:
        passthrough_roles(value)  # raises ValueError, with the item at fault
        return value


def passthrough_roles(items: list[str]) -> dict[str, Role]:
    """`PATH=ROLE` items (ROLE: prefill or decode, or P or D) as a table; a later item for the
    same path wins, as a later flag does."""
    roles: dict[str, Role] = {}
    for item in items:
        path, sep, name = item.partition("=")
        path, name = path.strip(), name.strip()
        if not sep or not path.startswith("/") or any(c.isspace() for c in path):
            raise ValueError(f"{item[:100]!r} is not PATH=ROLE with an absolute PATH")
        try:
            roles[path] = Role.from_wire(name) if name in WIRE_LETTERS else Role(name)
        except ValueError:
            raise ValueError(
                f"{item[:100]!r}: the role is prefill or decode, not {name[:16]!r}"
            ) from None
    return roles


class ConfigError(ValueError):
    """Settings could not be built; the message says which source and why."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


_LIST_METAVARS = {
    "concurrent_decode_connectors": "CONNECTOR",
    "registry_v0_cidrs": "CIDR",
    "registry_address_cidrs": "CIDR",
    "api_key": "KEY",
    "open_paths": "PATH",
    "passthrough_role": "PATH=ROLE",
}
_LIST_FIELDS = (
    "prefill",
    "decode",
    "registry_v0_cidrs",
    "registry_address_cidrs",
    "api_key",
    "open_paths",
    "concurrent_decode_connectors",
    "passthrough_role",
)


def _is_list(name: str) -> bool:
    return name in _LIST_FIELDS


# `serve --help` in sections; every setting in exactly one (settings_groups checks).
SETTING_GROUPS: dict[str, tuple[str, ...]] = {
    "HTTP": (
        "host",
        "port",
        "workers",
        "backlog",
        "max_body_bytes",
        "max_response_bytes",
        "body_timeout",
        "passthrough_role",
        "passthrough_unknown_paths",
    ),
    "registry and discovery": (
        "registry_bind",
        "ttl",
        "prefill",
        "decode",
        "max_instances",
        "registry_max_message_bytes",
        "discovery",
        "kubernetes_namespace",
        "kubernetes_prefill_selector",
        "kubernetes_decode_selector",
        "kubernetes_http_port_annotation",
        "kubernetes_kv_port_annotation",
        "kubernetes_connector_annotation",
        "kubernetes_geometry_annotation",
        "kubernetes_drain_annotation",
        "peers_dns",
    ),
    "pairing": (
        "prefill_policy",
        "decode_policy",
        "prefix_affinity_tokens",
        "prefix_affinity_load_factor",
        "decode_kv_capacity_tokens",
        "allow_unknown_geometry",
        "disagg_min_tokens",
        "concurrent_decode_connectors",
        "bootstrap_query_timeout",
    ),
    "timeouts, retries and limits": (
        "connect_timeout",
        "prefill_timeout",
        "decode_first_byte_timeout",
        "decode_timeout",
        "stream_idle_timeout",
        "request_timeout",
        "retry_after_seconds",
        "upstream_max_connections",
        "max_attempts",
        "migration",
        "migration_limit",
        "migration_whole_min_tokens",
        "retry_backoff_base_seconds",
        "retry_backoff_max_seconds",
        "outlier_consecutive_failures",
        "outlier_base_ejection_seconds",
        "outlier_max_ejection_seconds",
        "outlier_max_ejection_percent",
        "health_check_interval",
        "health_check_timeout",
        "max_inflight_requests",
        "max_queued_requests",
        "queue_timeout",
        "instance_max_inflight",
        "drain_seconds",
    ),
    "security": (
        "api_key",
        "api_key_file",
        "open_paths",
        "admin_token",
        "admin_token_file",
        "upstream_api_key",
        "registry_secret",
        "registry_secret_file",
        "registry_allow_unsigned_v0",
        "registry_max_unsigned_instances",
        "registry_v0_cidrs",
        "registry_address_cidrs",
        "registry_max_skew_seconds",
    ),
    "observability": ("log_level", "log_format", "access_log", "otel_exporter"),
}


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per Settings field, in sections; defaults are suppressed so unset flags don't
    override; a field whose values are a fixed set lists them."""
    parser.add_argument(
        "--config", metavar="FILE", default=None, help="YAML file with any of the settings below."
    )
    grouped = [name for names in SETTING_GROUPS.values() for name in names]
    if sorted(grouped) != sorted(Settings.model_fields):
        raise RuntimeError("SETTING_GROUPS must name every setting exactly once")
    for title, names in SETTING_GROUPS.items():
        _add_group(parser.add_argument_group(f"{title} settings"), names)


def _add_group(parser: argparse._ArgumentGroup, names: tuple[str, ...]) -> None:
    for name in names:
        field = Settings.model_fields[name]
        default = field.get_default(call_default_factory=True)
        shown = "" if isinstance(default, list) or default is None else f" (default: {default})"
        help_text = f"{field.description}{shown} [env {ENV_PREFIX}{name.upper()}]"
        if field.annotation is bool:
            # A bare `--flag` means true; `--flag false` is accepted too.
            parser.add_argument(
                _flag(name),
                dest=name,
                nargs="?",
                const="true",
                default=argparse.SUPPRESS,
                metavar="BOOL",
                help=help_text.replace("%", "%%"),
            )
            continue
        choices = _choices(field.annotation)
        metavar = name.upper() if not _is_list(name) else _LIST_METAVARS.get(name, "SPEC")
        parser.add_argument(
            _flag(name),
            dest=name,
            action="append" if _is_list(name) else "store",
            default=argparse.SUPPRESS,
            choices=choices,
            metavar="{" + ",".join(choices) + "}" if choices else metavar,
            help=help_text.replace("%", "%%"),
        )


def _choices(annotation: Any) -> list[str] | None:
    """The values of a Literal field (its optional form too), as flag choices."""
    if typing.get_origin(annotation) is typing.Literal:
        return [str(value) for value in typing.get_args(annotation)]
    return None


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name in Settings.model_fields:
        raw = environ.get(f"{ENV_PREFIX}{name.upper()}")
        if raw is None:
            continue
        if _is_list(name):
            values[name] = _list_from_env(name, raw.strip())
        else:
            values[name] = raw
    return values


def _list_from_env(name: str, text: str) -> Any:
    """A JSON list, or items separated by ';' or newlines."""
    if text.startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{ENV_PREFIX}{name.upper()}: not a valid JSON list: {exc}") from None
    return [item.strip() for item in text.replace("\n", ";").split(";") if item.strip()]


def _from_yaml(path: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {path}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of settings")
    return {str(key).replace("-", "_"): value for key, value in data.items()}


def load_settings(
    args: argparse.Namespace | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Merge defaults < YAML < env < flags into one validated Settings."""
    environ = os.environ if environ is None else environ
    flags = dict(vars(args)) if args is not None else {}
    config_path = flags.pop("config", None) or environ.get(f"{ENV_PREFIX}CONFIG")
    merged: dict[str, Any] = {}
    sources: list[tuple[str, dict[str, Any]]] = []
    if config_path:
        sources.append((f"config file {config_path}", _from_yaml(config_path)))
    sources.append(("environment", _from_env(environ)))
    sources.append(("flags", {k: v for k, v in flags.items() if k in Settings.model_fields}))
    for _, values in sources:
        merged.update(values)
    try:
        return Settings.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, sources)) from None


# pydantic's own words before a validator's message: not the user's concern.
_PYDANTIC_PREFIXES = ("Value error, ", "Assertion failed, ")


def _describe(exc: ValidationError, sources: list[tuple[str, dict[str, Any]]]) -> str:
    """One line per error, naming where the value came from (the last source that set it
    wins) and, for a name no setting has, the closest one that exists."""
    lines = []
    for error in exc.errors():
        loc = [str(part) for part in error["loc"]]
        name = loc[0] if loc else ""
        message = str(error["msg"])
        for prefix in _PYDANTIC_PREFIXES:
            message = message.removeprefix(prefix)
        if error["type"] == "extra_forbidden":
            close = difflib.get_close_matches(name, list(Settings.model_fields), n=1)
            message = "no such setting" + (f" (did you mean {close[0]!r}?)" if close else "")
        origin = next((label for label, values in reversed(sources) if name in values), None)
        if not loc:  # a rule across several settings
            lines.append(message)
        elif origin is None:
            lines.append(f"{'.'.join(loc)}: {message}")
        else:
            lines.append(f"{'.'.join(loc)} ({_origin(name, origin)}): {message}")
    return "invalid settings: " + "; ".join(lines)


def _origin(name: str, source: str | None) -> str:
    if source == "flags":
        return "flag --" + name.replace("_", "-")
    if source == "environment":
        return f"environment {ENV_PREFIX}{name.upper()}"
    return str(source)
