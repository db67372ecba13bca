"""The worker's pure readers: connector settings (vLLM's --kv-transfer-config), geometry from a
Hugging Face config.json, the connector's load tracker, load from vLLM's /metrics text and
geometry from a (duck-typed) VllmConfig."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import http.client
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.base.roles import Role
from pdproxy.fake_vllm.load import vllm_metrics_text as fake_worker_metrics
from pdproxy.registry.messages import (
    Announcement,
    Connector,
    Geometry,
    Load,
    decode_frame,
    known_fields,
)
from pdproxy.vllm_side.announce import add_cli, build_identity, scrape_timed_out
from pdproxy.vllm_side.announcement import WorkerIdentity, announce_message
from pdproxy.vllm_side.announcer import DEFAULT_INTERVAL_S, PREFILL_WORK_REPORT_S
from pdproxy.vllm_side.bounded_get import HttpStatusError
from pdproxy.vllm_side.connector_settings import (
    DEFAULT_KV_PORT,
    HOST_CONFIGURED,
    HOST_DEFAULT,
    HOST_ROUTE,
    ConnectorConfigError,
    connector_settings,
)
from pdproxy.vllm_side.load_tracker import LoadTracker
from pdproxy.vllm_side.model_config import ModelConfigError, geometry_from_model_config
from pdproxy.vllm_side.route import local_address_towards
from pdproxy.vllm_side.vllm_geometry import geometry_from_vllm_config, kv_dtype_name, layout_name
from pdproxy.vllm_side.vllm_metrics import MetricsFormatError, load_from_metrics

PROFILE = settings(derandomize=True, database=None, deadline=None)

# --- connector_settings --------------------------------------------------------------------------

REGISTRY = {"proxy_ip": "10.0.0.1", "proxy_port": 30001, "http_port": 8100}


def no_route(host: str, port: int) -> None:
    """A host with no route to the registry: the default host is advertised."""


def test_kv_producer_is_a_prefill_that_announces() -> None:
    s = connector_settings(
        "kv_producer", None, 21001, REGISTRY, default_host="10.0.0.9", route=no_route
    )
    assert s.role is Role.PREFILL
    assert s.registry == "10.0.0.1:30001"
    assert s.announces is True
    assert s.zmq_address == "10.0.0.9:21001"
    assert s.http_address == "10.0.0.9:8100"


def test_kv_consumer_is_a_decode() -> None:
    s = connector_settings("kv_consumer", None, 22001, REGISTRY, default_host="10.0.0.9")
    assert s.role is Role.DECODE
    assert s.announces is True


@pytest.mark.parametrize("kv_role", ["kv_both", None, "", "producer"])
def test_other_roles_are_not_announced(kv_role: str | None) -> None:
    s = connector_settings(kv_role, None, None, REGISTRY, default_host="10.0.0.9")
    assert s.role is None
    assert s.announces is False


def test_no_registry_or_no_http_port_means_no_announcement() -> None:
    no_registry = connector_settings("kv_producer", None, None, {"http_port": 8100}, "h")
    assert no_registry.registry is None and no_registry.announces is False
    no_http = connector_settings("kv_producer", None, None, {"proxy_ip": "p", "proxy_port": 1}, "h")
    assert no_http.http_port is None and no_http.http_address is None
    assert no_http.announces is False


def test_defaults() -> None:
    s = connector_settings("kv_consumer", None, None, None, default_host="10.0.0.9")
    assert s.kv_port == DEFAULT_KV_PORT
    assert s.zmq_address == f"10.0.0.9:{DEFAULT_KV_PORT}"
    assert s.connector_kind == "pdproxy"
    assert s.announce_interval_s == DEFAULT_INTERVAL_S
    assert s.record_path is None
    assert s.http_port is None and s.registry is None


@pytest.mark.parametrize(
    ("extra", "kv_ip", "host"),
    [
        ({"advertise_host": "adv", "kv_ip": "extra-ip"}, "top-ip", "adv"),
        ({"kv_ip": "extra-ip"}, "top-ip", "extra-ip"),
        ({}, "top-ip", "top-ip"),
        ({}, None, "default"),
        ({"advertise_host": ""}, None, "default"),  # empty means unset
        ({"advertise_host": "adv"}, None, "adv"),
    ],
)
def test_host_precedence(extra: dict[str, Any], kv_ip: str | None, host: str) -> None:
    s = connector_settings(
        "kv_producer", kv_ip, 21001, {**REGISTRY, **extra}, "default", route=no_route
    )
    assert s.host == host
    assert s.zmq_address == f"{host}:21001"
    assert s.http_address == f"{host}:8100"


def test_unconfigured_host_is_the_local_end_of_the_route_to_the_registry() -> None:
    asked: list[tuple[str, int]] = []

    def route(host: str, port: int) -> str:
        asked.append((host, port))
        return "10.0.0.5"

    s = connector_settings("kv_producer", None, 21001, REGISTRY, "default", route=route)
    assert asked == [("10.0.0.1", 30001)]
    assert (s.host, s.host_origin) == ("10.0.0.5", HOST_ROUTE)
    assert s.http_address == "10.0.0.5:8100"
    # A configured host wins; without a registry there is no route to ask for.
    configured = {**REGISTRY, "advertise_host": "adv"}
    s = connector_settings("kv_producer", None, 21001, configured, "default", route=route)
    assert (s.host, s.host_origin) == ("adv", HOST_CONFIGURED)
    s = connector_settings("kv_producer", None, 21001, {"http_port": 8100}, "default", route=route)
    assert (s.host, s.host_origin) == ("default", HOST_DEFAULT)
    assert asked == [("10.0.0.1", 30001)]


def test_a_registry_on_loopback_is_reached_from_loopback() -> None:
    # The real lookup: a single-host setup announces the address its servers listen on.
    extra = {"proxy_ip": "127.0.0.1", "proxy_port": 30001, "http_port": 8100}
    s = connector_settings("kv_producer", None, 21001, extra, "192.0.2.7")
    assert (s.host, s.host_origin) == ("127.0.0.1", HOST_ROUTE)
    assert local_address_towards("localhost", 30001) in ("127.0.0.1", "::1")
    assert local_address_towards("no-such-host.invalid", 30001) is None


@pytest.mark.parametrize(
    "extra",
    [{"proxy_ip": "10.0.0.1"}, {"proxy_port": 30001}, {"proxy_ip": "10.0.0.1", "proxy_port": None}],
)
def test_half_a_registry_address_is_refused(extra: dict[str, Any]) -> None:
    with pytest.raises(ConnectorConfigError, match="proxy_ip and proxy_port"):
        connector_settings("kv_producer", None, None, extra, "h")


def test_ports_given_as_strings_are_accepted() -> None:
    extra = {"proxy_ip": "10.0.0.1", "proxy_port": "30001", "http_port": "8100"}
    s = connector_settings("kv_producer", None, 21001, extra, "h")
    assert s.registry == "10.0.0.1:30001"
    assert s.http_port == 8100


@pytest.mark.parametrize("port", [0, -1, 65536, "abc", "80.5", 80.5, True, ""])
@pytest.mark.parametrize("key", ["proxy_port", "http_port", "kv_port"])
def test_bad_ports_are_refused(key: str, port: object) -> None:
    extra: dict[str, Any] = {"proxy_ip": "10.0.0.1", "proxy_port": 30001, "http_port": 8100}
    kv_port: Any = 21001
    if key == "kv_port":
        kv_port = port
    else:
        extra[key] = port
    with pytest.raises(ConnectorConfigError, match=key):
        connector_settings("kv_producer", None, kv_port, extra, "h")


@pytest.mark.parametrize("interval", [0, -1, 0.0, "0", float("nan")])
def test_announce_interval_must_be_positive(interval: object) -> None:
    with pytest.raises(ConnectorConfigError, match="announce_interval"):
        connector_settings("kv_producer", None, None, {"announce_interval": interval}, "h")


def test_a_prefills_work_is_reported_every_10_ms_unless_configured() -> None:
    default = connector_settings("kv_producer", None, None, {}, "h")
    assert default.prefill_work_report_s == PREFILL_WORK_REPORT_S == 0.01
    slower = connector_settings("kv_producer", None, None, {"prefill_work_report": "0.1"}, "h")
    assert slower.prefill_work_report_s == 0.1
    for bad in (0, -0.01, "often"):
        with pytest.raises(ConnectorConfigError, match="prefill_work_report"):
            connector_settings("kv_producer", None, None, {"prefill_work_report": bad}, "h")


def test_announce_interval_non_numeric_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        connector_settings("kv_producer", None, None, {"announce_interval": "often"}, "h")


def test_pdproxy_extra_keys() -> None:
    extra = {"connector_kind": "nixl", "announce_interval": "0.5", "record_path": "/tmp/r.jsonl"}
    s = connector_settings("kv_consumer", None, None, extra, "h")
    assert s.connector_kind == "nixl"
    assert s.announce_interval_s == 0.5
    assert s.record_path == Path("/tmp/r.jsonl")


def test_extra_dict_is_not_mutated() -> None:
    extra: dict[str, Any] = {"proxy_ip": "10.0.0.1", "proxy_port": 30001}
    before = dict(extra)
    connector_settings("kv_producer", None, None, extra, "h")
    assert extra == before


# --- model_config --------------------------------------------------------------------------------

LLAMA_3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
    "model_type": "llama",
}

DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "torch_dtype": "bfloat16",
    "model_type": "deepseek_v3",
}


def test_llama_3_8b() -> None:
    g = geometry_from_model_config(LLAMA_3_8B)
    assert g == Geometry(
        num_layers=32, num_kv_heads=8, head_dim=128, kv_dtype="bfloat16", is_mla=False
    )


def test_flags_pass_through() -> None:
    g = geometry_from_model_config(
        LLAMA_3_8B, tp_size=2, block_size=16, kv_dtype="fp8_e4m3", kv_layout="HND"
    )
    assert (g.tp_size, g.block_size, g.kv_layout) == (2, 16, "HND")
    assert g.kv_dtype == "fp8_e4m3"  # the cache dtype flag wins over the weights' dtype


def test_explicit_head_dim_wins() -> None:
    # Gemma-like: head_dim is not hidden / heads.
    g = geometry_from_model_config({**LLAMA_3_8B, "head_dim": 256})
    assert g.head_dim == 256


def test_explicit_head_dim_needs_no_divisible_hidden() -> None:
    g = geometry_from_model_config({**LLAMA_3_8B, "hidden_size": 4097, "head_dim": 128})
    assert g.head_dim == 128


def test_missing_kv_heads_means_multi_head_attention() -> None:
    config = {k: v for k, v in LLAMA_3_8B.items() if k != "num_key_value_heads"}
    assert geometry_from_model_config(config).num_kv_heads == 32


def test_multi_query_is_one_kv_head() -> None:
    # Falcon-7B style keys.
    config = {"n_layer": 32, "n_head": 71, "hidden_size": 4544, "multi_query": True}
    g = geometry_from_model_config(config)
    assert (g.num_layers, g.num_kv_heads, g.head_dim) == (32, 1, 64)


def test_explicit_kv_heads_win_over_multi_query() -> None:
    config = {**LLAMA_3_8B, "multi_query": True}
    assert geometry_from_model_config(config).num_kv_heads == 8


def test_gpt2_style_keys() -> None:
    g = geometry_from_model_config({"n_layer": 12, "n_head": 12, "n_embd": 768})
    assert (g.num_layers, g.num_kv_heads, g.head_dim) == (12, 12, 64)


def test_deepseek_v3_mla() -> None:
    g = geometry_from_model_config(DEEPSEEK_V3, tp_size=8, block_size=64)
    assert g == Geometry(
        tp_size=8,
        block_size=64,
        num_layers=61,
        num_kv_heads=1,
        head_dim=576,
        kv_dtype="bfloat16",
        is_mla=True,
        kv_layout=None,
    )


def test_mla_without_rope_part() -> None:
    config = {k: v for k, v in DEEPSEEK_V3.items() if k != "qk_rope_head_dim"}
    g = geometry_from_model_config(config)
    assert (g.head_dim, g.num_kv_heads, g.is_mla) == (512, 1, True)


@pytest.mark.parametrize("rank", [None, 0])
def test_no_kv_lora_rank_is_not_mla(rank: int | None) -> None:
    g = geometry_from_model_config({**LLAMA_3_8B, "kv_lora_rank": rank})
    assert g.is_mla is False and g.num_kv_heads == 8


def test_text_config_nesting() -> None:
    # Llava/Mllama style: the language model's numbers live under text_config.
    config = {
        "architectures": ["LlavaForConditionalGeneration"],
        "torch_dtype": "float16",
        "vision_config": {"num_hidden_layers": 24, "hidden_size": 1024, "num_attention_heads": 16},
        "text_config": {
            "num_hidden_layers": 40,
            "hidden_size": 5120,
            "num_attention_heads": 40,
            "num_key_value_heads": 8,
        },
        "num_hidden_layers": 99,  # the outer value must lose to text_config's
    }
    g = geometry_from_model_config(config)
    assert (g.num_layers, g.num_kv_heads, g.head_dim) == (40, 8, 128)
    assert g.kv_dtype == "float16"  # taken from the outer config when text_config lacks it


def test_text_config_that_is_not_a_map_is_ignored() -> None:
    g = geometry_from_model_config({**LLAMA_3_8B, "text_config": None})
    assert g.num_layers == 32


def test_new_style_dtype_key() -> None:
    config = {k: v for k, v in LLAMA_3_8B.items() if k != "torch_dtype"}
    assert geometry_from_model_config(config).kv_dtype is None
    assert geometry_from_model_config({**config, "dtype": "float16"}).kv_dtype == "float16"


def test_torch_dtype_preferred_over_dtype() -> None:
    g = geometry_from_model_config({**LLAMA_3_8B, "dtype": "float32"})
    assert g.kv_dtype == "bfloat16"


def test_empty_config_is_all_unknown() -> None:
    g = geometry_from_model_config({})
    assert g == Geometry(is_mla=False)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("num_hidden_layers", "32"),
        ("num_hidden_layers", 32.0),
        ("num_hidden_layers", True),
        ("num_hidden_layers", -1),
        ("num_key_value_heads", [8]),
        ("num_attention_heads", {"x": 1}),
        ("head_dim", "128"),
        ("hidden_size", 4096.5),
        ("kv_lora_rank", "512"),
    ],
)
def test_bad_values_raise(key: str, value: object) -> None:
    with pytest.raises(ModelConfigError, match=key):
        geometry_from_model_config({**LLAMA_3_8B, key: value})


@pytest.mark.parametrize(
    "key", ["num_hidden_layers", "num_key_value_heads", "num_attention_heads", "head_dim"]
)
def test_zero_sizes_raise(key: str) -> None:
    with pytest.raises(ModelConfigError):
        geometry_from_model_config({**LLAMA_3_8B, key: 0})


@pytest.mark.parametrize(
    "config",
    [
        LLAMA_3_8B,
        DEEPSEEK_V3,
        {"n_layer": 32, "n_head": 71, "hidden_size": 4544, "multi_query": True},
        {"text_config": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}},
        {},
    ],
)
def test_geometry_from_a_valid_config_is_accepted_by_the_registry(config: dict[str, Any]) -> None:
    geometry = geometry_from_model_config(config, tp_size=1, block_size=16, kv_layout="NHD")
    message = announce_message(WorkerIdentity(Role.PREFILL, "10.0.0.1:8100", "10.0.0.1:21001"))
    message["geometry"] = known_fields(geometry)
    decoded = decode_frame(msgpack.packb(message))
    assert isinstance(decoded, Announcement) and decoded.geometry is not None
    assert dataclasses.asdict(decoded.geometry) == dataclasses.asdict(geometry)


def test_hidden_not_divisible_by_heads_raises() -> None:
    with pytest.raises(ModelConfigError, match="not a multiple"):
        geometry_from_model_config({**LLAMA_3_8B, "hidden_size": 4100})


# --- load_tracker --------------------------------------------------------------------------------


def test_tracker_counts_a_request_through_its_life() -> None:
    tracker = LoadTracker()
    assert tracker.load() == Load(running=0, waiting=0, kv_usage=None)
    tracker.arrived("a")
    tracker.arrived("b")
    assert tracker.load() == Load(running=0, waiting=2)
    tracker.scheduled("a")
    assert tracker.load(kv_usage=0.3) == Load(running=1, waiting=1, kv_usage=0.3)
    tracker.finished("a")
    assert tracker.load() == Load(running=0, waiting=1)
    tracker.finished("b")  # finished while still waiting (aborted)
    assert tracker.load() == Load(running=0, waiting=0)


def test_tracker_is_idempotent() -> None:
    tracker = LoadTracker()
    for _ in range(3):
        tracker.arrived("a")
    assert tracker.load().waiting == 1
    for _ in range(3):
        tracker.scheduled("a")
    assert (tracker.load().running, tracker.load().waiting) == (1, 0)
    for _ in range(3):
        tracker.finished("a")
    assert (tracker.load().running, tracker.load().waiting) == (0, 0)


def test_tracker_preempted_request_stays_running() -> None:
    # arrived() again for a running request (re-queued after preemption) keeps it running.
    tracker = LoadTracker()
    tracker.arrived("a")
    tracker.scheduled("a")
    tracker.arrived("a")
    assert (tracker.load().running, tracker.load().waiting) == (1, 0)


def test_tracker_unknown_finish_is_harmless() -> None:
    tracker = LoadTracker()
    tracker.arrived("a")
    tracker.finished("never-seen")
    assert tracker.load() == Load(running=0, waiting=1)


def test_tracker_scheduled_without_arrival_counts_running() -> None:
    tracker = LoadTracker()
    tracker.scheduled("x")
    assert (tracker.load().running, tracker.load().waiting) == (1, 0)


def test_a_prefills_work_is_the_prompt_tokens_not_computed_yet() -> None:
    tracker = LoadTracker(counts_prefill_work=True)
    tracker.arrived("a", 1000)
    tracker.arrived("b", 300)
    assert tracker.load() == Load(running=0, waiting=2, prefill_tokens=1300)
    tracker.scheduled("a")
    tracker.computed("a", 512 + 256)  # 512 cached, a chunk of 256 computed this step
    assert tracker.load().prefill_tokens == 232 + 300
    tracker.computed("a", 1000)  # the last chunk: a's prefill is done
    assert tracker.load().prefill_tokens == 300
    tracker.finished("a")  # its decode step and finish change nothing more
    assert tracker.load().prefill_tokens == 300
    tracker.finished("b")  # aborted while queued
    assert tracker.load() == Load(running=0, waiting=0, prefill_tokens=0)


def test_prefill_work_survives_repeats_and_strangers() -> None:
    tracker = LoadTracker(counts_prefill_work=True)
    tracker.arrived("a", 100)
    tracker.arrived("a", 100)  # re-queued after a preemption: counted once
    tracker.computed("never-seen", 50)
    tracker.finished("never-seen")
    assert tracker.load().prefill_tokens == 100
    tracker.computed("a", 40)
    tracker.computed("a", 40)  # the same progress told twice
    assert tracker.load().prefill_tokens == 60
    tracker.computed("a", 10_000)  # never below nothing
    assert tracker.load().prefill_tokens == 0
    tracker.finished("a")
    assert tracker.load().prefill_tokens == 0


def test_a_decode_announces_no_prefill_work() -> None:
    tracker = LoadTracker()  # what a decode's connector builds
    tracker.arrived("a", 1000)
    assert tracker.load().prefill_tokens is None


# --- vllm_metrics --------------------------------------------------------------------------------

LABELS = 'engine="0",model_name="tiny-llama"'


def vllm_metrics_text(
    running: str = "3.0", waiting: str = "1.0", usage: str = "0.25", engines: tuple[str, ...] = ()
) -> str:
    """A /metrics page shaped like vLLM 0.32's (prometheus_client output)."""
    extra = {name: "" for name in ("running", "waiting", "usage")}
    for index, values in enumerate(engines, start=1):
        r, w, u = values.split(",")
        labels = f'engine="{index}",model_name="tiny-llama"'
        extra["running"] += f"vllm:num_requests_running{{{labels}}} {r}\n"
        extra["waiting"] += f"vllm:num_requests_waiting{{{labels}}} {w}\n"
        extra["usage"] += f"vllm:kv_cache_usage_perc{{{labels}}} {u}\n"
    return f"""\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{{generation="0"}} 3571.0
python_gc_objects_collected_total{{generation="1"}} 1120.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 1.234567168e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{LABELS}}} {running}
{extra["running"]}# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{{LABELS}}} {waiting}
{extra["waiting"]}# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{{LABELS}}} {usage}
{extra["usage"]}# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{{LABELS}}} 0.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{{LABELS}}} 4096.0
# HELP vllm:prompt_tokens_created Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{{{LABELS}}} 1.7530123456789e+09
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{{{LABELS},finished_reason="stop"}} 12.0
vllm:request_success_total{{{LABELS},finished_reason="length"}} 3.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{{LABELS},le="0.001"}} 0.0
vllm:time_to_first_token_seconds_bucket{{{LABELS},le="0.1"}} 9.0
vllm:time_to_first_token_seconds_bucket{{{LABELS},le="1.0"}} 15.0
vllm:time_to_first_token_seconds_bucket{{{LABELS},le="+Inf"}} 15.0
vllm:time_to_first_token_seconds_count{{{LABELS}}} 15.0
vllm:time_to_first_token_seconds_sum{{{LABELS}}} 0.8123
# HELP vllm:time_to_first_token_seconds_created Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds_created gauge
vllm:time_to_first_token_seconds_created{{{LABELS}}} 1.7530123456789e+09
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="2048"}} 1.0
"""


def test_single_engine_metrics() -> None:
    assert load_from_metrics(vllm_metrics_text()) == Load(running=3, waiting=1, kv_usage=0.25)


def test_idle_server() -> None:
    load = load_from_metrics(vllm_metrics_text("0.0", "0.0", "0.0"))
    assert load == Load(running=0, waiting=0, kv_usage=0.0)


def test_two_engines_sum_counts_and_take_the_fullest_cache() -> None:
    text = vllm_metrics_text("3.0", "1.0", "0.25", engines=("4.0,2.0,0.75",))
    assert load_from_metrics(text) == Load(running=7, waiting=3, kv_usage=0.75)


def test_three_engines_max_usage_from_any_engine() -> None:
    text = vllm_metrics_text("1.0", "0.0", "0.9", engines=("1.0,0.0,0.1", "1.0,5.0,0.2"))
    assert load_from_metrics(text) == Load(running=3, waiting=5, kv_usage=0.9)


def test_usage_is_clamped_to_a_fraction() -> None:
    assert load_from_metrics(vllm_metrics_text(usage="1.5")).kv_usage == 1.0
    assert load_from_metrics(vllm_metrics_text(usage="-0.5")).kv_usage == 0.0


def test_negative_counts_are_clamped() -> None:
    assert load_from_metrics(vllm_metrics_text(running="-2.0")).running == 0


def test_fractional_counts_are_rounded() -> None:
    assert load_from_metrics(vllm_metrics_text(running="2.6", waiting="0.4")).running == 3
    assert load_from_metrics(vllm_metrics_text(running="2.6", waiting="0.4")).waiting == 0


def test_absent_metrics_are_unknown() -> None:
    text = "\n".join(
        line for line in vllm_metrics_text().splitlines() if "kv_cache_usage" not in line
    )
    assert load_from_metrics(text + "\n") == Load(running=3, waiting=1, kv_usage=None)
    assert load_from_metrics("") == Load()
    only_process = "# TYPE process_open_fds gauge\nprocess_open_fds 12.0\n"
    assert load_from_metrics(only_process) == Load()


def test_untyped_samples_are_read_too() -> None:
    # Without HELP/TYPE lines the parser still yields the samples.
    text = "vllm:num_requests_running 2\nvllm:num_requests_waiting 0\n"
    assert load_from_metrics(text) == Load(running=2, waiting=0)


@pytest.mark.parametrize(
    "text",
    [
        "<html><body>502 Bad Gateway</body></html>",
        'vllm:num_requests_running{engine="0"} lots\n',
        "vllm:num_requests_running{engine=0} 1\n",
        "# TYPE vllm:num_requests_running gauge extra\n",
        "\x00\x01\x02{{{",
        '{"object": "error"}',
    ],
)
def test_garbage_is_a_metrics_format_error(text: str) -> None:
    with pytest.raises(MetricsFormatError):
        load_from_metrics(text)


def _load_or_format_error(text: str) -> Load | None:
    try:
        return load_from_metrics(text)
    except MetricsFormatError:
        return None


@PROFILE
@given(st.text(max_size=200))
def test_any_text_is_a_load_or_a_metrics_format_error(text: str) -> None:
    load = _load_or_format_error(text)
    if load is not None and load.kv_usage is not None:
        assert 0.0 <= load.kv_usage <= 1.0


_names = st.sampled_from(
    ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "x"]
)
_values = st.floats(allow_nan=False, allow_infinity=False, width=32).map(repr)


@PROFILE
@given(st.lists(st.tuples(_names, st.integers(0, 7), _values), max_size=8))
def test_finite_samples_always_give_a_valid_load(rows: list[tuple[str, int, str]]) -> None:
    text = "".join(f'{name}{{engine="{engine}"}} {value}\n' for name, engine, value in rows)
    load = load_from_metrics(text)
    for count in (load.running, load.waiting):
        assert count is None or count >= 0
    assert load.kv_usage is None or 0.0 <= load.kv_usage <= 1.0


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf", "1e999"])
def test_non_finite_counts_are_not_another_exception_type(value: str) -> None:
    text = vllm_metrics_text(running=value)
    try:
        load = load_from_metrics(text)
    except MetricsFormatError:
        return
    assert load.running is None or load.running >= 0


def test_non_finite_usage_is_unknown_not_empty() -> None:
    # NaN must not read as an empty cache (0.0) nor a full one: it says nothing.
    for value in ("NaN", "+Inf", "-Inf"):
        load = load_from_metrics(vllm_metrics_text(usage=value))
        assert load.kv_usage is None


# --- vllm_geometry -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("resolved", "expected"),
    [
        ("NHD", "NHD"),
        ("HND", "HND"),
        ("LBHNC", "HND"),  # vLLM 0.32: heads before tokens
        ("LBNHC", "NHD"),  # tokens before heads
        ("BLHNC", "HND"),  # another permutation, same rule
        ("BLNHC", "NHD"),
        ("HNLBC", "HND"),
        (None, None),
        ("", None),
        ("junk", None),
        ("LBHNX", None),
        ("LBHNCC", None),
        ("LBHN", None),
        ("lbhnc", None),
        ("LLHNC", None),
    ],
)
def test_layout_name(resolved: str | None, expected: str | None) -> None:
    assert layout_name(resolved) == expected


class Layout(enum.Enum):
    NHD = "NHD"
    HND = "HND"
    LBHNC = "LBHNC"
    LBNHC = "LBNHC"


@pytest.mark.parametrize(
    ("member", "expected"),
    [
        (Layout.NHD, "NHD"),
        (Layout.HND, "HND"),
        (Layout.LBHNC, "HND"),
        (Layout.LBNHC, "NHD"),
    ],
)
def test_layout_name_of_an_enum(member: Layout, expected: str) -> None:
    # str(Layout.LBNHC) is "Layout.LBNHC": only .name can be right.
    assert layout_name(member) == expected


def test_layout_name_of_an_object_with_a_name() -> None:
    assert layout_name(SimpleNamespace(name="LBNHC")) == "NHD"
    assert layout_name(SimpleNamespace(name="bogus")) is None


class FakeTorchDtype:
    """Prints like torch.float16 does."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __str__(self) -> str:
        return f"torch.{self._name}"


def test_kv_dtype_auto_follows_the_model() -> None:
    assert kv_dtype_name("auto", FakeTorchDtype("float16")) == "float16"
    assert kv_dtype_name("auto", FakeTorchDtype("bfloat16")) == "bfloat16"
    assert kv_dtype_name("auto", "float32") == "float32"


def test_explicit_kv_dtype_wins() -> None:
    assert kv_dtype_name("fp8_e4m3", FakeTorchDtype("bfloat16")) == "fp8_e4m3"
    assert kv_dtype_name("fp8", FakeTorchDtype("float16")) == "fp8"


def fake_vllm_config(**model_overrides: Any) -> SimpleNamespace:
    parallel = SimpleNamespace(tensor_parallel_size=2)

    def get_num_layers(parallel_config: object) -> int:
        assert parallel_config is parallel
        return 32

    model = SimpleNamespace(
        get_num_layers=get_num_layers,
        get_total_num_kv_heads=lambda: 8,
        get_head_size=lambda: 128,
        dtype=FakeTorchDtype("bfloat16"),
        use_mla=False,
    )
    for key, value in model_overrides.items():
        setattr(model, key, value)
    cache = SimpleNamespace(block_size=16, cache_dtype="auto", kv_cache_layout="LBHNC")
    return SimpleNamespace(model_config=model, parallel_config=parallel, cache_config=cache)


def test_geometry_from_vllm_config() -> None:
    assert geometry_from_vllm_config(fake_vllm_config()) == Geometry(
        tp_size=2,
        block_size=16,
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        kv_dtype="bfloat16",
        is_mla=False,
        kv_layout="HND",
    )


def test_a_failing_attribute_is_unknown_not_a_crash(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> int:
        raise RuntimeError("renamed in a newer vLLM")

    with caplog.at_level(logging.WARNING, logger="pdproxy.vllm_side"):
        geometry = geometry_from_vllm_config(fake_vllm_config(get_head_size=broken))
    assert geometry.head_dim is None
    assert geometry == Geometry(
        tp_size=2,
        block_size=16,
        num_layers=32,
        num_kv_heads=8,
        head_dim=None,
        kv_dtype="bfloat16",
        is_mla=False,
        kv_layout="HND",
    )
    assert "renamed in a newer vLLM" in caplog.text


def test_missing_attributes_are_unknown() -> None:
    config = fake_vllm_config()
    del config.cache_config.kv_cache_layout  # read with getattr(..., None)
    del config.model_config.use_mla
    config.cache_config.cache_dtype = "fp8_e5m2"
    geometry = geometry_from_vllm_config(config)
    assert geometry.kv_layout is None
    assert geometry.is_mla is None
    assert geometry.kv_dtype == "fp8_e5m2"
    assert geometry.num_layers == 32


def test_mla_config() -> None:
    config = fake_vllm_config(
        use_mla=True, get_total_num_kv_heads=lambda: 1, get_head_size=lambda: 576
    )
    geometry = geometry_from_vllm_config(config)
    assert (geometry.is_mla, geometry.num_kv_heads, geometry.head_dim) == (True, 1, 576)


def sidecar_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    base = ["announce", "--role", "P", "--http-address", "h:1", "--zmq-address", "h:2"]
    return parser.parse_args([*base, "--registry", "r:3", *argv])


# What a prefill of each kind tells the registry besides: where its connector is reached.
SIDECAR_COORDINATES: dict[Connector, tuple[str, ...]] = {
    Connector.MOONCAKE: ("--bootstrap", "h:8998"),
    Connector.NIXL_PUSH: ("--engine-id", "engine-1", "--side-channel", "h:5600"),
}


@pytest.mark.parametrize("kind", list(Connector))
def test_the_sidecar_announces_every_connector_kind_the_registry_knows(kind: Connector) -> None:
    coordinates = SIDECAR_COORDINATES.get(kind, ())
    identity = build_identity(sidecar_args("--connector", kind.value, *coordinates))
    decoded = decode_frame(msgpack.packb(announce_message(identity)))
    assert isinstance(decoded, Announcement) and decoded.connector is kind
    if coordinates:
        assert decoded.coordinates is not None
        if kind is Connector.MOONCAKE:
            assert str(decoded.coordinates.bootstrap) == "h:8998"
        else:
            assert decoded.coordinates.engine_id == "engine-1"
            assert str(decoded.coordinates.side_channel) == "h:5600"


@pytest.mark.parametrize(
    ("kind", "named"),
    [(Connector.MOONCAKE, "--bootstrap"), (Connector.NIXL_PUSH, "--engine-id, --side-channel")],
)
def test_the_sidecar_refuses_a_prefill_without_its_kinds_coordinates(
    kind: Connector, named: str
) -> None:
    # The registry would refuse every announcement of it: said once, at start, with the flags.
    with pytest.raises(ValueError, match=f"a {kind.value} prefill needs {named}"):
        build_identity(sidecar_args("--connector", kind.value))


def test_the_sidecar_refuses_an_unknown_connector_kind(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        sidecar_args("--connector", "P2pNcclConnector")
    assert "--connector" in capsys.readouterr().err


@pytest.mark.parametrize(
    "load",
    [Load(running=5, waiting=2, kv_usage=0.375), Load(running=0, waiting=0, kv_usage=None)],
)
@pytest.mark.parametrize("model", ["fake-model", 'odd "name"\\with\nbreaks'])
def test_the_fake_workers_metrics_read_back_as_its_load(load: Load, model: str) -> None:
    # What `pdproxy announce` scrapes from a fake worker is the load the worker holds.
    assert load_from_metrics(fake_worker_metrics(load, model)) == load


@pytest.mark.parametrize(
    ("error", "slow"),
    [
        (TimeoutError("no whole answer within 2s"), True),  # connect, wait or body too slow
        (ConnectionRefusedError(111, "refused"), False),
        (ConnectionResetError(104, "reset"), False),
        (http.client.RemoteDisconnected("closed without an answer"), False),
        (HttpStatusError("HTTP 503"), False),
        (ValueError("not vLLM's metrics"), False),
    ],
)
def test_only_a_scrape_out_of_time_counts_as_a_slow_server(error: Exception, slow: bool) -> None:
    """A slow server keeps its last load for a while (MetricsScraper); one that refuses the
    connection, resets it or answers something else is announced unhealthy at once."""
    assert scrape_timed_out(error) is slow
