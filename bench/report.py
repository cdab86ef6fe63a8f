"""Write a benchmark's figures into docs/BENCHMARKS.md, replacing its previous section."""

from __future__ import annotations

import datetime
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "BENCHMARKS.md"
HEADER = ("# Benchmarks\n\nEach section is written by the command it names "
          "(`bench/` scripts); re-running a command replaces its section.\n")


def write_section(title: str, body: str, doc: Path = DOC) -> None:
    """Replace (or append) the ``## title`` section of the benchmarks page."""
    text = doc.read_text() if doc.exists() else HEADER
    start, end = f"<!-- begin: {title} -->", f"<!-- end: {title} -->"
    stamp = datetime.date.today().isoformat()
    block = f"{start}\n## {title}\n\n_Measured {stamp}._\n\n{body.strip()}\n{end}"
    if start in text and end in text:
        before, rest = text.split(start, 1)
        after = rest.split(end, 1)[1]
        text = before + block + after
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
