"""Geometry3K diagrams drawn again from their annotated logic forms.

The original Geometry3K diagram images are not available offline (except 10 examples);
the InterGPS annotations are. Each annotation gives point coordinates in the original
image's pixel frame (x right, y down), the segments (``line_instances``, e.g. ``"AB"``),
circle centres (``circle_instances``) and diagram logic forms such as
``PointLiesOnCircle(A, Circle(X, radius_0_0))``,
``Equals(LengthOf(Line(T, R)), x+21)``, ``Equals(MeasureOf(Angle(T, R, S)), 4y-10)``,
``Equals(MeasureOf(Angle(F, D, C)), MeasureOf(angle 1))``,
``Equals(LengthOf(Line(Q, A)), LengthOf(Line(R, A)))``,
``Equals(MeasureOf(Arc(B, D)), 10x)``, ``Perpendicular(Line(Y, M), Line(M, A))``,
``Parallel(Line(A, B), Line(C, D))``.

**Missing points.** A point annotated at ``[-1, -1]`` (:data:`MISSING`) was not located
in the diagram: InterGPS lists every point the problem names, and marks those it could
not click that way. Such a point is never drawn. If a segment, a circle or any diagram
logic form names it, the figure cannot be drawn faithfully (a foot of a perpendicular, a
vertex, a labelled point on a segment would be absent or misplaced), so
:func:`check_drawable` reports it; a missing point that nothing names (a name the
question uses that the original figure does not label) is simply left out.

:func:`draw_diagram` renders an annotation with PIL: segments, circles (radius: the mean
distance from the centre to the points annotated on the circle), point labels pushed
away from the figure's centre, length labels beside segment midpoints, angle arcs with
their measure (or their number, ``∠1``) at the vertex, arc measures on the circle,
right-angle marks and parallel arrowheads. As in textbook figures, lengths annotated
equal to each other get matching tick marks (one equality class 1 tick, the next 2, then
3…) and angles annotated equal get matching arcs (1, 2, 3… arcs per class), without a
number. A label that would cover a point label or an earlier label is nudged away from
it. :func:`check_drawable` says whether everything in an annotation can be drawn, and if
not, why. :func:`diagram_png` caches the PNG on first use.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
from pathlib import Path
from agentgym.core.paths import cache_dir

#: Bump when the drawing changes, so cached PNGs are redrawn.
DRAW_VERSION = 2
#: InterGPS's coordinates for a point it lists but did not locate in the diagram.
MISSING = (-1, -1)

_P = r"(\w'?)"
_LINE_P = rf"Line\({_P},\s*{_P}\)"
_EQ_LENGTH = re.compile(rf"^Equals\(LengthOf\({_LINE_P}\),\s*(.+)\)$")
_EQ_LINES = re.compile(rf"^Equals\({_LINE_P},\s*{_LINE_P}\)$")
_EQ_ANGLE = re.compile(rf"^Equals\(MeasureOf\(Angle\({_P},\s*{_P},\s*{_P}\)\),\s*(.+)\)$")
_EQ_ARC = re.compile(rf"^Equals\(MeasureOf\(Arc\({_P},\s*{_P}\)\),\s*(.+)\)$")
_ON_CIRCLE = re.compile(rf"^PointLiesOnCircle\({_P},\s*Circle\({_P},\s*(\w+)\)\)$")
_ON_LINE = re.compile(rf"^PointLiesOnLine\({_P},\s*{_LINE_P}\)$")
_PERP = re.compile(rf"^Perpendicular\({_LINE_P},\s*{_LINE_P}\)$")
_PARALLEL = re.compile(rf"^Parallel\({_LINE_P},\s*{_LINE_P}\)$")
_OTHER_LENGTH = re.compile(rf"^LengthOf\({_LINE_P}\)$")
_OTHER_ANGLE = re.compile(rf"^MeasureOf\(Angle\({_P},\s*{_P},\s*{_P}\)\)$")
_NUMBERED = re.compile(r"^MeasureOf\((?:angle\s*|Angle\()(\d+)\)?\)$")  # angle 1, Angle(1)
_NAMED_SIDE = re.compile(r"^LengthOf\(([a-z])\)$")  # a side called a, b, c …
_NAME = re.compile(r"[A-Za-z]\w*'?")

INK, NOTE = (0, 0, 0), (30, 30, 160)


def _is_missing(xy) -> bool:
    return len(xy) == 2 and xy[0] == MISSING[0] and xy[1] == MISSING[1]


def located_points(ann: dict) -> dict[str, tuple[float, float]]:
    """The annotation's points that have coordinates (``[-1, -1]`` ones left out)."""
    return {k: (float(xy[0]), float(xy[1]))
            for k, xy in (ann.get("point_positions") or {}).items() if not _is_missing(xy)}


def _split_line(name: str, points: dict) -> tuple[str, str] | None:
    """``"AB"`` → ("A", "B"); handles primed names (``"B'A"``) when both ends exist."""
    for i in range(1, len(name)):
        a, b = name[:i], name[i:]
        if a in points and b in points:
            return a, b
    return None


def _forms(ann: dict) -> list[str]:
    return [f.strip() for f in ann.get("diagram_logic_forms", []) if f and f.strip()]


def _circles(ann: dict) -> dict[str, list[str]]:
    """Circle centre → points annotated on it."""
    out: dict[str, list[str]] = {c: [] for c in ann.get("circle_instances", []) if c}
    for f in _forms(ann):
        m = _ON_CIRCLE.match(f)
        if m:
            out.setdefault(m.group(2), []).append(m.group(1))
    return out


def _first_user(ann: dict, point: str, named: dict) -> str | None:
    """The first segment, circle or logic form that names ``point``, in words."""
    for line in ann.get("line_instances", []):
        if line and point in (_split_line(line, named) or ()):
            return f"segment {line!r}"
    if point in _circles(ann):
        return f"circle {point!r}"
    return next((f"logic form {f!r}" for f in _forms(ann) if point in _NAME.findall(f)), None)


def check_drawable(ann: dict) -> list[str]:
    """Why this annotation cannot be drawn completely ([] when it can): fewer than two
    located points, a point without coordinates (``[-1, -1]``) that a segment, circle or
    logic form names, a segment naming an unknown point, a circle whose centre or every
    point is unknown."""
    named = ann.get("point_positions") or {}
    pts = located_points(ann)
    why = []
    if len(pts) < 2:
        why.append("fewer than two points with coordinates")
    for p in sorted(set(named) - set(pts)):
        user = _first_user(ann, p, named)
        if user:
            why.append(f"point {p!r} has no coordinates ([-1, -1]) but {user} uses it")
    for line in ann.get("line_instances", []):
        if line and _split_line(line, named) is None:
            why.append(f"segment {line!r} names a point without coordinates")
    for centre, on in _circles(ann).items():
        if centre not in named:
            why.append(f"circle centre {centre!r} has no coordinates")
        elif centre in pts and not [p for p in on if p in pts]:
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


def _unit(dx: float, dy: float) -> tuple[float, float]:
    n = math.hypot(dx, dy) or 1.0
    return dx / n, dy / n


def _fan(xy, away) -> list:
    """Nudges for a label at ``xy`` belonging to what lies opposite ``away``: further
    along ``away``, then up to 80° off it."""
    moves = [(xy, away)]
    for turn in (0.7, -0.7, 1.4, -1.4):
        c, s = math.cos(turn), math.sin(turn)
        moves.append((xy, (c * away[0] - s * away[1], s * away[0] + c * away[1])))
    return moves


def _classes(pairs: list[tuple]) -> dict:
    """Equality classes of the pairs' members (union-find): member → class number 1, 2, …
    in order of first appearance; members of one-member classes are left out."""
    parent: dict = {}

    def root(x):
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in pairs:
        parent[root(a)] = root(b)
    groups: dict = {}
    for x in parent:
        groups.setdefault(root(x), []).append(x)
    numbers, out = {}, {}
    for x in parent:
        if len(groups[root(x)]) > 1:
            out[x] = numbers.setdefault(root(x), len(numbers) + 1)
    return out


class _Canvas:
    """The image, the frame from annotation pixels to image pixels, and the boxes of the
    labels placed so far (so that later labels can be nudged off them)."""

    MARGIN = 40.0

    def __init__(self, pts: dict, radii: dict, size: int) -> None:
        from PIL import Image, ImageDraw, ImageFont
        xs = [p[0] for p in pts.values()] + [pts[c][0] + s * r for c, r in radii.items()
                                             for s in (-1, 1)]
        ys = [p[1] for p in pts.values()] + [pts[c][1] + s * r for c, r in radii.items()
                                             for s in (-1, 1)]
        w, h = max(xs) - min(xs), max(ys) - min(ys)
        self.scale = (size - 2 * self.MARGIN) / max(w, h, 1.0)
        self.origin = (min(xs), min(ys))
        self.P = {k: self.at(v) for k, v in pts.items()}
        width = max(int(round(w * self.scale + 2 * self.MARGIN)), 64)
        height = max(int(round(h * self.scale + 2 * self.MARGIN)), 64)
        self.img = Image.new("RGB", (width, height), "white")
        self.draw = ImageDraw.Draw(self.img)
        self.font = ImageFont.load_default(size=15)
        self.small = ImageFont.load_default(size=13)
        self.centre = (sum(p[0] for p in self.P.values()) / len(self.P),
                       sum(p[1] for p in self.P.values()) / len(self.P))
        self.boxes: list[tuple[float, float, float, float]] = []

    def at(self, p):
        return ((p[0] - self.origin[0]) * self.scale + self.MARGIN,
                (p[1] - self.origin[1]) * self.scale + self.MARGIN)

    def outward(self, x: float, y: float) -> tuple[float, float]:
        """The unit vector from the figure's centre towards (x, y) (up if they coincide)."""
        ux, uy = _unit(x - self.centre[0], y - self.centre[1])
        return (0.0, -1.0) if (x, y) == self.centre else (ux, uy)

    def _box(self, text, xy, font):
        b = self.draw.textbbox((0, 0), text, font=font)
        tw, th = b[2] - b[0], b[3] - b[1]
        return (xy[0] - tw / 2 - 1, xy[1] - th / 2 - 1, xy[0] + tw / 2 + 1, xy[1] + th / 2 + 3)

    def _clash(self, box, pad: float = 3.0) -> float:
        """How much ``box`` (grown by ``pad``) overlaps the placed labels, in px²; a box
        leaving the image counts as fully covered."""
        w, h = self.img.size
        if box[0] < 0 or box[1] < 0 or box[2] > w or box[3] > h:
            return math.inf
        area = 0.0
        for b in self.boxes:
            dx = min(box[2] + pad, b[2]) - max(box[0] - pad, b[0])
            dy = min(box[3] + pad, b[3]) - max(box[1] - pad, b[1])
            area += max(dx, 0.0) * max(dy, 0.0)
        return area

    def reserve(self, text, xy, font=None) -> None:
        self.boxes.append(self._box(text, xy, font or self.font))

    def place(self, text, moves, font=None):
        """Where ``text`` goes: the first of ``moves`` (``(start, unit direction)``
        pairs: the preferred spot first, then ways to nudge it) that keeps its box clear
        of the labels placed so far, trying every move 5 px further each round up to
        35 px; if none is clear, the spot tried that overlaps them least."""
        font = font or self.small
        best = (math.inf, moves[0][0])
        for k in range(8):
            for (x, y), (ux, uy) in moves:
                at = (x + 5 * k * ux, y + 5 * k * uy)
                clash = self._clash(self._box(text, at, font))
                if clash == 0:
                    return at
                best = min(best, (clash, at), key=lambda c: c[0])
        return best[1]

    def label(self, text, xy, font=None, fill=INK) -> None:
        font = font or self.font
        box = self._box(text, xy, font)
        self.boxes.append(box)
        self.draw.rectangle(box, fill="white")
        b = self.draw.textbbox((0, 0), text, font=font)
        self.draw.text((xy[0] - (b[2] - b[0]) / 2, xy[1] - (b[3] - b[1]) / 2 - b[1]), text,
                       font=font, fill=fill)


def _radii(pts: dict, circles: dict) -> dict[str, float]:
    radii = {}
    for c, on in circles.items():
        ds = [math.dist(pts[c], pts[p]) for p in on if p in pts and p != c]
        if ds:
            radii[c] = sum(ds) / len(ds)
    return radii


def _marks(ann: dict, P: dict) -> tuple[dict, dict, dict, dict]:
    """What the equality forms put on the figure, over located points only:
    ``(length labels, tick classes, angle labels, arc classes)``. Segments are sorted
    name pairs, angles ``(end, vertex, end)`` with sorted ends."""
    def seg(a, b):
        return tuple(sorted((a, b)))

    def ang(a, v, b):
        return (min(a, b), v, max(a, b))

    lengths: dict = {}
    angles: dict = {}
    same_len, same_ang = [], []
    for f in _forms(ann):
        if (m := _EQ_LINES.match(f)) and all(g in P for g in m.groups()):
            same_len.append((seg(*m.groups()[:2]), seg(*m.groups()[2:])))
        elif (m := _EQ_LENGTH.match(f)) and m.group(1) in P and m.group(2) in P:
            key, value = seg(m.group(1), m.group(2)), m.group(3).strip()
            if (o := _OTHER_LENGTH.match(value)) and all(g in P for g in o.groups()):
                same_len.append((key, seg(*o.groups())))
            elif n := _NAMED_SIDE.match(value):
                lengths.setdefault(key, []).append(n.group(1))
            elif "LengthOf" not in value:
                lengths.setdefault(key, []).append(_pretty(value))
        elif (m := _EQ_ANGLE.match(f)) and all(m.group(i) in P for i in (1, 2, 3)):
            key, value = ang(*m.groups()[:3]), m.group(4).strip()
            angles.setdefault(key, [])
            if (o := _OTHER_ANGLE.match(value)) and all(g in P for g in o.groups()):
                same_ang.append((key, ang(*o.groups())))
                angles.setdefault(ang(*o.groups()), [])
            elif n := _NUMBERED.match(value):
                angles[key].append(n.group(1))
            elif "MeasureOf" not in value:
                angles[key].append(_degrees(value))
    return lengths, _classes(same_len), angles, _classes(same_ang)


def _draw_lengths(cv: _Canvas, lengths: dict, ticks: dict, pending: list) -> None:
    """Tick marks on equal segments (n ticks for class n); value labels queued."""
    P = cv.P
    for (a, b), n in ticks.items():
        (ax, ay), (bx, by) = P[a], P[b]
        ux, uy = _unit(bx - ax, by - ay)
        mx, my = (ax + bx) / 2, (ay + by) / 2
        for i in range(n):
            off = (i - (n - 1) / 2) * 5
            cx, cy = mx + off * ux, my + off * uy
            cv.draw.line([(cx - 6 * uy, cy + 6 * ux), (cx + 6 * uy, cy - 6 * ux)],
                         fill=NOTE, width=2)
    for (a, b), texts in lengths.items():
        (ax, ay), (bx, by) = P[a], P[b]
        mx, my = (ax + bx) / 2, (ay + by) / 2
        nx, ny = _unit(-(by - ay), bx - ax)
        ox, oy = cv.outward(mx, my)
        if nx * ox + ny * oy < 0:
            nx, ny = -nx, -ny  # the side away from the figure's centre
        ux, uy = _unit(bx - ax, by - ay)
        side, other = (mx + 14 * nx, my + 14 * ny), (mx - 14 * nx, my - 14 * ny)
        for text in texts:  # nudged outwards, to the other side, or along the segment
            pending.append((text, [(side, (nx, ny)), (other, (-nx, -ny)), (side, (ux, uy)),
                                   (side, (-ux, -uy)), (other, (ux, uy)), (other, (-ux, -uy))]))


def _draw_angles(cv: _Canvas, angles: dict, classes: dict, pending: list) -> None:
    """An arc at each annotated angle (n arcs for equality class n); labels queued."""
    for (a, v, b), texts in angles.items():
        pa, pv, pb = cv.P[a], cv.P[v], cv.P[b]
        t1 = math.degrees(math.atan2(pa[1] - pv[1], pa[0] - pv[0]))
        t2 = math.degrees(math.atan2(pb[1] - pv[1], pb[0] - pv[0]))
        start, end = (t1, t2) if (t2 - t1) % 360 <= 180 else (t2, t1)
        sweep = (end - start) % 360
        arcs = classes.get((a, v, b), 1)
        for i in range(arcs):
            r = 16 + 4 * i
            cv.draw.arc([pv[0] - r, pv[1] - r, pv[0] + r, pv[1] + r], start, start + sweep,
                        fill=NOTE, width=1)
        mid = math.radians(start + sweep / 2)
        away = (math.cos(mid), math.sin(mid))
        r = 32 + 4 * (arcs - 1)
        for text in texts:
            pending.append((text, _fan((pv[0] + r * away[0], pv[1] + r * away[1]), away)))


def _queue_arc_measures(cv: _Canvas, ann: dict, circles: dict, radii: dict,
                        pending: list) -> None:
    """``Equals(MeasureOf(Arc(A, B)), v)``: the measure outside the minor arc's middle."""
    P = cv.P
    for f in _forms(ann):
        m = _EQ_ARC.match(f)
        if not m or m.group(1) not in P or m.group(2) not in P:
            continue
        a, b = m.group(1), m.group(2)
        centre = next((c for c, on in circles.items() if a in on and b in on and c in radii),
                      None)
        if centre is None:
            continue
        c = P[centre]
        ta = math.atan2(P[a][1] - c[1], P[a][0] - c[0])
        tb = math.atan2(P[b][1] - c[1], P[b][0] - c[0])
        diff = (tb - ta) % (2 * math.pi)
        mid = ta + diff / 2 if diff <= math.pi else tb + (2 * math.pi - diff) / 2
        rr = radii[centre] * cv.scale + 16
        away = (math.cos(mid), math.sin(mid))
        pending.append((_degrees(m.group(3)),
                        _fan((c[0] + rr * away[0], c[1] + rr * away[1]), away)))


def _draw_right_angles_and_parallels(cv: _Canvas, ann: dict) -> None:
    P, d = cv.P, cv.draw
    for f in _forms(ann):
        if (m := _PERP.match(f)) and all(g in P for g in m.groups()):
            l1, l2 = {m.group(1), m.group(2)}, {m.group(3), m.group(4)}
            common = l1 & l2
            if len(common) != 1 or len(l1) != 2 or len(l2) != 2:
                continue
            v = common.pop()
            a, b = (l1 - {v}).pop(), (l2 - {v}).pop()
            u1 = _unit(P[a][0] - P[v][0], P[a][1] - P[v][1])
            u2 = _unit(P[b][0] - P[v][0], P[b][1] - P[v][1])
            s = 10
            p1 = (P[v][0] + s * u1[0], P[v][1] + s * u1[1])
            p2 = (p1[0] + s * u2[0], p1[1] + s * u2[1])
            p3 = (P[v][0] + s * u2[0], P[v][1] + s * u2[1])
            d.line([p1, p2, p3], fill=NOTE, width=1)
        elif (m := _PARALLEL.match(f)) and all(g in P for g in m.groups()):
            for a, b in ((m.group(1), m.group(2)), (m.group(3), m.group(4))):
                mx, my = (P[a][0] + P[b][0]) / 2, (P[a][1] + P[b][1]) / 2
                ux, uy = _unit(P[b][0] - P[a][0], P[b][1] - P[a][1])
                for off in (-3, 3):  # a small arrowhead on each parallel segment
                    bx, by = mx + off * ux, my + off * uy
                    d.line([(bx - 6 * ux - 4 * uy, by - 6 * uy + 4 * ux), (bx, by),
                            (bx - 6 * ux + 4 * uy, by - 6 * uy - 4 * ux)], fill=NOTE, width=1)


def draw_diagram(ann: dict, size: int = 336):
    """The annotation as a PIL image (RGB, white background, longest side about ``size``);
    points without coordinates are left out (module docstring)."""
    pts = located_points(ann)
    if not pts:
        raise ValueError("the annotation has no point coordinates to draw")
    circles = {c: on for c, on in _circles(ann).items() if c in pts}
    radii = _radii(pts, circles)
    _snap(pts, radii, ann)
    cv = _Canvas(pts, radii, size)
    P = cv.P
    for line in ann.get("line_instances", []):
        ends = _split_line(line, P) if line else None
        if ends:
            cv.draw.line([P[ends[0]], P[ends[1]]], fill=INK, width=2)
    for c, r in radii.items():
        (x, y), rr = P[c], r * cv.scale
        cv.draw.ellipse([x - rr, y - rr, x + rr, y + rr], outline=INK, width=2)
    names = {}  # point labels first claim their places, so the others avoid them
    for name, p in P.items():
        ux, uy = cv.outward(*p)
        names[name] = (p[0] + 14 * ux, p[1] + 14 * uy)
        cv.reserve(name, names[name])
        cv.boxes.append((p[0] - 3, p[1] - 3, p[0] + 3, p[1] + 3))
    lengths, ticks, angles, arc_classes = _marks(ann, P)
    pending: list = []  # (text, [(where, direction to nudge it), other ways …])
    _draw_angles(cv, angles, arc_classes, pending)  # first: their labels must stay close
    _queue_arc_measures(cv, ann, circles, radii, pending)
    _draw_lengths(cv, lengths, ticks, pending)
    _draw_right_angles_and_parallels(cv, ann)
    for text, moves in pending:
        cv.label(text, cv.place(text, moves), cv.small, NOTE)
    for name, p in P.items():
        cv.draw.ellipse([p[0] - 2.5, p[1] - 2.5, p[0] + 2.5, p[1] + 2.5], fill=INK)
        cv.label(name, names[name])
    return cv.img


def _snap(pts: dict, radii: dict, ann: dict) -> None:
    """Move points onto what the logic forms put them on (annotated coordinates are
    hand-clicked): onto their circle (radially), then onto their segment (orthogonal
    projection, kept between the ends). Only located points move or anchor."""
    forms = _forms(ann)
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
