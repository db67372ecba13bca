"""The documentation site's sources, as an MkDocs hook (mkdocs.yml's `hooks:`).

The pages stay where they are in the repository (README.md, docs/, helm/pdproxy/README.md, ...)
and the site keeps their repository paths: README.md is the home page, docs/vllm.md is served at
docs/vllm/, and so a relative link between two pages works the same on GitHub and in the site,
with no copy of any page to keep in step. MkDocs reads only its docs_dir (docs/), so this hook
replaces what it found there with the repository's files:

- every Markdown page named in mkdocs.yml's `nav` (a page left out of the nav is not in the site,
  so a link to it fails the strict build);
- `DOWNLOADS`, the non-Markdown files the pages link to (served as they are).

    make docs                                    # mkdocs build --strict into site/
    .venv-docs/bin/mkdocs serve                  # the same site, rebuilt on every edit
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

# Files the pages link to that are not pages, as glob patterns from the repository's root.
DOWNLOADS = (
    "helm/pdproxy/values.schema.json",
    "helm/pdproxy/examples/*.yaml",
    "deploy/bare-metal/xpyd.sh",
)


def nav_pages(nav: Any) -> Iterator[str]:
    """The Markdown paths in an MkDocs `nav` (a list of paths, of {title: path} and of
    {title: [...]} sections), in order; external links are skipped."""
    if isinstance(nav, str):
        if nav.endswith(".md") and "://" not in nav:
            yield nav
    elif isinstance(nav, list):
        for item in nav:
            yield from nav_pages(item)
    elif isinstance(nav, dict):
        for value in nav.values():
            yield from nav_pages(value)


def site_sources(root: Path, nav: Any) -> list[str]:
    """Every file of the site, relative to the repository's `root`: the nav's pages, then the
    downloads. A nav page that does not exist raises, naming it."""
    pages = list(nav_pages(nav))
    missing = [page for page in pages if not (root / page).is_file()]
    if missing:
        raise FileNotFoundError(f"mkdocs.yml's nav names pages that do not exist: {missing}")
    downloads = sorted(
        path.relative_to(root).as_posix()
        for pattern in DOWNLOADS
        for path in root.glob(pattern)
        if path.is_file()
    )
    return list(dict.fromkeys([*pages, *downloads]))


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """MkDocs' files event: drop what MkDocs found in docs_dir (the theme's own files stay) and
    add `site_sources`, each under its path from the repository's root."""
    root = Path(config.config_file_path).resolve().parent
    docs_dir = str(Path(config.docs_dir).resolve())
    for file in list(files):
        if file.src_dir is not None and str(Path(file.src_dir).resolve()) == docs_dir:
            files.remove(file)
    for path in site_sources(root, config.nav):
        files.append(File(path, str(root), config.site_dir, config.use_directory_urls))
    return files
