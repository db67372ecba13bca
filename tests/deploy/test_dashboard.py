"""deploy/grafana/dashboards/pdproxy.json: every metric (and label) its PromQL names is one the
proxy really exports, taken from the Metrics class's registry and checked against a live scrape
of a running proxy that has served a request."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdproxy.base.roles import Role
from pdproxy.demo.fleet import WorkerSpec
from pdproxy.demo.processes import wait_until
from pdproxy.metrics import Metrics
from pdproxy.proxy.front import COMPLETION_PATHS, COUNTED_PATHS
from pdproxy.proxy.passthrough import PASSTHROUGH_PATHS, UNKNOWN_LABEL
from pdproxy.reliability.outlier import Circuit
from tests.conftest import FleetFactory
from tests.deploy.support import REPO

DASHBOARD: dict[str, Any] = json.loads(
    (REPO / "deploy" / "grafana" / "dashboards" / "pdproxy.json").read_text(encoding="utf-8")
)
# What Prometheus adds to every scraped series (pod: from Kubernetes service discovery, as a
# ServiceMonitor's scrape sets it).
TARGET_LABELS = {"job", "instance", "pod"}
# The dashboard's variables, and the matcher each metric selector carries for each.
VARIABLES = {"job": 'job=~"$job"', "pod": 'pod=~"$pod"'}
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
}
# PromQL words the dashboard may use besides metric names.
PROMQL_WORDS = {
    "sum",
    "max",
    "rate",
    "by",
    "histogram_quantile",
    "clamp_min",
    "or",
    "vector",
    "e",  # in 1e-9
}


def exported() -> dict[str, set[str]]:
    """Every sample name the proxy can export -> its label names (from the Metrics registry)."""
    metrics = Metrics()
    # Circuits are read from the outlier detector at scrape time: give it one to show.
    metrics.watch_circuits(lambda: {"127.0.0.1:1": Circuit.OPEN})
    labels = {
        collector._name: set(collector._labelnames)  # the declared label names
        for collector in vars(metrics).values()
        if hasattr(collector, "_labelnames")
    }
    names: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        if family.name in labels:
            declared = labels[family.name]
        else:  # a custom collector's family: its samples say
            declared = {k for x in family.samples for k in x.labels}
        for suffix in SUFFIXES.get(family.type, ("",)):
            names[family.name + suffix] = declared | ({"le"} if suffix == "_bucket" else set())
    return names


EXPORTED = exported()


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))


def expressions() -> list[str]:
    return [t["expr"] for p in panels(DASHBOARD["panels"]) for t in p.get("targets", [])]


def referenced(expr: str) -> tuple[set[str], set[str], set[str]]:
    """(metric names, label names, other words) an expression uses."""
    text = expr.replace("$__rate_interval", "")
    labels: set[str] = set()
    for block in re.findall(r"\{([^}]*)\}", text):  # label matchers
        labels |= set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", block))
    for block in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", text):  # grouping
        labels |= {name.strip() for name in block.split(",")}
    text = re.sub(r'"[^"]*"', "", text)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without)\s*\([^)]*\)", r"\1", text)
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", text))
    metrics = {w for w in words if w.startswith("pdproxy_")}
    return metrics, labels, words - metrics


def test_exported_names_follow_the_metric_types() -> None:
    assert "pdproxy_requests_total" in EXPORTED
    assert "pdproxy_requests" not in EXPORTED  # a counter is only exported with _total
    assert EXPORTED["pdproxy_request_duration_seconds_bucket"] == {"endpoint", "le"}
    assert EXPORTED["pdproxy_inflight_legs"] == {"role", "upstream"}


def test_every_panel_queries_something() -> None:
    for panel in panels(DASHBOARD["panels"]):
        if panel["type"] != "row":
            assert panel.get("targets"), panel["title"]
            assert all(t["expr"].strip() for t in panel["targets"]), panel["title"]


@pytest.mark.parametrize("expr", expressions())
def test_queries_name_only_exported_metrics_and_labels(expr: str) -> None:
    metrics, labels, words = referenced(expr)
    assert metrics, f"no pdproxy metric in {expr}"
    unknown = metrics - set(EXPORTED)
    assert not unknown, f"{sorted(unknown)} are not exported by pdproxy"
    assert words <= PROMQL_WORDS, f"unexpected names {sorted(words - PROMQL_WORDS)} in {expr}"
    known = set().union(*(EXPORTED[m] for m in metrics)) | TARGET_LABELS
    assert labels <= known, f"labels {sorted(labels - known)} not on {sorted(metrics)}"


def test_the_check_catches_a_misspelt_metric() -> None:
    metrics, _, _ = referenced("sum(rate(pdproxy_request_total[5m]))")
    assert metrics - set(EXPORTED) == {"pdproxy_request_total"}
    _, labels, _ = referenced('sum by (pod) (pdproxy_inflight_legs{rol="P"})')
    assert labels == {"pod", "rol"}


def test_the_dashboard_covers_every_metric_family() -> None:
    used = set().union(*(referenced(e)[0] for e in expressions()))
    families = {name for name in EXPORTED if not name.endswith("_created")}
    covered = {f for f in families if f in used}
    bases = {re.sub(r"_(total|bucket|sum|count)$", "", f) for f in covered}
    all_bases = {re.sub(r"_(total|bucket|sum|count)$", "", f) for f in families}
    assert bases == all_bases


# Label values pdproxy draws from fixed sets, by (metric, label).
ENUMS: dict[tuple[str, str], set[str]] = {
    ("pdproxy_registry_instances", "role"): {r.value for r in Role},
    ("pdproxy_inflight_legs", "role"): {r.value for r in Role},
    ("pdproxy_upstream_errors_total", "role"): {r.value for r in Role},
    ("pdproxy_requests_total", "endpoint"): {
        *COMPLETION_PATHS,
        *COUNTED_PATHS,
        *PASSTHROUGH_PATHS,
        UNKNOWN_LABEL,
    },
    ("pdproxy_request_duration_seconds_bucket", "endpoint"): {
        *COMPLETION_PATHS,
        *PASSTHROUGH_PATHS,
        UNKNOWN_LABEL,
    },
}


def matchers(expr: str) -> Iterator[tuple[str, str, str]]:
    """(metric, label, value) of every = or =~ matcher; =~ alternatives one by one."""
    for metric, block in re.findall(r"(pdproxy_\w+)\{([^}]*)\}", expr):
        for label, op, value in re.findall(r'(\w+)\s*(=~|=)\s*"([^"]*)"', block):
            for item in value.split("|") if op == "=~" else [value]:
                yield metric, label, item


def test_label_values_in_matchers_are_ones_pdproxy_uses() -> None:
    checked = 0
    for expr in expressions():
        for metric, label, value in matchers(expr):
            if label in VARIABLES:
                assert value == f"${label}", (metric, label, value)
                continue
            allowed = ENUMS.get((metric, label))
            if allowed is None:
                assert label == "status", (metric, label)  # regexes over status codes
                continue
            assert value in allowed, f'{metric}{{{label}="{value}"}} can never match'
            checked += 1
    assert checked >= 5
    bad = list(matchers('pdproxy_inflight_legs{role="P"}'))
    assert bad == [("pdproxy_inflight_legs", "role", "P")]
    assert "P" not in ENUMS[bad[0][:2]]


def test_job_and_pod_are_variables_that_show_everything_by_default() -> None:
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    for name in VARIABLES:
        variable = variables[name]
        assert variable["type"] == "query"
        assert variable["datasource"]["uid"] == "${datasource}"
        # All matches series without the label too (the compose demo's have no pod).
        assert variable["includeAll"] and variable["allValue"] == ".*"
        assert f", {name})" in variable["query"]["query"]
        metrics, _, _ = referenced(variable["query"]["query"].replace("label_values", "sum"))
        assert metrics <= set(EXPORTED)
    assert "$job" in variables["pod"]["query"]["query"]  # the pods of the chosen jobs


def unscoped(expr: str) -> list[str]:
    """The metric selectors of `expr` that lack a dashboard variable's matcher."""
    selectors = re.findall(r"pdproxy_\w+(?:\{[^}]*\})?", expr)
    return [s for s in selectors if not all(m in s for m in VARIABLES.values())]


@pytest.mark.parametrize("expr", expressions())
def test_every_query_is_filtered_by_job_and_pod(expr: str) -> None:
    assert unscoped(expr) == []


def test_the_filter_check_catches_a_missing_variable() -> None:
    expr = 'sum(rate(pdproxy_requests_total{job=~"$job"}[5m])) / sum(pdproxy_queued_requests)'
    assert unscoped(expr) == ['pdproxy_requests_total{job=~"$job"}', "pdproxy_queued_requests"]


def quantiles_combined(expr: str) -> bool:
    """Whether `expr` does arithmetic on a histogram_quantile(): quantiles do not add up, so a
    quantile must be the whole expression."""
    count = expr.count("histogram_quantile(")
    if count == 0:
        return False
    if count > 1 or not expr.startswith("histogram_quantile("):
        return True
    depth = 0
    for position, char in enumerate(expr):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and char == ")":
            return position != len(expr) - 1
    return True


@pytest.mark.parametrize("expr", expressions())
def test_no_query_adds_quantiles(expr: str) -> None:
    assert not quantiles_combined(expr), expr


def test_the_quantile_check_catches_a_sum_of_two() -> None:
    p50 = "histogram_quantile(0.5, sum by (le) (rate({}_bucket[5m])))"
    prefill = p50.format("pdproxy_prefill_duration_seconds")
    decode = p50.format("pdproxy_decode_first_byte_seconds")
    assert quantiles_combined(f"{prefill} + {decode}")
    assert quantiles_combined(f"{prefill} * 1000")
    assert not quantiles_combined(prefill)


KV_FAMILIES = {
    "pdproxy_kv_transfer_bytes_total",
    "pdproxy_kv_transfers_total",
    "pdproxy_kv_transfer_duration_seconds_bucket",
    "pdproxy_kv_transfer_bandwidth_bytes_per_second",
}


def test_the_kv_transfer_row_plots_every_kv_metric() -> None:
    assert {name for name in EXPORTED if name.startswith("pdproxy_kv_")} >= KV_FAMILIES
    rows = [p for p in DASHBOARD["panels"] if p["type"] == "row"]
    [row] = [r for r in rows if r["title"] == "KV transfer"]
    below = [
        p
        for p in DASHBOARD["panels"]
        if p["type"] != "row" and p["gridPos"]["y"] > row["gridPos"]["y"]
    ]
    used = set().union(*(referenced(t["expr"])[0] for p in below for t in p["targets"]))
    assert used == KV_FAMILIES
    by_pair = [
        t["expr"] for p in below for t in p["targets"] if "by (prefill, decode)" in t["expr"]
    ]
    assert len(by_pair) == 2  # bytes/s and bandwidth, one series per pair


# Workers report their transfers to every proxy replica (pdproxy/vllm_side/fanout.py), so each
# replica's series already count the whole fleet's: added over pods, every transfer would count
# once per replica. (Quantiles are left as they are: identical copies change no ratio.)
FLEET_WIDE_KV = KV_FAMILIES - {"pdproxy_kv_transfer_duration_seconds_bucket"}


def test_kv_figures_every_replica_holds_are_not_added_over_replicas() -> None:
    queries = [expr for expr in expressions() if referenced(expr)[0] & FLEET_WIDE_KV]
    assert len(queries) == 3  # bytes per pair, transfers by outcome, bandwidth per pair
    for expr in queries:
        assert expr.startswith("max by ("), expr


def test_a_live_scrape_matches_the_registry(fleet_factory: FleetFactory) -> None:
    """A real proxy that served a request exports exactly these names and labels."""
    fleet = fleet_factory([WorkerSpec("P"), WorkerSpec("D")])
    body = json.dumps({"model": "fake-model", "prompt": "hello", "max_tokens": 3}).encode()
    request = urllib.request.Request(
        fleet.proxy_url + "/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200

    def scrape() -> str:
        with urllib.request.urlopen(fleet.proxy_url + "/metrics", timeout=10) as response:
            text: str = response.read().decode()
        return text

    # The fake workers report the request's KV transfer a moment after it was answered.
    wait_until(
        lambda: 'pdproxy_kv_transfers_total{outcome="ok"} 1.0' in scrape(),
        15,
        "the KV transfer to be counted",
        fleet.processes(),
    )
    text = scrape()
    seen: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("pdproxy_"):
                seen.setdefault(sample.name, set()).update(sample.labels)
    assert seen, "no pdproxy metrics in the scrape"
    for name, labels in seen.items():
        assert name in EXPORTED, name
        assert labels == EXPORTED[name], name
    # Everything the dashboard plots once traffic flowed is in the scrape (failures aside:
    # failed legs and circuits exist only once something failed; watch restarts only with
    # Kubernetes discovery on).
    used = set().union(*(referenced(e)[0] for e in expressions()))
    assert used - set(seen) <= {
        "pdproxy_upstream_errors_total",
        "pdproxy_upstream_circuit_state",
        "pdproxy_discovery_watch_restarts_total",
    }


def test_panels_have_unique_ids_and_do_not_overlap() -> None:
    laid_out = list(panels(DASHBOARD["panels"]))
    ids = [p["id"] for p in laid_out]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for panel in laid_out:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]
