"""bench/report.write_section: a re-run replaces a section's figures and keeps what was
written about them below its notes marker."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import write_section  # noqa: E402


def test_a_rerun_replaces_the_figures_and_keeps_the_notes(tmp_path):
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n")
    write_section("X", "| a | 1 |", doc)
    write_section("Y", "| b | 2 |", doc)
    text = doc.read_text().replace("<!-- end: X -->",
                                   "<!-- notes: X -->\n**What it shows.** a is 1.\n<!-- end: X -->")
    doc.write_text(text)
    write_section("X", "| a | 3 |", doc)
    write_section("X", "| a | 4 |", doc)  # twice: the notes are kept once, not doubled
    text = doc.read_text()
    assert "| a | 4 |" in text and "| a | 1 |" not in text and "| a | 3 |" not in text
    assert text.count("**What it shows.** a is 1.") == 1
    assert text.index("| a | 4 |") < text.index("What it shows") < text.index("<!-- end: X -->")
    assert "| b | 2 |" in text  # other sections untouched
    write_section("Y", "| b | 5 |", doc)  # a section without notes: the figures alone
    assert "| b | 5 |" in doc.read_text() and "| b | 2 |" not in doc.read_text()
