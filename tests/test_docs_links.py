"""The manual and the design pages point at things that exist: every relative link names a
file of the tree, and a link into a page one of its headings. docs/results.md is generated,
its links from the runs it renders: `tools/render_results.py --check` keeps it, and the runs
the pages cite, in step with the runs themselves, which no test reads."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md")
                                     if p.name != "results.md")]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to
    hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set:
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def _links(page: Path):
    text = FENCE.sub("", page.read_text())
    for m in LINK.finditer(text):
        target = m.group(1)
        if not re.match(r"[a-z]+:", target):   # http(s), mailto: not checked here
            yield target


def broken_links(page: Path) -> list:
    """The links of `page` to no file, or to no heading of a page."""
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    broken = broken_links(page)
    assert not broken, f"{page.name}: links to nothing: {broken}"


def test_the_checks_have_power(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# A heading, with `code`\n[ok](p.md#a-heading-with-code) [bad](p.md#nope)"
                    " [gone](missing.md)\n")
    assert "a-heading-with-code" in anchors(page)
    assert [t for t in _links(page)] == ["p.md#a-heading-with-code", "p.md#nope", "missing.md"]
    assert broken_links(page) == ["p.md#nope", "missing.md"]
