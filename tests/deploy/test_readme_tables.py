"""The documentation's generated reference tables (tools/readme_tables.py): the chart values in
helm/pdproxy/README.md and the metrics in docs/reference/metrics.md, in sync with the chart's
schema and values.yaml and with the Metrics registry, and covering every value and every metric,
so a value or metric added without regenerating the tables fails here."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import Counter
from prometheus_client.metrics import MetricWrapperBase

from pdproxy.config import Settings
from pdproxy.metrics import Metrics
from tests.deploy.support import CHART, REPO
from tools import readme_tables

VALUES_DOC = CHART / "README.md"
METRICS_DOC = REPO / "docs" / "reference" / "metrics.md"
SCRIPT = REPO / "tools" / "readme_tables.py"
SCHEMA: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
VALUES_TEXT = (CHART / "values.yaml").read_text(encoding="utf-8")
DEFAULT_VALUES: dict[str, Any] = yaml.safe_load(VALUES_TEXT)


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    """The script as CI and people run it: by path, from the repository's root."""
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def block(text: str, name: str) -> str:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    assert text.count(begin) == 1 and text.count(end) == 1, f"the document lacks the {name} markers"
    return text.partition(begin)[2].partition(end)[0]


def rows(markdown: str) -> list[list[str]]:
    """The body rows of the one table in `markdown`, cells split on unescaped pipes."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    assert len(lines) > 2, "no table"
    return [
        [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
        for line in lines[2:]  # past the header and the --- line
    ]


def first_code(cell: str) -> str:
    found = re.search(r"`([^`]+)`", cell)
    assert found, f"no code span in {cell!r}"
    return found.group(1)


def unescape(cell: str) -> str:
    return cell.replace("\\|", "|").replace("&lt;", "<")


# ---- written independently of the tool, so that a bug there cannot hide a missing row -----


def resolve(node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = SCHEMA["definitions"][node["$ref"].removeprefix("#/definitions/")]
    return node


def declared_leaves(node: dict[str, Any], prefix: str = "") -> set[str]:
    """Every value path the schema declares whose keys are not spelled out there (shared
    `$ref` types such as `resources` count as one value, like values.yaml's defaults do)."""
    leaves: set[str] = set()
    for key, child in resolve(node).get("properties", {}).items():
        path = f"{prefix}{key}"
        if "$ref" not in child and "properties" in child:
            leaves |= declared_leaves(child, f"{path}.")
        else:
            leaves.add(path)
    return leaves


def default_leaves(values: Any, leaves: set[str], prefix: str = "") -> dict[str, Any]:
    """values.yaml's default of every declared leaf it sets."""
    found: dict[str, Any] = {}
    for key, value in values.items():
        path = f"{prefix}{key}"
        if path in leaves:
            found[path] = value
        elif isinstance(value, dict):
            found |= default_leaves(value, leaves, f"{path}.")
    return found


def metric_collectors(metrics: Metrics) -> dict[str, MetricWrapperBase]:
    return {
        family.name: metric
        for metric in vars(metrics).values()
        if isinstance(metric, MetricWrapperBase)
        for family in metric.describe()
    }


LEAVES = declared_leaves(SCHEMA)
VALUES_TEXT_DOC = VALUES_DOC.read_text(encoding="utf-8")
METRICS_TEXT_DOC = METRICS_DOC.read_text(encoding="utf-8")
VALUE_ROWS = {first_code(row[0]): row for row in rows(block(VALUES_TEXT_DOC, "values-reference"))}
METRIC_ROWS = {
    first_code(row[0]): row for row in rows(block(METRICS_TEXT_DOC, "metrics-reference"))
}


def test_the_tool_writes_where_the_tables_are() -> None:
    assert readme_tables.TARGETS == {
        readme_tables.VALUES_BLOCK: VALUES_DOC,
        readme_tables.METRICS_BLOCK: METRICS_DOC,
    }


# ---- the documents are up to date --------------------------------------------------------------


def test_reference_tables_are_up_to_date() -> None:
    result = run_script("--check")
    assert result.returncode == 0, (
        "the reference tables are stale; run `python tools/readme_tables.py --write`:\n"
        + result.stdout
        + result.stderr
    )


def test_every_schema_value_has_a_row() -> None:
    assert LEAVES, "the walk found no values"
    missing = sorted(LEAVES - set(VALUE_ROWS))
    assert not missing, f"values without a row in the chart's README: {missing}"
    leaf_rows = {path for path, row in VALUE_ROWS.items() if not row[0].startswith("**")}
    assert leaf_rows == LEAVES, f"rows for undeclared values: {sorted(leaf_rows - LEAVES)}"


def test_every_row_shows_the_values_yaml_default() -> None:
    defaults = default_leaves(DEFAULT_VALUES, LEAVES)
    assert "fleet.prefill.replicas" in defaults and "config.ttl" in defaults
    for path, value in defaults.items():
        assert first_code(unescape(VALUE_ROWS[path][2])) == json.dumps(value), path
    for path in LEAVES - set(defaults):
        assert VALUE_ROWS[path][2].startswith("unset"), path


def test_config_rows_describe_the_settings_field() -> None:
    config = {path.removeprefix("config.") for path in LEAVES if path.startswith("config.")}
    assert config and config <= set(Settings.model_fields)
    for name in config:
        row = VALUE_ROWS[f"config.{name}"]
        assert row[3], f"config.{name} has no description"
        if name not in DEFAULT_VALUES["config"]:
            builtin = Settings.model_fields[name].get_default(call_default_factory=True)
            assert f"pdproxy: `{json.dumps(builtin)}`" in row[2], row


def test_every_metric_has_a_row() -> None:
    metrics = Metrics()
    defined = metric_collectors(metrics)
    families = list(metrics.registry.collect())
    assert len(families) >= 10
    exported = set()
    for family in families:
        name = family.name + ("_total" if family.type == "counter" else "")
        exported.add(name)
        assert name in METRIC_ROWS, f"metric {name} has no row in docs/reference/metrics.md"
        row = METRIC_ROWS[name]
        assert row[1].split(" ")[0] == family.type, row
        labels = set(re.findall(r"`([^`]+)`", row[2]))
        assert labels == set(defined[family.name]._labelnames), row
        assert unescape(row[3]) == " ".join(family.documentation.split()), row
    assert set(METRIC_ROWS) == exported, "rows for metrics the proxy does not export"


# ---- the tool notices what is new or missing ---------------------------------------------------


def test_a_new_value_needs_a_row() -> None:
    schema = json.loads(json.dumps(SCHEMA))
    schema["properties"]["fleet"]["properties"]["prefill"]["properties"]["newKnob"] = {
        "type": "integer",
        "minimum": 2,
        "description": "A knob added after the README was written.",
    }
    body = readme_tables.values_block(schema, VALUES_TEXT)
    assert (
        "| `fleet.prefill.newKnob` | integer ≥ 2 | unset | A knob added after the README was "
        "written. |" in body
    )
    regenerated = readme_tables.updated(VALUES_TEXT_DOC, {readme_tables.VALUES_BLOCK: body})
    assert regenerated != VALUES_TEXT_DOC


def test_a_new_metric_needs_a_row() -> None:
    class MoreMetrics(Metrics):
        def __init__(self) -> None:
            super().__init__()
            self.extra = Counter(
                "pdproxy_new_things", "Things counted later.", ["kind"], registry=self.registry
            )

    body = readme_tables.metrics_block(MoreMetrics())
    assert "| `pdproxy_new_things_total` | counter | `kind` | Things counted later. | no |" in body
    regenerated = readme_tables.updated(METRICS_TEXT_DOC, {readme_tables.METRICS_BLOCK: body})
    assert regenerated != METRICS_TEXT_DOC


def test_check_reports_stale_documents_and_write_fixes_them(tmp_path: Path) -> None:
    originals = {"values": VALUES_TEXT_DOC, "metrics": METRICS_TEXT_DOC}
    row = {"values": "| `config.ttl` ", "metrics": "| `pdproxy_requests_total` "}
    docs = {kind: tmp_path / f"{kind}.md" for kind in originals}
    for kind, text in originals.items():
        lines = text.splitlines(keepends=True)
        dropped = [line for line in lines if line.startswith(row[kind])]
        assert len(dropped) == 1, kind
        docs[kind].write_text("".join(line for line in lines if line not in dropped), "utf-8")
    paths = ("--values-doc", str(docs["values"]), "--metrics-doc", str(docs["metrics"]))

    checked = run_script("--check", *paths)
    assert checked.returncode == 1
    assert "+| `config.ttl` " in checked.stdout
    assert "+| `pdproxy_requests_total` " in checked.stdout
    assert "--write" in checked.stdout

    assert run_script("--write", *paths).returncode == 0
    assert run_script("--check", *paths).returncode == 0
    # Only the marked blocks are touched: the rest of each file is exactly as it was.
    generated = readme_tables.blocks()
    assert docs["values"].read_text(encoding="utf-8") == readme_tables.updated(
        VALUES_TEXT_DOC, {readme_tables.VALUES_BLOCK: generated[readme_tables.VALUES_BLOCK]}
    )
    assert docs["metrics"].read_text(encoding="utf-8") == readme_tables.updated(
        METRICS_TEXT_DOC, {readme_tables.METRICS_BLOCK: generated[readme_tables.METRICS_BLOCK]}
    )


@pytest.mark.parametrize("markers", ["none", "twice", "reversed"])
def test_missing_or_broken_markers_are_an_error(tmp_path: Path, markers: str) -> None:
    begin, end = "<!-- values-reference:begin -->", "<!-- values-reference:end -->"
    inner = block(VALUES_TEXT_DOC, "values-reference")
    text = {
        "none": VALUES_TEXT_DOC.replace(f"{begin}{inner}{end}", ""),
        "twice": VALUES_TEXT_DOC + f"\n{begin}\n{end}\n",
        "reversed": VALUES_TEXT_DOC.replace(f"{begin}{inner}{end}", f"{end}{inner}{begin}"),
    }[markers]
    broken = tmp_path / "README.md"
    broken.write_text(text, encoding="utf-8")
    result = run_script("--check", "--values-doc", str(broken))
    assert result.returncode == 2
    assert "values-reference" in result.stderr
    assert broken.read_text(encoding="utf-8") == text


def test_the_front_page_holds_no_generated_table() -> None:
    front = (REPO / "README.md").read_text(encoding="utf-8")
    for name in (readme_tables.VALUES_BLOCK, readme_tables.METRICS_BLOCK):
        assert f"<!-- {name}:" not in front, name
