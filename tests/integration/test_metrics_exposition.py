"""/metrics of a live proxy, after traffic through fake workers (successes, a KV transfer, failed
legs): Prometheus' own promtool finds no problem in it, every family it exports is in
docs/reference/metrics.md, and its labels follow one vocabulary. In one process and with
several workers (whose /metrics sums the processes' files)."""

from __future__ import annotations

import re
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdproxy.base.roles import Role
from pdproxy.demo.fleet import LocalFleet, WorkerSpec
from pdproxy.demo.processes import wait_until
from tests.conftest import FleetFactory
from tests.deploy.support import REPO
from tests.harness.promtool import PromtoolUnavailable, check_metrics
from tests.integration.support import post_json, set_behaviour

MODEL = "fake-model"
REFERENCE = REPO / "docs" / "reference" / "metrics.md"
# Label names that would say `reason` (a failure's kind) or `upstream` another way.
OTHER_WORDS = {"kind", "error", "instance", "worker", "type"}


def referenced() -> set[str]:
    """The metric names docs/reference/metrics.md's generated table lists."""
    text = REFERENCE.read_text(encoding="utf-8")
    block = text.split("<!-- metrics-reference:begin -->")[1].split("<!-- metrics-reference:end")[0]
    return set(re.findall(r"^\| `(pdproxy_\w+)` \|", block, flags=re.MULTILINE))


def scrape(fleet: LocalFleet) -> bytes:
    with urllib.request.urlopen(fleet.proxy_url + "/metrics", timeout=10) as response:
        body: bytes = response.read()
    return body


def serve_traffic(fleet: LocalFleet) -> None:
    """Successes (plain and streamed, both endpoints), a counted KV transfer, then failed
    legs: the labelled series exist."""
    completion = {"model": MODEL, "prompt": "hello", "max_tokens": 3}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    assert post_json(fleet.proxy_url + "/v1/completions", completion).status == 200
    assert post_json(fleet.proxy_url + "/v1/chat/completions", chat).status == 200
    counted = re.compile(rb'^pdproxy_kv_transfers_total\{outcome="ok"\} [1-9]', re.MULTILINE)
    wait_until(
        lambda: counted.search(scrape(fleet)) is not None,
        15,
        "a KV transfer to be counted",
        fleet.processes(),
    )
    set_behaviour(fleet.role("P")[0].url, status=500)
    assert post_json(fleet.proxy_url + "/v1/completions", completion).status == 502


@pytest.mark.parametrize("workers", [1, 2])
def test_a_live_scrape_passes_promtool_and_is_documented(
    fleet_factory: FleetFactory, workers: int
) -> None:
    fleet = fleet_factory(
        [WorkerSpec("P"), WorkerSpec("D")], proxy_args=["--workers", str(workers)]
    )
    serve_traffic(fleet)
    text = scrape(fleet)
    try:
        code, said = check_metrics(text)
    except PromtoolUnavailable as exc:
        pytest.fail(f"promtool is needed to check /metrics and could not be set up: {exc}")
    assert (code, said.strip()) == (0, ""), f"promtool check metrics complains:\n{said}"

    families = list(text_string_to_metric_families(text.decode()))
    assert families and all(f.name.startswith("pdproxy_") for f in families)
    # The text format gives a counter's or histogram's _created series a family of its own
    # (the reference notes them once for all).
    timed = {f.name + "_created" for f in families if f.type in ("counter", "histogram")}
    exported = {
        f.name + ("_total" if f.type == "counter" else "") for f in families if f.name not in timed
    }
    assert len(exported) >= 20
    if workers == 1:  # circuits are per worker: with two, the other may have seen the failures
        assert "pdproxy_upstream_circuit_state" in exported  # read at scrape time, listed too
    assert exported - referenced() == set(), "exported but not in docs/reference/metrics.md"
    # The traffic made the per-upstream and per-pair series (their label sets exist only then).
    labels = {s.name: set(s.labels) for f in families for s in f.samples}
    assert labels["pdproxy_inflight_legs"] == {"role", "upstream"}
    assert labels["pdproxy_kv_transfer_bytes_total"] == {"prefill", "decode"}

    roles = {r.value for r in Role}
    for family in families:
        for sample in family.samples:
            assert not set(sample.labels) & OTHER_WORDS, (sample.name, sample.labels)
            if "role" in sample.labels:
                assert sample.labels["role"] in roles, (sample.name, sample.labels)
    failed = 'pdproxy_upstream_errors_total{reason="status_5xx",role="prefill"}'
    assert re.search(re.escape(failed) + r" [1-9]", text.decode()), "the failed leg is counted"


def test_the_check_catches_what_promtool_complains_about() -> None:
    """promtool really reads the text: a counter without _total and no HELP is a problem."""
    code, said = check_metrics(b"# TYPE pdproxy_bad counter\npdproxy_bad 1\n")
    assert code != 0 and "_total" in said, said
