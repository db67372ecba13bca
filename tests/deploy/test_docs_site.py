"""The documentation site (mkdocs.yml, tools/docs_site.py, `make docs`): it builds in strict mode
with every page of the repository at its repository path, and the build really fails on a broken
relative link or anchor, naming it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mkdocs.config import load_config

from tests.deploy.support import REPO
from tools import docs_site

CONFIG = REPO / "mkdocs.yml"
HOOK = REPO / "tools" / "docs_site.py"


def nav() -> object:
    return load_config(str(CONFIG)).nav


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """`mkdocs build --strict` as `make docs` runs it, into `site`."""
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=config.parent,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def tracked_markdown() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "*.md"], cwd=REPO, capture_output=True, text=True, check=True
    )
    return listed.stdout.split()


def test_the_site_builds_strictly_with_every_page_at_its_repository_path(tmp_path: Path) -> None:
    site = tmp_path / "site"
    result = build(CONFIG, site)
    assert result.returncode == 0, result.stderr
    assert "WARNING" not in result.stderr, result.stderr

    home = (site / "index.html").read_text(encoding="utf-8")
    assert "The front door for prefill/decode-disaggregated vLLM fleets." in home
    # README's links into docs/ and the chart's README point at those pages in the site.
    assert 'href="docs/vllm/"' in home
    assert 'href="helm/pdproxy/"' in home
    for page in docs_site.nav_pages(nav()):
        if page != "README.md":
            served = site / page.removesuffix(".md").removesuffix("README") / "index.html"
            assert served.is_file(), f"{page} is not at {served.relative_to(site)}"
    chart = (site / "helm" / "pdproxy" / "index.html").read_text(encoding="utf-8")
    assert 'href="../../docs/vllm/#vllm-flags-that-must-match"' in chart
    assert (site / "helm" / "pdproxy" / "values.schema.json").read_bytes() == (
        REPO / "helm" / "pdproxy" / "values.schema.json"
    ).read_bytes()
    assert (site / "helm" / "pdproxy" / "examples" / "fleet-2p2d.yaml").is_file()


def test_every_markdown_file_of_the_repository_is_in_the_nav() -> None:
    """The site holds the nav's pages only, so a document left out of it would be missing from
    the site without any link failing."""
    assert sorted(tracked_markdown()) == sorted(docs_site.nav_pages(nav()))


def test_a_nav_page_that_does_not_exist_is_named(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("# home\n", encoding="utf-8")
    with pytest.raises(FileNotFoundError, match=r"docs/gone\.md"):
        docs_site.site_sources(tmp_path, [{"Home": "README.md"}, {"Gone": "docs/gone.md"}])


@pytest.mark.parametrize(
    ("page", "link", "complaint"),
    [
        (
            "docs/vllm.md",
            "[settings](reference/setting.md)",
            "Doc file 'docs/vllm.md' contains a link 'reference/setting.md', but the target "
            "'docs/reference/setting.md' is not found",
        ),
        (
            "helm/pdproxy/README.md",
            "[flags](../../docs/vllm.md#no-such-heading)",
            "Doc file 'helm/pdproxy/README.md' contains a link "
            "'../../docs/vllm.md#no-such-heading', but the doc 'docs/vllm.md' does not contain "
            "an anchor '#no-such-heading'",
        ),
        (
            "README.md",
            "[benchmarks](benchmarks/)",
            "Doc file 'README.md' contains an unrecognized relative link 'benchmarks/'",
        ),
    ],
)
def test_a_broken_link_fails_the_build_naming_it(
    tmp_path: Path, page: str, link: str, complaint: str
) -> None:
    """A copy of the site's sources with one link broken: the build fails on that link alone."""
    copy = tmp_path / "repo"
    for path in ["mkdocs.yml", "tools/docs_site.py", *docs_site.site_sources(REPO, nav())]:
        (copy / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / path, copy / path)
    with (copy / page).open("a", encoding="utf-8") as doc:
        doc.write(f"\nSee {link}.\n")

    result = build(copy / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0
    warnings = [line for line in result.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, result.stderr
    assert complaint in warnings[0]
    assert "Aborted with 1 warnings in strict mode" in result.stdout + result.stderr
