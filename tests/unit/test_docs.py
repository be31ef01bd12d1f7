"""README and docs/: README stays one screenful per question, its links lead somewhere, and the
prose carries no commit hashes or dates (results files under benchmarks/results carry their own).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 250

# A Markdown link or image: [text](target) or ![alt](target), the target up to a space or ")".
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~)")
# A word of 7 to 40 hex digits with at least one digit and one letter: what a commit hash, full
# or abbreviated, looks like. Longer hex words (a sha256 digest) are not commits.
COMMIT_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
DATE = re.compile(r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b")


def _pages() -> list[Path]:
    return [README, ROOT / "CONTRIBUTING.md", *sorted(DOCS.glob("*.md"))]


def _prose(text: str) -> str:
    """The text without its fenced code blocks (sample output, commands)."""
    kept, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            kept.append(line)
    return "\n".join(kept)


def _links(page: Path) -> list[str]:
    return LINK.findall(_prose(page.read_text()))


def _local(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE)


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but hyphens dropped, spaces to hyphens,
    a repeated anchor numbered."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose(page.read_text()).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_readme_is_at_most_250_lines() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail to docs/"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_files_and_headings_that_exist(page: Path) -> None:
    broken = []
    for target in filter(_local, _links(page)):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in _anchors(file)):
            broken.append(target)
    assert not broken, f"{page.name}: {broken}"


def test_readme_links_every_docs_page_and_each_exists() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in filter(_local, _links(README))}
    docs = {path for path in linked if path.parent == DOCS and path.suffix == ".md"}
    assert docs, "README links to no page of docs/"
    assert all(path.exists() for path in docs)
    assert set(DOCS.glob("*.md")) <= docs, "a page of docs/ that README does not link"
    assert ROOT / "CONTRIBUTING.md" in linked


def test_the_headline_table_is_marked() -> None:
    text = README.read_text()
    start, end = "<!-- headline-table -->", "<!-- /headline-table -->"
    assert text.count(start) == 1 and text.count(end) == 1
    table = text.split(start)[1].split(end)[0].strip().splitlines()
    assert table and all(line.startswith("|") for line in table)


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_commit_hashes_or_dates_in_prose(page: Path) -> None:
    prose = _prose(page.read_text())
    assert not COMMIT_HASH.findall(prose), f"{page.name}: link the results file instead"
    assert not DATE.findall(prose), f"{page.name}: results files carry their own dates"
