"""Write a benchmark's figures into docs/BENCHMARKS.md, replacing its previous section."""

from __future__ import annotations

import datetime
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "BENCHMARKS.md"
HEADER = ("# Benchmarks\n\nEach section is written by the command it names "
          "(`bench/` scripts); re-running a command replaces its section.\n")


def write_section(title: str, body: str, doc: Path = DOC) -> None:
    """Replace (or append) the ``## title`` section of the benchmarks page. What follows a
    ``<!-- notes: title -->`` line inside the section (prose written by hand about the
    figures) is kept: a re-run replaces the figures, not what was said of them."""
    text = doc.read_text() if doc.exists() else HEADER
    start, end = f"<!-- begin: {title} -->", f"<!-- end: {title} -->"
    notes = f"<!-- notes: {title} -->"
    stamp = datetime.date.today().isoformat()
    block = f"{start}\n## {title}\n\n_Measured {stamp}._\n\n{body.strip()}\n"
    if start in text and end in text:
        before, rest = text.split(start, 1)
        old, after = rest.split(end, 1)
        kept = old.split(notes, 1)[1] if notes in old else ""
        text = before + block + (f"\n{notes}{kept}" if kept else "") + end + after
    else:
        text = text.rstrip() + "\n\n" + block + end + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


def machine() -> str:
    """This machine in words, for a section's first line: the CPU model, the core count and
    whether it computes bfloat16 natively (AMX / AVX512-BF16: bf16 runs several times faster
    than fp32 there; elsewhere it is emulated and slower)."""
    import os
    import platform

    from agentgym.core.device import cpu_bf16_flags
    model = platform.processor() or platform.machine()
    try:
        model = next((ln.split(":", 1)[1].strip() for ln in
                      Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("model name") and ":" in ln), model)
    except OSError:
        pass
    bf16 = cpu_bf16_flags()
    native = f"native bf16 ({', '.join(bf16)})" if bf16 else "no native bf16"
    return f"{model}, {os.cpu_count()} CPUs, {native}"
