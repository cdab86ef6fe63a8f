"""docs/BENCHMARKS.md: its first screen is the headline table (where the project stands),
every section that table names is a heading of the page, and no heading the page had
before it was regrouped by area is gone (code, docs and bench scripts cite sections by
heading; ``bench/report.write_section`` finds a section by its markers and its title)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "BENCHMARKS.md"
#: every heading of docs/BENCHMARKS.md at d018375, before the page was grouped by area
#: (``git show d018375:docs/BENCHMARKS.md | grep -E '^#{1,6} '``)
OLD_HEADINGS = Path(__file__).resolve().parent / "data" / "benchmarks_headings.txt"
FIRST_SCREEN = 45
COLUMNS = ("figure", "value", "machine", "date", "section")
LINK = re.compile(r"\[([^\]]+)\]\(#([^)]+)\)")


def headings(text: str) -> list[str]:
    """The page's heading lines (``## Title``), those inside code fences left out."""
    out, fence = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} \S", line):
            out.append(line.rstrip())
    return out


def slug(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def headline_table(text: str) -> tuple[list[str], list[list[str]]]:
    """The first markdown table in the page's first screen: its header and its rows."""
    lines = text.splitlines()[:FIRST_SCREEN]
    for i, line in enumerate(lines[:-1]):
        if line.startswith("|") and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1].strip()):
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(cells(row))
            return [c.lower() for c in cells(line)], rows
    raise AssertionError(f"no markdown table in the first {FIRST_SCREEN} lines of {DOC}")


def test_the_first_screen_is_the_headline_table_and_its_sections_exist():
    text = DOC.read_text(encoding="utf-8")
    header, rows = headline_table(text)
    for name in COLUMNS:
        assert any(name in h for h in header), (name, header)
    assert len(rows) >= 8, len(rows)
    titles = {h.split(" ", 1)[1] for h in headings(text)}
    anchors = {slug(t) for t in titles}
    section = next(i for i, h in enumerate(header) if "section" in h)
    value = next(i for i, h in enumerate(header) if "value" in h)
    for row in rows:
        assert len(row) == len(header), row
        assert row[value], row
        cell = row[section]
        if cell.startswith("—"):  # a figure this page does not hold says so in its value
            assert "not on this page" in row[value], row
            continue
        other = re.fullmatch(r'(docs/\w+\.md), "([^"]+)"', cell)
        if other:  # a figure another page holds: that page's heading
            page = (ROOT / other[1]).read_text(encoding="utf-8")
            assert other[2] in {h.split(" ", 1)[1] for h in headings(page)}, cell
            continue
        links = LINK.findall(cell)
        named = [t for t, _ in links] or [cell]
        for title in named:
            assert title in titles, f"headline row {row[0]!r} names no heading: {title!r}"
        for title, anchor in links:
            assert anchor == slug(title) and anchor in anchors, (title, anchor)


def test_every_heading_of_the_page_before_its_regrouping_is_still_a_heading():
    old = OLD_HEADINGS.read_text(encoding="utf-8").splitlines()
    assert len(old) == 64 and old[0] == "# Benchmarks"
    new = headings(DOC.read_text(encoding="utf-8"))
    missing = [h for h in old if h not in new]
    assert not missing, missing
    # one heading each: a section cited by its title must be one section
    assert len(new) == len(set(new)), [h for h in new if new.count(h) > 1]


def test_every_section_keeps_its_markers_so_a_rerun_replaces_it_in_place():
    text = DOC.read_text(encoding="utf-8")
    for line in OLD_HEADINGS.read_text(encoding="utf-8").splitlines():
        if not line.startswith("## ") or line == "## Reading these figures":
            continue
        title = line[3:]
        begin, end = f"<!-- begin: {title} -->\n## {title}\n", f"<!-- end: {title} -->"
        assert text.count(begin) == 1 and text.count(end) == 1, title
        assert text.index(begin) < text.index(end), title
