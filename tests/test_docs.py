"""The docs stand alone: README's links resolve, every page is in the site's nav, the site builds strictly.

`mkdocs build --strict` (mkdocs-material, the `dev` extra) fails on a broken link or anchor between docs
pages; README.md is not part of the site, so its links into docs/ are checked here the same way.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCS = REPO_ROOT / "docs"
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def slugify(heading: str) -> str:
    """Python-Markdown's `toc` anchor of a heading (what mkdocs links to), code spans rendered as text."""
    text = unicodedata.normalize("NFKD", heading.replace("`", "")).encode("ascii", "ignore").decode("ascii")
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '#' comment in a code block is no heading
    return {slugify(line.lstrip("#").strip()) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def broken_links(document: Path) -> list[str]:
    """Relative links of `document` whose file or anchor does not exist (web links are not followed)."""
    problems = []
    for match in LINK.finditer(document.read_text()):
        target = match["target"]
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (document.parent / path).resolve() if path else document
        if not resolved.exists():
            problems.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{target}: no such heading")
    return problems


def nav_pages(nav: list) -> list[str]:
    pages = []
    for entry in nav:
        for value in (entry.values() if isinstance(entry, dict) else [entry]):
            pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_readme_links_resolve():
    assert broken_links(REPO_ROOT / "README.md") == []


def test_the_link_check_catches_a_broken_file_and_anchor(tmp_path):
    (tmp_path / "page.md").write_text("# A page\n\n## Step cost: `python x.py`\n")
    document = tmp_path / "doc.md"
    document.write_text("[ok](page.md#step-cost-python-xpy) [gone](missing.md) [bad](page.md#no-such) "
                        "[web](https://example.com/x.md)")
    assert broken_links(document) == ["missing.md: no such file", "page.md#no-such: no such heading"]


def test_every_docs_page_is_in_the_nav_and_every_nav_page_exists():
    config = yaml.safe_load((REPO_ROOT / "mkdocs.yml").read_text())
    listed = set(nav_pages(config["nav"]))
    present = {page.name for page in DOCS.glob("*.md")}
    assert present - listed == set(), "add these pages to mkdocs.yml's nav"
    assert listed - present == set(), "mkdocs.yml's nav names pages that do not exist"


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
                    reason="mkdocs-material is not installed (pip install -e '.[dev]')")
def test_site_builds_strictly(tmp_path):
    # No `-q`: mkdocs 1.6 counts strict-mode warnings only at the default log level.
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                            cwd=REPO_ROOT, capture_output=True, text=True,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
