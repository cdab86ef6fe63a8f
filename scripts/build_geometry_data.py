"""Build the geometry environment's shipped data from ../shared/data/geometry3k.

    python scripts/build_geometry_data.py                 # reads ../shared/data
    python scripts/build_geometry_data.py /path/to/shared/data

Writes, deterministically (the gzip header has no timestamp):
  data/geometry/train.jsonl.gz  Geometry3K train problems whose diagrams can be drawn
  data/geometry/val.jsonl       validation problems, same rule
  data/geometry/test.jsonl      test problems, same rule
  data/geometry/undrawable.json ids left out, each with its reasons (e.g. a point
                                annotated at [-1, -1] that a segment needs)

Rows are verl's format with an ``images`` column: ``[{"logic_form": {...}}]`` holds the
diagram's annotation (point coordinates, segments, circles, diagram logic forms), drawn
into a PNG on first use (envs/geometry_diagrams.py). The 10 problems with original
diagrams (examples/11..20) also carry their choices and answer letter.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentgym.envs.geometry import geometry_row  # noqa: E402
from agentgym.envs.geometry_diagrams import check_drawable  # noqa: E402

_TAIL = re.compile(r"\s*First output the thinking process.*$", re.DOTALL)
KEYS = ("point_positions", "line_instances", "circle_instances", "diagram_logic_forms")


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write(rows: list[dict], path: Path) -> None:
    text = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows)
    if path.suffix == ".gz":
        with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
            f.write(text.encode("utf-8"))
    else:
        path.write_text(text, encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shared", nargs="?", default=str(ROOT.parent / "shared" / "data"))
    src = Path(ap.parse_args().shared) / "geometry3k"
    annots = json.loads((src / "logic_forms" / "diagram_logic_forms_annot.json").read_text())
    examples = {}
    for d in sorted((src / "examples").iterdir()):
        data = json.loads((d / "data.json").read_text())
        examples[str(data["id"])] = data
    out = ROOT / "data" / "geometry"
    out.mkdir(parents=True, exist_ok=True)
    undrawable = {}
    for split, name in (("train", "train.jsonl.gz"), ("val", "val.jsonl"), ("test", "test.jsonl")):
        rows = []
        for r in read_jsonl(src / "text_answer" / f"{split}.jsonl"):
            pid = r["images"][0].split("/")[-2]
            ann = {k: annots[pid][k] for k in KEYS}
            why = check_drawable(ann)
            if why:
                undrawable[pid] = why
                continue
            question = _TAIL.sub("", r["messages"][0]["content"].replace("<image>", "")).strip()
            ex = examples.get(pid, {})
            rows.append(geometry_row(question, r["solution"], ann, pid, split,
                                     choices=ex.get("choices"), letter=ex.get("answer")))
        write(rows, out / name)
        print(f"{split}: {len(rows)} rows -> {out / name}")
    (out / "undrawable.json").write_text(json.dumps(undrawable, indent=1, sort_keys=True) + "\n")
    print(f"left out {len(undrawable)} problems whose diagrams cannot be drawn")


if __name__ == "__main__":
    main()
