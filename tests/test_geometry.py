"""Geometry env: diagrams drawn from logic forms, the reward, the calculator tool, data."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import envs
from agentgym.data import load_rows
from envs.geometry import BUILTIN_ROWS, GeometryEnv, calculate, geometry_row, load_image
from envs.geometry_diagrams import check_drawable, diagram_png, draw_diagram
from envs.math_reward import is_close, numeric_value

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
    from envs.geometry_diagrams import _snap
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


@pytest.mark.skipif(not SHARED.exists(), reason="needs ../shared/data/geometry3k")
def test_every_shipped_problem_is_drawable_and_the_counts_hold():
    annots = json.loads((SHARED / "logic_forms" / "diagram_logic_forms_annot.json").read_text())
    drawable = [k for k, v in annots.items() if not check_drawable(v)]
    assert len(annots) == 3002 and len(drawable) == 2976
    for i in range(11, 21):  # the ten problems with originals
        assert draw_diagram(annots[str(i)]).size[0] > 100


def test_shipped_rows_are_verl_rows_with_images():
    rows = load_rows("geometry", "test", 5)
    assert len(load_rows("geometry", "val")) == 300
    for r in rows:
        assert r["env"] == "geometry" and r["prompt"][0]["content"].startswith("<image>")
        assert check_drawable(r["images"][0]["logic_form"]) == []
    assert load_image(rows[0]["images"][0]).mode == "RGB"


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
    ("2\\sqrt{3}", "3.46", True), ("3.46", "2\\sqrt{3}", True), ("\\frac{15}{2}", "7.5", True),
    ("6.4", "6.45", True), ("6", "6.45", False), ("4\\pi", "12.57", True), ("x+1", "2", False),
    ("", "2", False)])
def test_numeric_answers_match_with_tolerance(pred, gold, ok):
    assert is_close(pred, gold) is ok


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
    _, [(_, r, *_)] = _play(env, BUILTIN_ROWS[0], ["\\boxed{5.02}"])
    assert r == 1.0  # within 1%
    _, [(_, r, *_)] = _play(env, BUILTIN_ROWS[0], ["\\boxed{7}"])
    assert r == 0.0
    choice = BUILTIN_ROWS[1]
    assert "C. 60" in choice["prompt"][0]["content"]
    for answer, reward in (("C", 1.0), ("(c)", 1.0), ("B", 0.0), ("60", 1.0), ("45", 0.0)):
        _, [(_, r, *_)] = _play(env, choice, [f"\\boxed{{{answer}}}"])
        assert r == reward, answer
    # no box: a corrective observation, then the turn budget ends it
    _, steps = _play(env, BUILTIN_ROWS[0], ["the answer is five", "still five"])
    assert steps[0][0][0]["content"].startswith("Your reply has no \\boxed")
    assert steps[-1][3] and steps[-1][4]["malformed_actions"] == 2 and steps[-1][1] == 0.0


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
