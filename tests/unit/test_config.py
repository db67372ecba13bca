"""pdproxy.config: defaults < YAML (--config) < PDPROXY_* env < flags, and refusals that name
the field."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from pdproxy.base.roles import Role
from pdproxy.cli import build_parser
from pdproxy.config import ENV_PREFIX, ConfigError, Settings, StaticInstance, load_settings
from pdproxy.ids import Address
from pdproxy.registry.messages import GEOMETRY_LIMITS, Connector, Geometry
from pdproxy.registry.seeded import static_instances

GEOMETRY_FIELDS = tuple(f.name for f in dataclasses.fields(Geometry))

P1 = "http=10.0.0.1:8100,zmq=10.0.0.1:21001"
P2 = "http=10.0.0.2:8100,zmq=10.0.0.2:21001,model=m"
D1 = "http=10.0.1.1:8200,zmq=10.0.1.1:22001"


def static(http: str, zmq: str, model: str | None = None) -> StaticInstance:
    return StaticInstance(http=http, zmq=zmq, model=model)


SP1 = static("10.0.0.1:8100", "10.0.0.1:21001")
SP2 = static("10.0.0.2:8100", "10.0.0.2:21001", "m")
SD1 = static("10.0.1.1:8200", "10.0.1.1:22001")


DEFAULTS = Settings.model_validate({})


def flags(*argv: str) -> argparse.Namespace:
    """What main() hands to `serve`: the parsed namespace without func/command."""
    args = build_parser().parse_args(["serve", *argv])
    del args.func, args.command
    return args


def load(argv: Sequence[str] = (), environ: dict[str, str] | None = None) -> Settings:
    return load_settings(flags(*argv), environ={} if environ is None else environ)


def yaml_file(tmp_path: Path, text: str, name: str = "pdproxy.yaml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def value(settings: Settings, name: str) -> Any:
    item = getattr(settings, name)
    if isinstance(item, list):
        return [x.get_secret_value() if isinstance(x, SecretStr) else x for x in item]
    return item.get_secret_value() if isinstance(item, SecretStr) else item


SECRET_SAMPLE = Path(__file__).with_name("registry-secret.sample")

# One (command-line text, parsed value) per Settings field. A new field without an entry here
# fails test_every_field_is_covered, so nothing is configurable in one place only.
SAMPLES: dict[str, tuple[str, Any]] = {
    "host": ("127.0.0.2", "127.0.0.2"),
    "port": ("9001", 9001),
    "registry_bind": ("tcp://127.0.0.1:31001", "tcp://127.0.0.1:31001"),
    "ttl": ("2.5", 2.5),
    "prefill": (P2, [SP2]),
    "decode": (D1, [SD1]),
    "max_instances": ("7", 7),
    "registry_max_message_bytes": ("1024", 1024),
    "registry_secret": ("0123456789abcdef-test", "0123456789abcdef-test"),
    "registry_secret_file": (str(SECRET_SAMPLE), SECRET_SAMPLE),
    "registry_allow_unsigned_v0": ("true", True),
    "registry_max_unsigned_instances": ("3", 3),
    "registry_v0_cidrs": ("10.1.0.0/16", ["10.1.0.0/16"]),
    "registry_address_cidrs": ("10.0.0.0/8", ["10.0.0.0/8"]),
    "registry_max_skew_seconds": ("12.5", 12.5),
    "discovery": ("kubernetes", "kubernetes"),
    "kubernetes_namespace": ("inference", "inference"),
    "kubernetes_prefill_selector": ("role=p,app=vllm", "role=p,app=vllm"),
    "kubernetes_decode_selector": ("role=d,app=vllm", "role=d,app=vllm"),
    "kubernetes_http_port_annotation": ("example.com/http", "example.com/http"),
    "kubernetes_kv_port_annotation": ("example.com/kv", "example.com/kv"),
    "kubernetes_connector_annotation": ("example.com/connector", "example.com/connector"),
    "kubernetes_geometry_annotation": ("example.com/geometry", "example.com/geometry"),
    "kubernetes_drain_annotation": ("example.com/drain", "example.com/drain"),
    "max_body_bytes": ("2048", 2048),
    "max_response_bytes": ("4096", 4096),
    "upstream_api_key": ("sk-test", "sk-test"),
    "connect_timeout": ("1.5", 1.5),
    "prefill_timeout": ("30", 30.0),
    "decode_first_byte_timeout": ("12.5", 12.5),
    "decode_timeout": ("42", 42.0),
    "stream_idle_timeout": ("13", 13.0),
    "request_timeout": ("14", 14.0),
    "body_timeout": ("9", 9.0),
    "retry_after_seconds": ("3", 3),
    "upstream_max_connections": ("16", 16),
    "workers": ("4", 4),
    "backlog": ("512", 512),
    "log_level": ("debug", "debug"),
    "log_format": ("json", "json"),
    "access_log": ("false", False),
    "otel_exporter": ("console", "console"),
    "prefill_policy": ("power_of_two", "power_of_two"),
    "decode_policy": ("least_loaded", "least_loaded"),
    "prefix_affinity_tokens": ("64", 64),
    "prefix_affinity_load_factor": ("1.5", 1.5),
    "decode_kv_capacity_tokens": ("1000", 1000),
    "allow_unknown_geometry": ("true", True),
    "disagg_min_tokens": ("32", 32),
    "concurrent_decode_connectors": ("p2p_nccl", ["p2p_nccl"]),
    "bootstrap_query_timeout": ("2.5", 2.5),
    "max_attempts": ("5", 5),
    "migration": ("off", "off"),
    "migration_limit": ("1", 1),
    "migration_whole_min_tokens": ("0", 0),
    "retry_backoff_base_seconds": ("0.01", 0.01),
    "retry_backoff_max_seconds": ("2.5", 2.5),
    "outlier_consecutive_failures": ("3", 3),
    "outlier_base_ejection_seconds": ("1.5", 1.5),
    "outlier_max_ejection_seconds": ("60", 60.0),
    "outlier_max_ejection_percent": ("100", 100),
    "health_check_interval": ("2.5", 2.5),
    "health_check_timeout": ("0.5", 0.5),
    "max_inflight_requests": ("64", 64),
    "max_queued_requests": ("8", 8),
    "queue_timeout": ("1.5", 1.5),
    "instance_max_inflight": ("4", 4),
    "drain_seconds": ("7.5", 7.5),
    "api_key": ("sk-one", ["sk-one"]),
    "api_key_file": ("/etc/pdproxy/keys", Path("/etc/pdproxy/keys")),
    "open_paths": ("/health", ["/health"]),
    "passthrough_role": ("/tokenize=prefill", ["/tokenize=prefill"]),
    "passthrough_unknown_paths": ("true", True),
    "admin_token": ("admin-token-1", "admin-token-1"),
    "admin_token_file": ("/etc/pdproxy/admin", Path("/etc/pdproxy/admin")),
    "peers_dns": ("pdproxy-peers.ns.svc", "pdproxy-peers.ns.svc"),
}


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_of(name: str) -> str:
    return ENV_PREFIX + name.upper()


# ---------------------------------------------------------------------------------------------
# defaults and coverage


def test_every_field_is_covered() -> None:
    assert set(SAMPLES) == set(Settings.model_fields)


def test_defaults() -> None:
    settings = load_settings(None, environ={})
    assert settings == DEFAULTS
    assert load() == settings
    assert settings.host == "0.0.0.0"
    assert settings.port == 8000
    assert settings.registry_bind == "tcp://0.0.0.0:30001"
    assert settings.ttl == 10.0
    assert settings.prefill == [] and settings.decode == []
    assert settings.max_instances == 4096
    assert settings.registry_max_message_bytes == 65536
    assert settings.max_body_bytes == 32 * 1024 * 1024
    assert settings.max_response_bytes == 64 * 1024 * 1024
    assert settings.upstream_api_key is None
    assert settings.connect_timeout == 5.0
    assert settings.prefill_timeout == 600.0
    assert settings.decode_first_byte_timeout == 120.0
    assert settings.stream_idle_timeout == 120.0
    assert settings.request_timeout == 3600.0
    assert settings.retry_after_seconds == 2
    assert settings.upstream_max_connections == 4096
    assert settings.log_level == "info"
    assert settings.prefill_policy == "prefix_affinity"
    assert settings.decode_policy == "least_kv"
    assert settings.allow_unknown_geometry is False
    assert settings.disagg_min_tokens == 0
    assert settings.concurrent_decode_connectors == ["pdproxy", "mooncake", "nixl_push"]
    assert settings.max_attempts == 3
    assert settings.outlier_consecutive_failures == 5
    assert settings.max_inflight_requests == 10000
    assert settings.instance_max_inflight == 0
    assert settings.api_key == [] and settings.admin_token is None
    assert settings.open_paths == ["/health", "/ready", "/metrics"]


def test_concurrent_decode_connectors_take_lists_and_none_and_refuse_nixl() -> None:
    both = load(["--concurrent-decode-connectors", "pdproxy,p2p_nccl"])
    assert both.concurrent_decode_connectors == ["pdproxy", "p2p_nccl"]
    assert load(["--concurrent-decode-connectors", ""]).concurrent_decode_connectors == []
    environ = {"PDPROXY_CONCURRENT_DECODE_CONNECTORS": "[]"}
    assert load_settings(None, environ=environ).concurrent_decode_connectors == []
    with pytest.raises(ConfigError, match="nixl cannot run its legs concurrently"):
        load(["--concurrent-decode-connectors", "nixl"])
    with pytest.raises(ConfigError, match="concurrent_decode_connectors"):
        load(["--concurrent-decode-connectors", "mooncake_store"])


def test_static_prefills_carry_their_connectors_coordinates() -> None:
    mooncake = "http=127.0.0.1:8100,zmq=127.0.0.1:14579,connector=mooncake,bootstrap=10.0.0.5:8998"
    push = (
        "http=127.0.0.1:8200,zmq=127.0.0.1:14580,connector=nixl_push,engine_id=e-1,"
        "side_channel=10.0.0.6:5600"
    )
    decode = "http=127.0.0.1:8300,zmq=127.0.0.1:14581,connector=mooncake"
    settings = load(["--prefill", mooncake, "--prefill", push, "--decode", decode])
    first, second = settings.prefill
    assert first.connector == "mooncake" and first.coordinates is not None
    assert str(first.coordinates.bootstrap) == "10.0.0.5:8998"
    assert second.coordinates is not None and second.coordinates.engine_id == "e-1"
    assert str(second.coordinates.side_channel) == "10.0.0.6:5600"
    with pytest.raises(ConfigError, match="a mooncake prefill needs bootstrap"):
        load(["--prefill", "http=127.0.0.1:8100,zmq=127.0.0.1:14579,connector=mooncake"])
    with pytest.raises(ConfigError, match="a nixl_push prefill needs engine_id, side_channel"):
        load(["--prefill", "http=127.0.0.1:8100,zmq=127.0.0.1:14579,connector=nixl_push"])
    with pytest.raises(ConfigError, match="bootstrap address"):
        load(["--prefill", "http=127.0.0.1:8100,zmq=127.0.0.1:1,connector=mooncake,bootstrap=x"])
    # A decode names nobody: it needs no coordinates.
    assert load(["--decode", "http=127.0.0.1:8100,zmq=127.0.0.1:1,connector=mooncake"]).decode


def test_the_unsigned_instance_cap_exists_only_with_a_secret() -> None:
    secret = "0123456789abcdef-test"
    assert Settings().unsigned_instance_cap is None  # nothing is signed: one cap for all
    assert Settings(registry_secret=secret).unsigned_instance_cap == 1024  # 4096 // 4
    assert Settings(registry_secret=secret, max_instances=3).unsigned_instance_cap == 1
    configured = Settings(registry_secret=secret, registry_max_unsigned_instances=10)
    assert configured.unsigned_instance_cap == 10


def test_a_bare_boolean_flag_means_true() -> None:
    assert load(["--allow-unknown-geometry"]).allow_unknown_geometry is True
    assert load(["--allow-unknown-geometry", "false"]).allow_unknown_geometry is False


@pytest.mark.parametrize(
    ("flag", "name"),
    [("--prefill-policy", "least_kv"), ("--decode-policy", "prefix_affinity")],
)
def test_a_policy_for_the_other_role_is_refused(
    flag: str, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # As a flag, by the parser with the role's choices; from anywhere else, by the settings.
    with pytest.raises(SystemExit) as refused:
        load([flag, name])
    assert refused.value.code == 2
    assert f"invalid choice: {name!r}" in capsys.readouterr().err
    setting = flag[2:].replace("-", "_")
    with pytest.raises(ConfigError, match=rf"{setting} \(environment {ENV_PREFIX}"):
        load(environ={env_of(setting): name})


def test_unset_flags_do_not_appear_in_the_namespace() -> None:
    assert vars(flags()) == {"config": None}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_every_field_has_a_flag(name: str) -> None:
    text, expected = SAMPLES[name]
    settings = load([flag_of(name), text])
    assert value(settings, name) == expected
    untouched = DEFAULTS
    for other in Settings.model_fields.keys() - {name}:
        assert getattr(settings, other) == getattr(untouched, other), other


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_every_field_has_an_env_name(name: str) -> None:
    text, expected = SAMPLES[name]
    settings = load_settings(None, environ={env_of(name): text})
    assert value(settings, name) == expected


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_every_field_can_be_set_in_yaml(name: str, tmp_path: Path) -> None:
    text, expected = SAMPLES[name]
    item = f"[{text!r}]" if name in ("prefill", "decode") else repr(text)
    path = yaml_file(tmp_path, f"{name}: {item}\n")
    assert value(load(["--config", path]), name) == expected


def test_serve_help_lists_every_flag_and_env_name(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert re.search(r"(^|\s)--config FILE\b", out)
    for name, field in Settings.model_fields.items():
        assert re.search(rf"(^|\s){re.escape(flag_of(name))}\b", out), name
        assert env_of(name) in out, name
        assert field.description, name
        # The description's first words are in the help too (argparse may rewrap the rest).
        first_words = " ".join(field.description.split()[:2])
        assert first_words in " ".join(out.split()), name


# ---------------------------------------------------------------------------------------------
# precedence: defaults < YAML < env < flags


@pytest.mark.parametrize(
    ("in_yaml", "in_env", "in_flags", "expected"),
    [
        (False, False, False, 8000),
        (True, False, False, 1111),
        (False, True, False, 2222),
        (True, True, False, 2222),
        (False, False, True, 3333),
        (True, False, True, 3333),
        (False, True, True, 3333),
        (True, True, True, 3333),
    ],
)
def test_precedence(
    tmp_path: Path, in_yaml: bool, in_env: bool, in_flags: bool, expected: int
) -> None:
    argv: list[str] = []
    if in_yaml:
        argv += ["--config", yaml_file(tmp_path, "port: 1111\nttl: 4\n")]
    environ = {"PDPROXY_PORT": "2222"} if in_env else {}
    if in_flags:
        argv += ["--port", "3333"]
    settings = load(argv, environ)
    assert settings.port == expected
    assert settings.ttl == (4.0 if in_yaml else 10.0)  # other YAML keys survive


def test_precedence_is_per_field(tmp_path: Path) -> None:
    path = yaml_file(tmp_path, "port: 1111\nttl: 1\nhost: 10.9.9.9\nlog_level: error\n")
    settings = load(
        ["--config", path, "--ttl", "3"],
        {"PDPROXY_TTL": "2", "PDPROXY_HOST": "10.8.8.8"},
    )
    assert (settings.port, settings.ttl, settings.host, settings.log_level) == (
        1111,
        3.0,
        "10.8.8.8",
        "error",
    )


def test_config_path_from_env(tmp_path: Path) -> None:
    path = yaml_file(tmp_path, "port: 1111\n")
    assert load_settings(None, environ={"PDPROXY_CONFIG": path}).port == 1111
    assert load([], {"PDPROXY_CONFIG": path}).port == 1111


def test_config_flag_wins_over_config_env(tmp_path: Path) -> None:
    from_env = yaml_file(tmp_path, "port: 1111\n", "env.yaml")
    from_flag = yaml_file(tmp_path, "port: 4444\n", "flag.yaml")
    assert load(["--config", from_flag], {"PDPROXY_CONFIG": from_env}).port == 4444


def test_empty_yaml_is_all_defaults(tmp_path: Path) -> None:
    assert load(["--config", yaml_file(tmp_path, "")]) == DEFAULTS
    assert load(["--config", yaml_file(tmp_path, "# nothing\n", "c.yaml")]) == DEFAULTS


def test_yaml_keys_may_use_dashes(tmp_path: Path) -> None:
    path = yaml_file(tmp_path, "max-instances: 9\nretry-after-seconds: 5\n")
    settings = load(["--config", path])
    assert (settings.max_instances, settings.retry_after_seconds) == (9, 5)


def test_unrelated_env_is_ignored() -> None:
    environ = {"PORT": "1", "PDPROXY": "x", "PDPROXY_UNKNOWN": "y", "pdproxy_port": "2"}
    assert load_settings(None, environ=environ) == DEFAULTS


def test_namespace_with_only_settings_keys() -> None:
    settings = load_settings(argparse.Namespace(port="9100", ttl="1"), environ={})
    assert (settings.port, settings.ttl) == (9100, 1.0)


def test_upstream_api_key_is_secret() -> None:
    settings = load(["--upstream-api-key", "sk-secret"])
    assert settings.upstream_api_key is not None
    assert "sk-secret" not in repr(settings)
    assert "sk-secret" not in str(settings.upstream_api_key)


# ---------------------------------------------------------------------------------------------
# static instances


def test_static_from_repeated_flags() -> None:
    settings = load(["--prefill", P1, "--prefill", P2, "--decode", D1])
    assert settings.prefill == [SP1, SP2]
    assert settings.decode == [SD1]
    assert settings.prefill[0].http_address == Address("10.0.0.1", 8100)
    assert settings.prefill[0].zmq_address == Address("10.0.0.1", 21001)
    assert settings.prefill[0].model is None
    assert settings.prefill[1].model == "m"


def test_static_spec_order_and_spaces_do_not_matter() -> None:
    settings = load(["--prefill", "model=m, zmq=10.0.0.2:21001 ,http=10.0.0.2:8100"])
    assert settings.prefill == [SP2]


def test_static_from_env_semicolons() -> None:
    settings = load_settings(
        None, environ={"PDPROXY_PREFILL": f"{P1};{P2}", "PDPROXY_DECODE": f" {D1} ;"}
    )
    assert settings.prefill == [SP1, SP2]
    assert settings.decode == [SD1]


def test_static_from_env_allows_spaces_inside_a_spec() -> None:
    spaced = "http=10.0.0.1:8100, zmq=10.0.0.1:21001"
    assert load_settings(None, environ={"PDPROXY_PREFILL": spaced}).prefill == [SP1]


def test_leg_timeouts_must_exceed_the_connect_timeout() -> None:
    for flag in (
        "--prefill-timeout",
        "--decode-first-byte-timeout",
        "--decode-timeout",
        "--request-timeout",
    ):
        with pytest.raises(ConfigError, match="longer than connect_timeout"):
            load(["--connect-timeout", "5", flag, "5"])
    assert load(["--connect-timeout", "0.5", "--prefill-timeout", "1"]).prefill_timeout == 1.0


def test_static_model_may_not_be_empty() -> None:
    with pytest.raises(ConfigError, match="prefill"):
        load(["--prefill", f"{P1},model="])


def test_static_from_env_whitespace_and_json() -> None:
    assert load_settings(None, environ={"PDPROXY_PREFILL": f"{P1}\n{P2}"}).prefill == [SP1, SP2]
    json_list = f'["{P1}", {{"http": "10.0.0.2:8100", "zmq": "10.0.0.2:21001", "model": "m"}}]'
    assert load_settings(None, environ={"PDPROXY_PREFILL": json_list}).prefill == [SP1, SP2]


def test_static_from_yaml_lists(tmp_path: Path) -> None:
    path = yaml_file(
        tmp_path,
        f"prefill:\n  - {P1}\n  - http: 10.0.0.2:8100\n    zmq: 10.0.0.2:21001\n    model: m\n"
        f"decode: [{D1!r}]\n",
    )
    settings = load(["--config", path])
    assert settings.prefill == [SP1, SP2]
    assert settings.decode == [SD1]


def test_static_lists_are_replaced_not_merged(tmp_path: Path) -> None:
    path = yaml_file(tmp_path, f"prefill: [{P1!r}]\n")
    assert load(["--config", path], {"PDPROXY_PREFILL": P2}).prefill == [SP2]
    assert (
        load(
            ["--config", path],
            {"PDPROXY_PREFILL": P2},
        ).decode
        == []
    )
    assert load(["--config", path, "--prefill", P2]).prefill == [SP2]
    assert load(["--prefill", P1], {"PDPROXY_PREFILL": P2}).prefill == [SP1]


# ---------------------------------------------------------------------------------------------
# refusals: ConfigError naming the field


def config_error(argv: Sequence[str] = (), environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load(argv, environ)
    message = str(info.value)
    assert message
    return message


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--port", "0"], "port"),
        (["--port", "65536"], "port"),
        (["--port", "http"], "port"),
        (["--ttl", "0"], "ttl"),
        (["--ttl", "-1"], "ttl"),
        (["--ttl", "soon"], "ttl"),
        (["--max-instances", "0"], "max_instances"),
        (["--registry-max-message-bytes", "255"], "registry_max_message_bytes"),
        (["--max-body-bytes", "1023"], "max_body_bytes"),
        (["--connect-timeout", "0"], "connect_timeout"),
        (["--retry-after-seconds", "0"], "retry_after_seconds"),
        (["--upstream-max-connections", "0"], "upstream_max_connections"),
    ],
)
def test_invalid_flag_values(argv: list[str], field: str) -> None:
    assert re.search(rf"\b{field}\b", config_error(argv))


@pytest.mark.parametrize(
    ("name", "text"), [("port", "0"), ("ttl", "0"), ("max_instances", "-5"), ("log_level", "x")]
)
def test_invalid_env_values(name: str, text: str) -> None:
    assert re.search(rf"\b{name}\b", config_error(environ={env_of(name): text}))


def test_invalid_yaml_value(tmp_path: Path) -> None:
    path = yaml_file(tmp_path, "port: 0\n")
    assert re.search(r"\bport\b", config_error(["--config", path]))


@pytest.mark.parametrize(
    "spec",
    [
        "nonsense",
        "http=10.0.0.1:8100",  # no zmq
        "zmq=10.0.0.1:21001",  # no http
        "http=10.0.0.1:8100,zmq=10.0.0.1:21001,gpu=0",
        "http=10.0.0.1:8100,http=10.0.0.2:8100,zmq=10.0.0.1:21001",
        "http=10.0.0.1,zmq=10.0.0.1:21001",  # no port
        "http=10.0.0.1:0,zmq=10.0.0.1:21001",
        "http=10.0.0.1:8100,zmq=10.0.0.1:70000",
        "http=a___b:8100,zmq=10.0.0.1:21001",
        "http 10.0.0.1:8100 zmq 10.0.0.1:21001",
        "",
    ],
)
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_bad_static_spec(role: str, spec: str) -> None:
    message = config_error([f"--{role}", spec])
    assert re.search(rf"\b{role}\b", message)


@pytest.mark.parametrize(
    "spec",
    [
        "http=[::1]:8100,zmq=10.0.0.1:21001",
        "http=10.0.0.1:8100,zmq=[::1]:21001",
        "http=fe80::1:8100,zmq=fe80::1:21001",
    ],
)
def test_ipv6_static_address(spec: str) -> None:
    message = config_error(["--prefill", spec])
    assert re.search(r"\bprefill\b", message)
    assert "IPv6" in message


def test_bad_static_spec_from_env() -> None:
    message = config_error(environ={"PDPROXY_DECODE": f"{D1};http=[::1]:1,zmq=[::1]:2"})
    assert re.search(r"\bdecode\b", message)
    assert "IPv6" in message


def test_bad_static_spec_from_yaml(tmp_path: Path) -> None:
    path = yaml_file(tmp_path, "prefill:\n  - http: 10.0.0.1:8100\n    zmq: 10.0.0.1:0\n")
    assert re.search(r"\bprefill\b", config_error(["--config", path]))


def test_static_json_env_must_be_valid_json() -> None:
    # PDPROXY_PREFILL starting with '[' is read as JSON; broken JSON must be a ConfigError that
    # names the variable, not a json.JSONDecodeError traceback.
    with pytest.raises(ConfigError, match=r"PDPROXY_PREFILL|prefill"):
        load_settings(None, environ={"PDPROXY_PREFILL": f"[{P1}]"})


def test_unknown_yaml_key(tmp_path: Path) -> None:
    path = yaml_file(tmp_path, "port: 8001\nbogus_key: 1\n")
    message = config_error(["--config", path])
    assert "bogus_key" in message


def test_yaml_config_key_is_unknown(tmp_path: Path) -> None:
    path = yaml_file(tmp_path, "config: other.yaml\n")
    assert re.search(r"\bconfig\b", config_error(["--config", path]))


@pytest.mark.parametrize(
    "text", ["port: [1, 2\n", "port: 1\n  bad indent: :\n", "\t- tab\n", "a: b: c\n"]
)
def test_unparsable_yaml(tmp_path: Path, text: str) -> None:
    path = yaml_file(tmp_path, text)
    assert path in config_error(["--config", path])


@pytest.mark.parametrize("text", ["- port: 1\n", "just a string\n", "42\n"])
def test_yaml_must_be_a_mapping(tmp_path: Path, text: str) -> None:
    path = yaml_file(tmp_path, text)
    message = config_error(["--config", path])
    assert path in message
    assert "expected a mapping" in message


def test_missing_yaml_file(tmp_path: Path) -> None:
    path = str(tmp_path / "missing.yaml")
    assert path in config_error(["--config", path])


def test_yaml_path_is_a_directory(tmp_path: Path) -> None:
    assert str(tmp_path) in config_error(["--config", str(tmp_path)])


def test_yaml_file_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"host: caf\xe9\n")
    assert str(path) in config_error(["--config", str(path)])


def test_secrets_lose_the_newline_a_mounted_secret_file_ends_with() -> None:
    environ = {
        "PDPROXY_REGISTRY_SECRET": "0123456789abcdef-test\n",
        "PDPROXY_ADMIN_TOKEN": " admin-token-1\n",
    }
    settings = load_settings(None, environ=environ)
    assert settings.registry_secret is not None and settings.admin_token is not None
    assert settings.registry_secret.get_secret_value() == "0123456789abcdef-test"
    assert settings.admin_token.get_secret_value() == "admin-token-1"


def test_static_spec_may_declare_its_max_model_len(tmp_path: Path) -> None:
    settings = load(["--decode", f"{D1},max_model_len=4096", "--prefill", P1])
    assert settings.decode[0].max_model_len == 4096
    assert settings.prefill[0].max_model_len is None
    spec = "{http: '10.0.1.1:8200', zmq: '10.0.1.1:22001', max_model_len: 512}"
    path = yaml_file(tmp_path, f"decode:\n  - {spec}\n")
    assert load(["--config", path]).decode[0].max_model_len == 512
    # The table the proxy starts with carries it.
    (decode,) = [i for i in static_instances(settings) if i.role is Role.DECODE]
    assert decode.max_model_len == 4096


@pytest.mark.parametrize("value", ["0", "-1", "x", "1.5", "", str(2**32 + 1)])
def test_bad_static_max_model_len(value: str) -> None:
    message = config_error(["--decode", f"{D1},max_model_len={value}"])
    assert "max_model_len" in message


GEOMETRY_TEXT = (
    "tp_size=2,block_size=16,num_layers=32,num_kv_heads=8,head_dim=128,kv_dtype=bfloat16,"
    "is_mla=false,kv_layout=HND"
)


# What a prefill of each kind must say besides: where its connector is reached.
PREFILL_COORDINATES = {
    Connector.MOONCAKE: ",bootstrap=10.0.0.1:8998",
    Connector.NIXL_PUSH: ",engine_id=engine-1,side_channel=10.0.0.1:5600",
}


@pytest.mark.parametrize("connector", list(Connector))
def test_static_spec_may_declare_connector_and_geometry(
    tmp_path: Path, connector: Connector
) -> None:
    """A fleet that does not announce still tells the proxy what an announcement would: the
    connector of every kind and the geometry, on the command line and in YAML alike."""
    coordinates = PREFILL_COORDINATES.get(connector, "")
    settings = load(["--prefill", f"{P1},connector={connector.value},{GEOMETRY_TEXT}{coordinates}"])
    expected = Geometry(2, 16, 32, 8, 128, "bfloat16", False, "HND")
    (spec,) = settings.prefill
    assert (spec.connector, spec.geometry) == (connector, expected)
    path = yaml_file(
        tmp_path,
        "decode:\n  - {http: '10.0.1.1:8200', zmq: '10.0.1.1:22001', "
        f"connector: {connector.value}, tp_size: 2, block_size: 16, num_layers: 32, "
        "num_kv_heads: 8, head_dim: 128, kv_dtype: bfloat16, is_mla: false, kv_layout: HND}\n",
    )
    (yaml_spec,) = load(["--config", path]).decode
    assert (yaml_spec.connector, yaml_spec.geometry) == (connector, expected)
    # The table the proxy starts with carries both, as an announcement's instance would.
    (prefill,) = static_instances(settings)
    assert (prefill.connector, prefill.geometry) == (connector, expected)


def test_static_spec_geometry_is_partial_or_absent() -> None:
    settings = load(["--prefill", f"{P1},tp_size=4", "--decode", D1])
    assert settings.prefill[0].geometry == Geometry(tp_size=4)
    assert settings.prefill[0].connector is None
    assert settings.decode[0].geometry is None


@pytest.mark.parametrize(
    "extra",
    [
        "connector=p2p",  # not a kind
        "connector=",
        "tp_size=0",
        f"tp_size={GEOMETRY_LIMITS['tp_size'] + 1}",
        "block_size=1.5",
        "num_layers=x",
        "head_dim=-1",
        "kv_layout=XYZ",
        "is_mla=maybe",
        "kv_dtype=",
        f"kv_dtype={'x' * 33}",
        "tp_size=2,tp_size=2",
    ],
)
def test_bad_static_connector_or_geometry(extra: str) -> None:
    message = config_error(["--decode", f"{D1},{extra}"])
    assert re.search(r"\bdecode\b", message)
    key = extra.partition("=")[0]
    assert key in message


def test_static_syntax_names_every_key() -> None:
    """The help text (and the chart values table made from it) lists every key a spec accepts."""
    description = Settings.model_fields["prefill"].description or ""
    for key in ("model", "max_model_len", "connector", *GEOMETRY_FIELDS):
        assert f"{key}" in description, key
    for connector in Connector:
        assert connector.value in description


def test_kubernetes_discovery_without_its_extra_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "kubernetes_asyncio" else real(name, *args),
    )
    with pytest.raises(ConfigError, match=r"pip install 'pdproxy\[kubernetes\]'"):
        load_settings(None, environ={"PDPROXY_DISCOVERY": "kubernetes"})
    assert load_settings(None, environ={}).discovery == "registry"


# -- errors that say what to do -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "stored"),
    [
        ("127.0.0.1:30001", "tcp://127.0.0.1:30001"),
        ("tcp://0.0.0.0:30001", "tcp://0.0.0.0:30001"),
        ("TCP://*:30001", "tcp://*:30001"),
        ("[::1]:30001", "tcp://[::1]:30001"),
        ("registry.example:30001", "tcp://registry.example:30001"),
    ],
)
def test_registry_bind_takes_tcp_or_not(given: str, stored: str) -> None:
    assert load(["--registry-bind", given]).registry_bind == stored


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("udp://1.2.3.4:30001", "only tcp:// is supported"),
        ("1.2.3.4", "has no port"),
        ("fd00::1:30001", "an IPv6 address in brackets"),
        ("1.2.3.4:0", "a number from 1 to 65535"),
        ("1.2.3.4:http", "a number from 1 to 65535"),
        (":30001", "has no valid host"),
    ],
)
def test_a_malformed_registry_bind_names_the_flag_and_the_syntax(given: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load(["--registry-bind", given])
    message = str(caught.value)
    assert "registry_bind (flag --registry-bind)" in message
    assert says in message and "[tcp://]HOST:PORT" in message
    assert "Value error" not in message  # pydantic's own wording stays out


def test_a_settings_error_names_its_source(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=rf"ttl \(environment {ENV_PREFIX}TTL\)"):
        load(environ={f"{ENV_PREFIX}TTL": "-1"})
    config = yaml_file(tmp_path, "port: 0\n")
    with pytest.raises(ConfigError, match=rf"port \(config file {re.escape(config)}\)"):
        load(["--config", config])
    # The flag wins over the file, and the error names the flag.
    with pytest.raises(ConfigError, match=r"port \(flag --port\)"):
        load(["--config", yaml_file(tmp_path, "port: 8000\n", "ok.yaml"), "--port", "0"])


def test_an_unknown_setting_in_a_file_suggests_the_closest(tmp_path: Path) -> None:
    config = yaml_file(tmp_path, "registry_bnd: tcp://0.0.0.0:30001\n")
    with pytest.raises(ConfigError, match=r"no such setting \(did you mean 'registry_bind'\?\)"):
        load(["--config", config])
    with pytest.raises(ConfigError) as caught:
        load(["--config", yaml_file(tmp_path, "zzzzzz: 1\n", "far.yaml")])
    assert "no such setting" in str(caught.value) and "did you mean" not in str(caught.value)


def test_a_static_instance_given_twice_is_an_error() -> None:
    with pytest.raises(
        ConfigError, match=r"10.0.0.1:8100 is given twice \(as prefill and as prefill\)"
    ):
        load(["--prefill", P1, "--prefill", P1.replace("21001", "21009")])
    with pytest.raises(ConfigError, match=r"given twice \(as prefill and as decode\)"):
        load(["--prefill", P1, "--decode", P1.replace("21001", "22009")])


def test_the_registry_secret_may_come_from_a_file(tmp_path: Path) -> None:
    settings = load(["--registry-secret-file", str(SECRET_SAMPLE)])
    assert settings.registry_secret is None  # the flag's own value: never given
    key = settings.registry_key
    assert key is not None and key.get_secret_value() == "0123456789abcdef-from-a-file"
    assert settings.unsigned_instance_cap == 1024  # signed now, as with the flag
    with pytest.raises(ConfigError, match="registry_secret or registry_secret_file, not both"):
        load(["--registry-secret-file", str(SECRET_SAMPLE), "--registry-secret", "x" * 16])
    with pytest.raises(ConfigError, match="No such file"):
        load(["--registry-secret-file", str(tmp_path / "missing")])
    short = tmp_path / "short"
    short.write_text("too short\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="shorter than 16 bytes"):
        load(["--registry-secret-file", str(short)])


def test_serve_help_is_in_sections_with_choices(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    titles = [line for line in out.splitlines() if line.endswith(" settings:")]
    assert titles == [
        "HTTP settings:",
        "registry and discovery settings:",
        "pairing settings:",
        "timeouts, retries and limits settings:",
        "security settings:",
        "observability settings:",
    ]
    assert "--log-level {debug,info,warning,error}" in out
    assert "--discovery {registry,kubernetes}" in out
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["serve", "--log-level", "loud"])
    assert refused.value.code == 2
    assert "invalid choice: 'loud'" in capsys.readouterr().err
