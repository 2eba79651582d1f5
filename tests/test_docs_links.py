"""The manual and the design pages point at things that exist: every relative link names a
file of the tree (and, into a page, one of its headings), and every results run a page cites
as `results/<run>` is a folder of results/ (a run moved out of the tree is cited as
`history: <run>`, read from git; docs/README.md says how). Nothing under results/ is read:
only the names of its folders."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
RUN = re.compile(r"(?<![\w:/-])results/([a-z0-9]+-\d{4}-\d\d-\d\d-[0-9a-f]{7})\b")
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


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert not broken, f"{page.name}: links to nothing: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_cited_run_is_in_results(page):
    cited = set(RUN.findall(page.read_text()))
    missing = sorted(r for r in cited if not (ROOT / "results" / r).is_dir())
    assert not missing, (f"{page.name} cites runs that are not under results/ (cite a run "
                         f"moved to git history as 'history: RUN'): {missing}")


def test_the_checks_have_power(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# A heading, with `code`\n[ok](p.md#a-heading-with-code) [bad](p.md#nope)"
                    " [gone](missing.md)\nsee results/h200-2026-01-01-abcdef0 here\n")
    assert "a-heading-with-code" in anchors(page)
    assert [t for t in _links(page)] == ["p.md#a-heading-with-code", "p.md#nope", "missing.md"]
    assert RUN.findall(page.read_text()) == ["h200-2026-01-01-abcdef0"]
    assert RUN.findall("history: h200-2026-01-01-abcdef0, ../results/x") == []
