"""benchmarks/bench_routers.py's pure parts: the nginx router's arguments and configuration, and
the ratios to nginx in the rows and tables. Nothing is started."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.benchmark_scripts import benchmark_script


@pytest.fixture(scope="module")
def bench() -> Iterator[Any]:
    with benchmark_script("bench_routers") as module:
        yield module


def test_nginx_is_a_router_to_choose(bench: Any) -> None:
    args = bench.parse_args(["--routers", "pdproxy,nginx"])
    assert args.routers == ["pdproxy", "nginx"]
    assert "nginx" not in bench.parse_args([]).routers  # fetched only when asked for
    with pytest.raises(SystemExit):
        bench.parse_args(["--routers", "nginx,apache"])


def test_nginx_conf_does_prefill_then_decode_on_loopback(bench: Any, tmp_path: Path) -> None:
    conf = bench.nginx_conf(tmp_path, 8000, 8101, 8102, 5000)
    assert "listen 127.0.0.1:8000;" in conf
    assert "server 127.0.0.1:8101;" in conf and "server 127.0.0.1:8102;" in conf
    assert "auth_request /_prefill;" in conf
    assert (
        "proxy_pass http://decode;" in conf and "proxy_pass http://prefill/v1/completions;" in conf
    )
    assert '"max_tokens":1' in conf and "proxy_method POST;" in conf
    assert conf.count("keepalive 64;") == 2 and 'proxy_set_header Connection "";' in conf
    assert "proxy_buffering off;" in conf and "access_log off;" in conf
    assert "daemon off;" in conf and "worker_processes 1;" in conf
    assert "worker_connections 5000;" in conf
    # Nothing outside the prefix: no /var/log, /var/lib or /run.
    assert f"pid {tmp_path / 'nginx.pid'};" in conf
    assert "/var/" not in conf and "/run" not in conf
    for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        assert f"{kind}_temp_path {tmp_path / kind};" in conf


def test_nginx_worker_connections_cover_the_load_and_the_idle_streams(bench: Any) -> None:
    args = argparse.Namespace(
        concurrency=[1, 64, 256],
        stream_concurrency=64,
        skip_stream=False,
        skip_idle=True,
        idle_streams=8500,
        fd_reserve=3000,
    )
    assert bench.nginx_worker_connections(args) == bench.NGINX_MIN_CONNECTIONS
    args.concurrency = [4000]
    assert bench.nginx_worker_connections(args) == 3 * 4000 + 1024
    args.skip_idle = False
    wanted = 2 * (8500 + bench.SLOT_HEADROOM) + 3000
    assert bench.nginx_worker_connections(args) == wanted


def test_nginx_keeps_as_many_upstream_connections_as_the_load_has_in_flight(
    bench: Any, tmp_path: Path
) -> None:
    conf = bench.nginx_conf(tmp_path, 8000, 8101, 8102, 5000, keepalive=256)
    assert conf.count("keepalive 256;") == 2
    args = argparse.Namespace(concurrency=[1, 256], stream_concurrency=64, skip_stream=False)
    assert bench.nginx_busiest(args) == 256


def run(router: str, kind: str, speed: float, cpu: float, round_index: int = 0) -> dict[str, Any]:
    key, cpu_key = (
        ("rps", "server_cpu_us_per_req")
        if kind == "nonstream"
        else ("events_per_s", "server_cpu_us_per_chunk")
    )
    row = {"router": router, "concurrency": 64, "round": round_index, "errors": 0}
    row.update({key: speed, cpu_key: cpu, "p50_ms": 1.0, "p99_ms": 2.0, "aux_busy": 0.5})
    if kind == "stream":
        row["rps"] = speed / 256
    return row


def results(with_nginx: bool = True) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {"nonstream": [], "stream": [], "idle": []}
    for kind, scale in (("nonstream", 1.0), ("stream", 100.0)):
        out[kind] += [
            run("direct", kind, 80_000 * scale, 6),
            run("pdproxy", kind, 5_000 * scale, 200),
            run("vllm-router", kind, 8_000 * scale, 125),
        ]
        if with_nginx:
            out[kind].append(run("nginx", kind, 10_000 * scale, 50))
    return out


def test_every_router_gets_its_ratio_to_nginx_of_the_same_round(bench: Any) -> None:
    res = results()
    bench.add_ratios(res)
    rows = {r["router"]: r for r in res["nonstream"]}
    assert rows["pdproxy"]["vs_nginx"] == pytest.approx(0.5)
    assert rows["pdproxy"]["cpu_vs_nginx"] == pytest.approx(4.0)
    assert rows["vllm-router"]["vs_nginx"] == pytest.approx(0.8)
    assert rows["nginx"]["vs_nginx"] == pytest.approx(1.0)
    assert rows["nginx"]["vs_baseline"] == pytest.approx(1.25)
    assert rows["direct"]["vs_nginx"] is None and rows["direct"]["cpu_vs_nginx"] is None
    streamed = {r["router"]: r for r in res["stream"]}
    assert streamed["pdproxy"]["cpu_vs_nginx"] == pytest.approx(4.0)


def test_tables_have_the_nginx_columns_only_when_it_ran(bench: Any) -> None:
    for with_nginx in (True, False):
        res = results(with_nginx)
        bench.add_ratios(res)
        summary = {kind: bench.summarize(res[kind]) for kind in ("nonstream", "stream")}
        meta = {"rounds": 1, "stream_interval_ms": 0, "stream_tokens": 256}
        text = bench.tables({"results": res, "summary": summary, "meta": meta})
        assert ("| vs nginx |" in text) is with_nginx
        assert ("| CPU vs nginx |" in text) is with_nginx
        pdproxy = next(line for line in text.splitlines() if line.startswith("| pdproxy | 64 |"))
        assert ("| 0.50 |" in pdproxy) is with_nginx and ("| 4.00 |" in pdproxy) is with_nginx


def test_several_rounds_give_the_range_of_the_ratio_to_nginx(bench: Any) -> None:
    res: dict[str, list[dict[str, Any]]] = {"nonstream": [], "stream": [], "idle": []}
    for round_index, nginx_rps in enumerate((10_000, 4_000)):
        res["nonstream"] += [
            run("pdproxy", "nonstream", 5_000, 200, round_index),
            run("vllm-router", "nonstream", 8_000, 125, round_index),
            run("nginx", "nonstream", nginx_rps, 50, round_index),
        ]
    bench.add_ratios(res)
    row = next(r for r in bench.summarize(res["nonstream"]) if r["router"] == "pdproxy")
    assert (row["vs_nginx_min"], row["vs_nginx_max"], row["vs_nginx_ahead"]) == (0.5, 1.25, 1)
