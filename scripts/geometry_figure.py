"""The 10 Geometry3K originals next to the diagrams drawn from their logic forms.

    python scripts/geometry_figure.py   # reads ../shared/data, writes docs/geometry_redrawn.png

Also prints how many of the 3,002 annotated problems can be drawn, and why the rest
cannot (grouped by reason).
"""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from PIL import Image, ImageDraw, ImageFont  # noqa: E402

from agentgym.envs.geometry_diagrams import check_drawable, draw_diagram  # noqa: E402


def main() -> None:
    shared = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT.parent / "shared" / "data"
    src = shared / "geometry3k"
    annots = json.loads((src / "logic_forms" / "diagram_logic_forms_annot.json").read_text())
    reasons = collections.Counter()
    for ann in annots.values():
        for why in check_drawable(ann)[:1]:
            reasons[re.sub(r"'[^']*'|\"[^\"]*\"", "X", why)] += 1
    bad = sum(reasons.values())
    print(f"drawable: {len(annots) - bad} of {len(annots)}")
    for why, n in reasons.most_common():
        print(f"  {n:3d}  {why}")

    font = ImageFont.load_default(size=16)
    h, tiles = 240, []
    for d in sorted((src / "examples").iterdir(), key=lambda p: int(p.name)):
        orig = Image.open(d / "img_diagram.png").convert("RGB")
        redrawn = draw_diagram(annots[d.name])
        orig = orig.resize((max(1, orig.width * h // orig.height), h))
        redrawn = redrawn.resize((max(1, redrawn.width * h // redrawn.height), h))
        tile = Image.new("RGB", (orig.width + redrawn.width + 30, h + 28), "white")
        draw = ImageDraw.Draw(tile)
        draw.text((4, 2), f"#{d.name} original", font=font, fill=(0, 0, 0))
        draw.text((orig.width + 34, 2), "redrawn", font=font, fill=(0, 0, 0))
        tile.paste(orig, (0, 26))
        tile.paste(redrawn, (orig.width + 30, 26))
        tiles.append(tile)
    w = max(t.width for t in tiles)
    sheet = Image.new("RGB", (2 * w + 30, 5 * (h + 38) + 10), (225, 225, 225))
    for i, t in enumerate(tiles):
        sheet.paste(t, (10 + (i % 2) * (w + 10), 10 + (i // 2) * (h + 38)))
    out = ROOT / "docs" / "geometry_redrawn.png"
    sheet.save(out, optimize=True)
    print(f"wrote {out} ({out.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()
