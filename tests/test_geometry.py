"""Geometry env: diagrams drawn from logic forms, the reward, the calculator tool, data."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from agentgym import envs
from agentgym.data.rows import load_rows
from agentgym.envs.geometry import BUILTIN_ROWS, GeometryEnv, calculate, geometry_row, load_image
from agentgym.envs.geometry_diagrams import (_Canvas, _classes, _first_user, _marks, check_drawable,
                                    diagram_png, draw_diagram, located_points)
from agentgym.envs.math_reward import decimal_places, matches_rounded, numeric_value

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "geometry3k"
TRIANGLE = BUILTIN_ROWS[0]["images"][0]["logic_form"]


def test_drawing_follows_the_logic_form(tmp_path):
    img = draw_diagram(TRIANGLE)
    assert img.mode == "RGB" and max(img.size) <= 336
    ink = np.asarray(img.convert("L")) < 128
    assert ink.mean() > 0.005  # segments and labels were drawn
    # a length label adds ink; a different figure gives a different image
    bare = dict(TRIANGLE, diagram_logic_forms=[])
    assert (np.asarray(draw_diagram(bare).convert("L")) < 128).sum() < ink.sum()
    moved = dict(TRIANGLE, point_positions={"A": [0, 0], "B": [0, 60], "C": [160, 120]})
    assert np.asarray(draw_diagram(moved)).tobytes() != np.asarray(img).tobytes()
    # a point on a segment is drawn on it (hand-clicked coordinates are snapped)
    off = {"point_positions": {"A": [0, 0], "B": [100, 0], "M": [50, 9]},
           "line_instances": ["AB"], "circle_instances": [],
           "diagram_logic_forms": ["PointLiesOnLine(M, Line(A, B))"]}
    from agentgym.envs.geometry_diagrams import _snap
    pts = {k: tuple(v) for k, v in off["point_positions"].items()}
    _snap(pts, {}, off)
    assert pts["M"] == (50.0, 0.0)
    # cached: drawn once, then reused
    first = diagram_png(TRIANGLE, cache=tmp_path)
    stamp = first.stat().st_mtime_ns
    assert diagram_png(TRIANGLE, cache=tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert Image.open(first).size == img.size


def test_undrawable_annotations_say_why():
    assert check_drawable(TRIANGLE) == []
    bad = dict(TRIANGLE, line_instances=["AB", "BQ"], circle_instances=["Z"])
    why = check_drawable(bad)
    assert any("'BQ'" in w for w in why) and any("'Z'" in w for w in why)
    with pytest.raises(ValueError, match="no point coordinates"):
        draw_diagram({"point_positions": {}, "line_instances": []})


def _ink(img) -> np.ndarray:
    return np.asarray(img.convert("L")) < 200


def test_points_without_coordinates_are_never_drawn():
    # InterGPS marks a point it did not locate with [-1, -1]: a foot D that a segment,
    # a perpendicular or a label needs makes the figure undrawable, with that reason
    foot = dict(TRIANGLE, point_positions={**TRIANGLE["point_positions"], "D": [-1, -1]},
                line_instances=["AB", "BC", "AC", "BD"],
                diagram_logic_forms=["PointLiesOnLine(D, Line(A, C))",
                                     "Perpendicular(Line(B, D), Line(D, C))"])
    assert check_drawable(foot) == [
        "point 'D' has no coordinates ([-1, -1]) but segment 'BD' uses it"]
    only_form = dict(foot, line_instances=["AB", "BC", "AC"])
    assert check_drawable(only_form) == ["point 'D' has no coordinates ([-1, -1]) but logic "
                                         "form 'PointLiesOnLine(D, Line(A, C))' uses it"]
    centre = dict(TRIANGLE, point_positions={**TRIANGLE["point_positions"], "O": [-1, -1]},
                  circle_instances=["O"])
    assert "circle 'O' uses it" in check_drawable(centre)[0]
    # a missing point nothing names (a name only the question uses) is simply left out
    stray = dict(TRIANGLE, point_positions={**TRIANGLE["point_positions"], "K": [-1, -1]})
    assert check_drawable(stray) == [] and "K" not in located_points(stray)
    assert np.array_equal(np.asarray(draw_diagram(stray)), np.asarray(draw_diagram(TRIANGLE)))
    # and it never anchors a snap: M stays where it was clicked, not pulled towards (-1,-1)
    from agentgym.envs.geometry_diagrams import _snap
    ann = {"point_positions": {"A": [-1, -1], "B": [100, 0], "M": [50, 9]},
           "diagram_logic_forms": ["PointLiesOnLine(M, Line(A, B))"]}
    pts = located_points(ann)
    _snap(pts, {}, ann)
    assert pts == {"B": (100.0, 0.0), "M": (50.0, 9.0)}


def test_equal_lengths_get_ticks_and_equal_angles_get_arcs():
    square = {"point_positions": {"A": [0, 0], "B": [100, 0], "C": [100, 100], "D": [0, 100]},
              "line_instances": ["AB", "BC", "CD", "DA"], "circle_instances": [],
              "diagram_logic_forms": []}
    plain = _ink(draw_diagram(square))
    forms = ["Equals(LengthOf(Line(A, B)), LengthOf(Line(C, D)))",
             "Equals(LengthOf(Line(B, C)), LengthOf(Line(D, A)))"]
    ticked = _ink(draw_diagram(dict(square, diagram_logic_forms=forms)))
    h, w = plain.shape
    mids = {"AB": (w // 2, 40), "CD": (w // 2, h - 40), "BC": (w - 40, h // 2),
            "DA": (40, h // 2)}

    def extra(img, x, y):  # ink added near (x, y), in pixels
        return int(img[y - 8:y + 9, x - 8:x + 9].sum() - plain[y - 8:y + 9, x - 8:x + 9].sum())
    counts = {k: extra(ticked, *xy) for k, xy in mids.items()}
    assert all(n > 0 for n in counts.values()), counts  # every equal side is marked
    assert counts["AB"] == counts["CD"] and counts["BC"] == counts["DA"]  # matching marks
    assert counts["BC"] > counts["AB"]  # the second class has two ticks, the first one
    assert _classes([(1, 2), (3, 4), (2, 5)]) == {1: 1, 2: 1, 5: 1, 3: 2, 4: 2}
    # both angles of an equality get arcs (two classes: one arc, then two)
    angles = ["Equals(MeasureOf(Angle(D, A, B)), MeasureOf(Angle(B, C, D)))",
              "Equals(MeasureOf(Angle(A, B, C)), MeasureOf(Angle(C, D, A)))"]
    arcs = _ink(draw_diagram(dict(square, diagram_logic_forms=angles)))
    corners = {"A": (40, 40), "B": (w - 40, 40), "C": (w - 40, h - 40), "D": (40, h - 40)}

    def near(img, x, y):
        sl = (slice(y - 24, y + 25), slice(x - 24, x + 25))
        return int(img[sl].sum() - plain[sl].sum())
    n = {k: near(arcs, *xy) for k, xy in corners.items()}
    assert n["A"] == n["C"] > 0 and n["B"] == n["D"] > n["A"], n
    # numbered angles carry their number (questions ask for m∠1); named sides their name
    _, _, labels, _ = _marks({"diagram_logic_forms": [
        "Equals(MeasureOf(Angle(D, A, B)), MeasureOf(angle 1))"]}, located_points(square))
    assert labels == {("B", "A", "D"): ["1"]}


def test_a_label_is_nudged_off_a_point_label():
    cv = _Canvas({"A": (0.0, 0.0), "B": (100.0, 100.0)}, {}, 336)
    cv.reserve("X", (150, 150))
    at = cv.place("x", [((150, 150), (0.0, 1.0))])
    assert at != (150, 150) and cv._clash(cv._box("x", at, cv.small)) == 0
    assert cv.place("y", [((60, 60), (0.0, 1.0))]) == (60, 60)  # a free spot stays


@pytest.mark.skipif(not SHARED.exists(), reason="needs ../shared/data/geometry3k")
def test_every_shipped_problem_is_drawable_and_the_counts_hold():
    annots = json.loads((SHARED / "logic_forms" / "diagram_logic_forms_annot.json").read_text())
    drawable = [k for k, v in annots.items() if not check_drawable(v)]
    assert len(annots) == 3002 and len(drawable) == 2694
    missing = [k for k, v in annots.items()
               if any("[-1, -1]" in w for w in check_drawable(v))]
    assert len(missing) == 290
    for i in range(11, 21):  # the ten problems with originals
        assert draw_diagram(annots[str(i)]).size[0] > 100
    undrawable = json.loads((Path(envs.__file__).parents[1] / "data" / "geometry"
                             / "undrawable.json").read_text())
    assert sorted(undrawable) == sorted(k for k in annots if k not in set(drawable))


def test_shipped_rows_are_verl_rows_with_images():
    rows = load_rows("geometry", "test", 5)
    sizes = {split: len(load_rows("geometry", split)) for split in ("train", "val", "test")}
    assert sizes == {"train": 1873, "val": 272, "test": 549}
    for r in rows:
        assert r["env"] == "geometry" and r["prompt"][0]["content"].startswith("<image>")
    assert load_image(rows[0]["images"][0]).mode == "RGB"


def test_no_shipped_row_uses_a_point_without_coordinates():
    for split in ("train", "val", "test"):
        for r in load_rows("geometry", split):
            ann = r["images"][0]["logic_form"]
            assert check_drawable(ann) == [], r["extra_info"]["id"]
            named = ann["point_positions"]
            for p in set(named) - set(located_points(ann)):
                assert _first_user(ann, p, named) is None, (r["extra_info"]["id"], p)


def test_images_load_from_every_spec(tmp_path):
    img = draw_diagram(TRIANGLE)
    path = tmp_path / "d.png"
    img.save(path)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    for spec in (str(path), {"path": str(path)}, {"bytes": buf.getvalue()},
                 {"logic_form": TRIANGLE}, img):
        assert np.array_equal(np.asarray(load_image(spec)), np.asarray(img))
    with pytest.raises(ValueError, match="logic_form"):
        load_image({"url": "http://example.com/x.png"})


@pytest.mark.parametrize("pred,gold,ok", [
    # the gold's stated precision: within half a unit of its last decimal
    ("2\\sqrt{3}", "3.46", True), ("\\frac{15}{2}", "7.5", True), ("16.97", "17", True),
    ("4\\pi", "12.57", True), ("120.4", "120", True), ("60°", "60", True),
    ("60^{\\circ}", "60", True), ("121", "120", False), ("146", "145", False),
    ("363", "360", False), ("59", "60", False), ("6.4", "6.45", False), ("6", "6.45", False),
    ("17", "16.97", False),
    # an exact gold: a decimal of 3+ significant digits rounding to it counts
    ("3.46", "2\\sqrt{3}", True), ("12.6", "4\\pi", True), ("7.5", "\\frac{15}{2}", True),
    ("3.5", "2\\sqrt{3}", False), ("3", "2\\sqrt{3}", False), ("3.47", "2\\sqrt{3}", False),
    ("x+1", "2", False), ("", "2", False)])
def test_numeric_answers_match_to_the_golds_rounding(pred, gold, ok):
    assert matches_rounded(pred, gold) is ok
    assert decimal_places("7.50") == 2 and decimal_places("120") == 0
    assert decimal_places("2\\sqrt{3}") is None


def test_numeric_value_refuses_non_numbers():
    assert numeric_value("\\sqrt{2}") == pytest.approx(2 ** 0.5)
    assert numeric_value("x") is None and numeric_value("9" * 10_000) is None


def _play(env, row, actions):
    obs, info = env.reset(seed=0, options={"row": row})
    out = []
    for a in actions:
        out.append(env.step(a))
        if out[-1][2] or out[-1][3]:
            break
    return obs, out


def test_episodes_reward_right_answers_by_value_or_letter():
    env = GeometryEnv()
    obs, [(_, r, term, trunc, info)] = _play(env, BUILTIN_ROWS[0], ["x = 5, so \\boxed{5}"])
    parts = obs[-1]["content"]
    assert parts[0]["type"] == "image" and parts[0]["image"].size[0] > 50
    assert "Find x." in parts[1]["text"] and "\\boxed{}" in parts[-1]["text"]
    assert (r, term, trunc, info["em"]) == (1.0, True, False, 1.0)
    for answer, reward in (("5.02", 1.0), ("5", 1.0), ("6", 0.0), ("7", 0.0)):
        _, [(_, r, *_)] = _play(env, BUILTIN_ROWS[0], [f"\\boxed{{{answer}}}"])
        assert r == reward, answer  # gold 5: anything that rounds to 5
    choice = BUILTIN_ROWS[1]
    assert "C. 60" in choice["prompt"][0]["content"]
    for answer, reward in (("C", 1.0), ("(c)", 1.0), ("B", 0.0), ("60", 1.0), ("45", 0.0),
                           ("60°", 1.0), ("60^\\circ", 1.0), ("\\text{C}", 1.0),
                           ("\\mathrm{C}", 1.0), ("\\textbf{C}", 1.0), ("(C) 60", 1.0),
                           ("C. 60", 1.0), ("\\text{(B)}", 0.0), ("E", 0.0)):
        _, [(_, r, *_)] = _play(env, choice, [f"\\boxed{{{answer}}}"])
        assert r == reward, answer
    # no box: a corrective observation, then the turn budget ends it
    _, steps = _play(env, BUILTIN_ROWS[0], ["the answer is five", "still five"])
    assert steps[0][0][0]["content"].startswith("Your reply has no \\boxed")
    assert steps[-1][3] and steps[-1][4]["malformed_actions"] == 2 and steps[-1][1] == 0.0


def test_with_choices_a_value_counts_only_when_the_gold_choice_is_nearest():
    row = geometry_row("Use parallelogram M N P R to find y.", "6.45", TRIANGLE, "1", "train",
                       choices=["6.4", "6.45", "6.5", "7"], letter="B")
    env = GeometryEnv()
    for answer, reward in (("6.45", 1.0), ("B", 1.0), ("6.4", 0.0), ("6.5", 0.0), ("7", 0.0),
                           ("6.449", 1.0), ("6.43", 0.0), ("\\frac{129}{20}", 1.0),
                           ("A", 0.0)):
        _, [(_, r, *_)] = _play(env, row, [f"\\boxed{{{answer}}}"])
        assert r == reward, answer


def test_the_calculator_tool_evaluates_and_never_executes():
    assert calculate("2*sqrt(3)*5") == pytest.approx(17.3205, rel=1e-5)
    assert calculate("sin(30) + 2^3") == pytest.approx(8.5)
    for bad in ("__import__('os').system('true')", "open('x')", "9**9**9", "1/0", "a+1", ""):
        with pytest.raises(ValueError):
            calculate(bad)
    env = GeometryEnv(max_turns=3, tool=True)
    assert env.stop_strings == ("</calculator>",)
    obs, steps = _play(env, BUILTIN_ROWS[0], ["<calculator>sqrt(3^2+4^2)</calculator>",
                                              "<calculator>open('f')</calculator>",
                                              "\\boxed{5}"])
    assert "<calculator>" in obs[-1]["content"][-1]["text"]
    assert steps[0][0] == [{"role": "tool", "content": "<result>5</result>"}]
    assert steps[1][0][0]["content"].startswith("<result>error:")
    assert steps[2][1] == 1.0 and steps[2][4]["tool_calls"] == 2
    assert steps[2][4]["tool_failures"] == 1


def test_registered_and_passes_the_contract_checker():
    assert "agentgym/Geometry-v0" in envs.env_ids()
    envs.check_env(envs.make_env("geometry"))
    row = geometry_row("Find y.", "3", TRIANGLE, "t", "test")
    assert row["images"] == [{"logic_form": TRIANGLE}]
