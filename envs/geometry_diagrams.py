"""Geometry3K diagrams drawn again from their annotated logic forms.

The original Geometry3K diagram images are not available offline (except 10 examples);
the InterGPS annotations are. Each annotation gives point coordinates in the original
image's pixel frame (x right, y down), the segments (``line_instances``, e.g. ``"AB"``),
circle centres (``circle_instances``) and diagram logic forms such as
``PointLiesOnCircle(A, Circle(X, radius_0_0))``,
``Equals(LengthOf(Line(T, R)), x+21)``, ``Equals(MeasureOf(Angle(T, R, S)), 4y-10)``,
``Equals(MeasureOf(Arc(B, D)), 10x)``, ``Perpendicular(Line(Y, M), Line(M, A))``,
``Parallel(Line(A, B), Line(C, D))``.

:func:`draw_diagram` renders them with PIL: segments, circles (radius: the mean distance
from the centre to the points annotated on the circle), point labels pushed away from the
figure's centre, length labels at segment midpoints, angle arcs with their measure at the
vertex, arc measures on the circle, right-angle marks and parallel ticks.
:func:`check_drawable` says whether everything in an annotation can be drawn, and if not,
why (a segment or circle naming a point without coordinates, a circle with no point on
it, no points at all). :func:`diagram_png` caches the PNG on first use.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
from pathlib import Path

#: Bump when the drawing changes, so cached PNGs are redrawn.
DRAW_VERSION = 1

_LINE = re.compile(r"Line\((\w'?),\s*(\w'?)\)")
_EQ_LENGTH = re.compile(r"^Equals\(LengthOf\(Line\((\w'?),\s*(\w'?)\)\),\s*(.+)\)$")
_EQ_ANGLE = re.compile(r"^Equals\(MeasureOf\(Angle\((\w'?),\s*(\w'?),\s*(\w'?)\)\),\s*(.+)\)$")
_EQ_ARC = re.compile(r"^Equals\(MeasureOf\(Arc\((\w'?),\s*(\w'?)\)\),\s*(.+)\)$")
_ON_CIRCLE = re.compile(r"^PointLiesOnCircle\((\w'?),\s*Circle\((\w'?),\s*(\w+)\)\)$")
_ON_LINE = re.compile(r"^PointLiesOnLine\((\w'?),\s*Line\((\w'?),\s*(\w'?)\)\)$")
_PERP = re.compile(r"^Perpendicular\(Line\((\w'?),\s*(\w'?)\),\s*Line\((\w'?),\s*(\w'?)\)\)$")
_PARALLEL = re.compile(r"^Parallel\(Line\((\w'?),\s*(\w'?)\),\s*Line\((\w'?),\s*(\w'?)\)\)$")


def _split_line(name: str, points: dict) -> tuple[str, str] | None:
    """``"AB"`` → ("A", "B"); handles primed names (``"B'A"``) when both ends exist."""
    for i in range(1, len(name)):
        a, b = name[:i], name[i:]
        if a in points and b in points:
            return a, b
    return None


def _circles(ann: dict) -> dict[str, list[str]]:
    """Circle centre → points annotated on it."""
    out: dict[str, list[str]] = {c: [] for c in ann.get("circle_instances", []) if c}
    for f in ann.get("diagram_logic_forms", []):
        m = _ON_CIRCLE.match(f.replace(" ", "").replace(",", ", "))
        if m:
            out.setdefault(m.group(2), []).append(m.group(1))
    return out


def check_drawable(ann: dict) -> list[str]:
    """Why this annotation cannot be drawn completely ([] when it can)."""
    pts = ann.get("point_positions") or {}
    why = []
    if len(pts) < 2:
        why.append("fewer than two points with coordinates")
    for line in ann.get("line_instances", []):
        if line and _split_line(line, pts) is None:
            why.append(f"segment {line!r} names a point without coordinates")
    for centre, on in _circles(ann).items():
        if centre not in pts:
            why.append(f"circle centre {centre!r} has no coordinates")
        elif not [p for p in on if p in pts]:
            why.append(f"circle {centre!r} has no point with coordinates on it")
    return why


def _pretty(value: str) -> str:
    """A logic-form value as a label: ``"4y-10"`` stays, ``"sqrt(3)"`` → ``"√(3)"``."""
    v = value.strip().replace("sqrt", "√").replace("*", "")
    v = re.sub(r"\\pi|pi", "π", v)
    return v


def _degrees(value: str) -> str:
    """An angle or arc measure as drawn in the originals: ``40°``, ``x°``, ``(3y+3)°``."""
    v = _pretty(value)
    return f"{v}°" if re.fullmatch(r"[\w.]+", v) else f"({v})°"


def draw_diagram(ann: dict, size: int = 336):
    """The annotation as a PIL image (RGB, white background, longest side ``size``)."""
    from PIL import Image, ImageDraw, ImageFont

    pts = {k: (float(x), float(y)) for k, (x, y) in (ann.get("point_positions") or {}).items()}
    circles = {c: on for c, on in _circles(ann).items() if c in pts}
    radii = {}
    for c, on in circles.items():
        ds = [math.dist(pts[c], pts[p]) for p in on if p in pts]
        if ds:
            radii[c] = sum(ds) / len(ds)
    _snap(pts, radii, ann)
    xs = [p[0] for p in pts.values()] + [pts[c][0] + s * r for c, r in radii.items()
                                         for s in (-1, 1)]
    ys = [p[1] for p in pts.values()] + [pts[c][1] + s * r for c, r in radii.items()
                                         for s in (-1, 1)]
    if not xs:
        raise ValueError("the annotation has no point coordinates to draw")
    margin = 40.0
    w, h = max(xs) - min(xs), max(ys) - min(ys)
    scale = (size - 2 * margin) / max(w, h, 1.0)
    ox, oy = min(xs), min(ys)
    width = int(round(w * scale + 2 * margin))
    height = int(round(h * scale + 2 * margin))

    def at(p):
        return ((p[0] - ox) * scale + margin, (p[1] - oy) * scale + margin)

    P = {k: at(v) for k, v in pts.items()}
    img = Image.new("RGB", (max(width, 64), max(height, 64)), "white")
    d = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=15)
    small = ImageFont.load_default(size=13)
    ink, note = (0, 0, 0), (30, 30, 160)
    cx = sum(p[0] for p in P.values()) / len(P)
    cy = sum(p[1] for p in P.values()) / len(P)

    segments = []
    for line in ann.get("line_instances", []):
        ends = _split_line(line, P) if line else None
        if ends:
            segments.append(ends)
            d.line([P[ends[0]], P[ends[1]]], fill=ink, width=2)
    for c, r in radii.items():
        x, y = P[c]
        rr = r * scale
        d.ellipse([x - rr, y - rr, x + rr, y + rr], outline=ink, width=2)

    def label(text, xy, f=font, fill=ink):
        box = d.textbbox((0, 0), text, font=f)
        tw, th = box[2] - box[0], box[3] - box[1]
        d.rectangle([xy[0] - tw / 2 - 1, xy[1] - th / 2 - 1, xy[0] + tw / 2 + 1,
                     xy[1] + th / 2 + 3], fill="white")
        d.text((xy[0] - tw / 2, xy[1] - th / 2 - box[1]), text, font=f, fill=fill)

    def unit(dx, dy):
        n = math.hypot(dx, dy) or 1.0
        return dx / n, dy / n

    for f in ann.get("diagram_logic_forms", []):
        f = f.strip()
        if (m := _EQ_LENGTH.match(f)) and m.group(1) in P and m.group(2) in P:
            a, b = P[m.group(1)], P[m.group(2)]
            mx, my = (a[0] + b[0]) / 2, (a[1] + b[1]) / 2
            nx, ny = unit(-(b[1] - a[1]), b[0] - a[0])
            if (mx + nx - cx) ** 2 + (my + ny - cy) ** 2 < (mx - cx) ** 2 + (my - cy) ** 2:
                nx, ny = -nx, -ny  # outside the figure
            if "LengthOf" not in m.group(3):  # a length equal to another: no number
                label(_pretty(m.group(3)), (mx + 14 * nx, my + 14 * ny), small, note)
        elif (m := _EQ_ANGLE.match(f)) and all(m.group(i) in P for i in (1, 2, 3)):
            a, v, b = P[m.group(1)], P[m.group(2)], P[m.group(3)]
            t1 = math.degrees(math.atan2(a[1] - v[1], a[0] - v[0]))
            t2 = math.degrees(math.atan2(b[1] - v[1], b[0] - v[0]))
            start, end = (t1, t2) if (t2 - t1) % 360 <= 180 else (t2, t1)
            r = 18
            d.arc([v[0] - r, v[1] - r, v[0] + r, v[1] + r], start, start + (end - start) % 360,
                  fill=note, width=1)
            mid = math.radians(start + ((end - start) % 360) / 2)
            if "MeasureOf" not in m.group(4):  # an angle equal to another: the arc alone
                label(_degrees(m.group(4)), (v[0] + 34 * math.cos(mid),
                                             v[1] + 34 * math.sin(mid)), small, note)
        elif m := _EQ_ARC.match(f):
            a, b = m.group(1), m.group(2)
            centre = next((c for c, on in circles.items() if a in on and b in on
                           and c in radii), None)
            if centre and a in P and b in P:
                c = P[centre]
                ta = math.atan2(P[a][1] - c[1], P[a][0] - c[0])
                tb = math.atan2(P[b][1] - c[1], P[b][0] - c[0])
                diff = (tb - ta) % (2 * math.pi)
                mid = ta + diff / 2 if diff <= math.pi else tb + (2 * math.pi - diff) / 2
                rr = radii[centre] * scale + 16
                text = _degrees(m.group(3))
                label(text, (c[0] + rr * math.cos(mid), c[1] + rr * math.sin(mid)), small, note)
        elif (m := _PERP.match(f)) and all(m.group(i) in P for i in (1, 2, 3, 4)):
            l1, l2 = {m.group(1), m.group(2)}, {m.group(3), m.group(4)}
            common = l1 & l2
            if common:
                v = common.pop()
                a, b = (l1 - {v}).pop(), (l2 - {v}).pop()
                u1, u2 = unit(P[a][0] - P[v][0], P[a][1] - P[v][1]), \
                    unit(P[b][0] - P[v][0], P[b][1] - P[v][1])
                s = 10
                p1 = (P[v][0] + s * u1[0], P[v][1] + s * u1[1])
                p2 = (p1[0] + s * u2[0], p1[1] + s * u2[1])
                p3 = (P[v][0] + s * u2[0], P[v][1] + s * u2[1])
                d.line([p1, p2, p3], fill=note, width=1)
        elif (m := _PARALLEL.match(f)) and all(m.group(i) in P for i in (1, 2, 3, 4)):
            for a, b in ((m.group(1), m.group(2)), (m.group(3), m.group(4))):
                mx, my = (P[a][0] + P[b][0]) / 2, (P[a][1] + P[b][1]) / 2
                ux, uy = unit(P[b][0] - P[a][0], P[b][1] - P[a][1])
                for off in (-3, 3):  # a small arrowhead on each parallel segment
                    bx, by = mx + off * ux, my + off * uy
                    d.line([(bx - 6 * ux - 4 * uy, by - 6 * uy + 4 * ux), (bx, by),
                            (bx - 6 * ux + 4 * uy, by - 6 * uy - 4 * ux)], fill=note, width=1)

    for name, p in P.items():  # point labels last, pushed away from the figure's centre
        ux, uy = unit(p[0] - cx, p[1] - cy)
        if ux == 0 and uy == 0:
            ux, uy = 0.0, -1.0
        d.ellipse([p[0] - 2.5, p[1] - 2.5, p[0] + 2.5, p[1] + 2.5], fill=ink)
        label(name, (p[0] + 14 * ux, p[1] + 14 * uy))
    return img


def _snap(pts: dict, radii: dict, ann: dict) -> None:
    """Move points onto what the logic forms put them on (annotated coordinates are
    hand-clicked): onto their circle (radially), then onto their segment (orthogonal
    projection, kept between the ends)."""
    forms = [f.strip() for f in ann.get("diagram_logic_forms", [])]
    for f in forms:
        m = _ON_CIRCLE.match(f)
        if m and m.group(2) in radii and m.group(1) in pts and m.group(1) != m.group(2):
            (x, y), (cx, cy) = pts[m.group(1)], pts[m.group(2)]
            n = math.hypot(x - cx, y - cy)
            if n > 0:
                r = radii[m.group(2)]
                pts[m.group(1)] = (cx + (x - cx) * r / n, cy + (y - cy) * r / n)
    for f in forms:
        m = _ON_LINE.match(f)
        if m and all(g in pts for g in m.groups()) and len(set(m.groups())) == 3:
            (px, py), (ax, ay), (bx, by) = pts[m.group(1)], pts[m.group(2)], pts[m.group(3)]
            dx, dy = bx - ax, by - ay
            n2 = dx * dx + dy * dy
            if n2 > 0:
                t = min(1.0, max(0.0, ((px - ax) * dx + (py - ay) * dy) / n2))
                pts[m.group(1)] = (ax + t * dx, ay + t * dy)


def annotation_key(ann: dict) -> str:
    blob = json.dumps(ann, sort_keys=True) + f"/v{DRAW_VERSION}"
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def diagram_png(ann: dict, cache: Path | None = None) -> Path:
    """The drawn diagram as a PNG file, drawn once per annotation and cached
    (``$AGENTGYM_CACHE/geometry/diagrams/<hash>.png``)."""
    from agentgym.paths import cache_dir
    folder = cache or cache_dir() / "geometry" / "diagrams"
    path = folder / f"{annotation_key(ann)}.png"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        draw_diagram(ann).save(buf, format="PNG")
        tmp = path.with_suffix(f".{id(buf)}.tmp")
        tmp.write_bytes(buf.getvalue())
        tmp.replace(path)
    return path
