"""bench/multihop_rl.py (issue 47's learning benchmark): its time budget, its report from
eval results (paired counts exact), and its --smoke run end to end: every stage with the
tiny model, then a rerun that reuses every stage."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.multihop_rl import ARMS, parse, train_share  # noqa: E402
from bench.multihop_report import arms_table, on_common_questions, paired, report  # noqa: E402


def test_rl_gets_what_the_evals_leave_shared_among_the_arms():
    # 100 min left, two 10-minute evals to come (each reserved 12.5), a 2-minute margin
    assert train_share(6000, 600, 2, 2) == pytest.approx((6000 - 1500 - 120) / 2)
    assert train_share(3000, 600, 2, 1) == pytest.approx(3000 - 1500 - 120)
    assert train_share(3000, 600, 0, 1) == pytest.approx(2880)
    with pytest.raises(ValueError, match="arms_left"):
        train_share(3000, 600, 2, 0)


def test_smoke_settings_apply_where_the_command_line_kept_the_defaults():
    a = parse(["--smoke", "--eval-limit", "6"])
    assert (a.model, a.steps, a.eval_limit, a.prompts) == ("tiny", 1, 6, 2)
    assert a.doc == str(Path("runs/multihop_rl_smoke") / "BENCHMARKS.md")
    full = parse([])
    assert (full.model, full.eval_limit, full.max_response_tokens) == ("smollm2-135m", 500, 1536)
    assert full.doc == str(ROOT / "docs" / "BENCHMARKS.md")


def _episodes(spec: list[tuple[str, int, int, int]]) -> list[dict]:
    """(type, em, searches, second hop) per question -> eval episodes."""
    return [{"uid": f"q{i}", "type": t, "em": float(em), "tool_calls": calls,
             "second_hop": hop} for i, (t, em, calls, hop) in enumerate(spec)]


def test_the_report_pairs_each_arm_with_the_sft_model_and_the_arms(tmp_path):
    sft = [("bridge", 0, 1, 0)] * 6 + [("comparison", 1, 1, 0)] * 4
    # curriculum: 2 EM gained on bridge; turn: those 2, plus 3 with a second hop
    cur = [("bridge", 1, 1, 0)] * 2 + [("bridge", 0, 1, 0)] * 4 + [("comparison", 1, 1, 0)] * 4
    turn = [("bridge", 1, 2, 1)] * 2 + [("bridge", 0, 2, 1)] + [("bridge", 0, 1, 0)] * 3 + \
        [("comparison", 1, 1, 0)] * 4
    evals = {name: {"n": 10, "episodes": _episodes(spec)}
             for name, spec in (("sft", sft), ("curriculum", cur), ("turn", turn))}
    (tmp_path / "sft.json").write_text(json.dumps({"model": "m", "steps": 8, "demos": 40,
                                                   "two_search_demos": 18}))
    (tmp_path / "curriculum").mkdir()
    (tmp_path / "curriculum" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "rollout/reward": 0.1 * s, "curriculum/level": lv}) + "\n"
        for s, lv in ((1, 1), (2, 1), (3, 4), (4, 4))))
    trained = {"curriculum": {"step": 4, "stopped": True, "minutes": 30.0},
               "turn": {"step": 4, "stopped": False, "minutes": 28.0}}
    a = parse([])
    text = report(a, tmp_path, evals, trained, ARMS)
    lines = text.splitlines()
    row = next(x for x in lines if x.startswith("| turn | 4 |"))
    # EM 2 gained 0 lost; 2+ searches 3 / 0; second hop 3 / 0 against the SFT model
    assert "| 2 / 0, p = 0.5 | 3 / 0, p = 0.25 | 3 / 0, p = 0.25 |" in row
    assert "| 1.30 [" in row and "| 0.300 [" in row  # searches per episode, 2+ searches
    assert "| EM | 0.600 | 0.600 | 0 / 0, p = 1 |" in text
    assert "| second hop | 0.000 | 0.300 | 3 / 0, p = 0.25 |" in text
    assert any(x.startswith("| bridge | turn | 6 | 0.333 [") for x in lines)
    assert any(x.startswith("| comparison | sft | 4 | 1.000 [") for x in lines)
    arm = next(x for x in lines if x.startswith("| curriculum | 4 (budget) | 30 |"))
    assert arm.endswith("| 4; step 3 |") and "0.150 → 0.350" in arm
    assert "40 demonstrations" in text and "18 of them search twice" in text


def test_three_arms_each_later_one_tested_against_the_first():
    cur = _episodes([("bridge", 1, 1, 0)] * 2 + [("bridge", 0, 1, 0)] * 2)
    turn = _episodes([("bridge", 0, 1, 0)] * 4)
    second = _episodes([("bridge", 1, 2, 1)] * 3 + [("bridge", 0, 2, 1)])
    lines = arms_table({"sft": {"episodes": cur}, "curriculum": {"episodes": cur},
                        "turn": {"episodes": turn}, "second": {"episodes": second}})
    assert lines[0] == ("| metric | curriculum | turn | second | turn vs curriculum: gained / "
                        "lost, p | second vs curriculum: gained / lost, p |")
    assert lines[2] == "| EM | 0.500 | 0.000 | 0.750 | 0 / 2, p = 0.5 | 1 / 0, p = 1 |"
    assert lines[4] == "| second hop | 0.000 | 0.000 | 1.000 | 0 / 0, p = 1 | 4 / 0, p = 0.125 |"
    assert lines[5].startswith("| searches per episode | 1.00 [") and lines[5].endswith("| | |")
    assert parse(["--arms", "curriculum,second"]).arms == ["curriculum", "second"]
    assert parse([]).arms == ["curriculum", "turn", "second"]
    for bad in ("curriculum,nope", "turn,turn", ""):
        with pytest.raises(SystemExit):
            parse(["--arms", bad])


def test_an_sft_eval_over_more_questions_is_cut_to_the_arms_questions():
    """The SFT eval of an earlier invocation played 6 questions, the arms the first 4:
    every table and paired test then covers those 4 (mcnemar refuses different sets)."""
    sft = _episodes([("bridge", 1, 2, 0)] * 2 + [("bridge", 0, 1, 0)] * 4)
    arm = _episodes([("bridge", 0, 2, 1)] * 4)
    evals = on_common_questions({"sft": {"n": 6, "episodes": sft},
                                 "curriculum": {"n": 4, "episodes": arm}})
    assert [e["uid"] for e in evals["sft"]["episodes"]] == ["q0", "q1", "q2", "q3"]
    assert evals["sft"]["n"] == 4 and evals["curriculum"]["n"] == 4
    with pytest.raises(ValueError, match="different questions"):
        paired({"episodes": sft}, {"episodes": arm}, lambda e: e["em"] >= 1)
    p = paired(evals["sft"], evals["curriculum"], lambda e: e["em"] >= 1)
    assert (p.n, p.gained, p.lost) == (4, 0, 2)


@pytest.mark.slow
def test_the_smoke_runs_every_stage_and_a_rerun_reuses_them(tmp_path):
    """``--smoke``: demonstrations, SFT, every arm and its eval with the tiny model
    (real components, nothing scripted); the section written; a rerun only reports."""
    work, doc = tmp_path / "work", tmp_path / "BENCHMARKS.md"
    cmd = [sys.executable, str(ROOT / "bench" / "multihop_rl.py"), "--smoke",
           "--work", str(work), "--doc", str(doc)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = doc.read_text()
    assert "## Multi-hop RL: a second search (tiny)" in text
    for name in ("sft", "curriculum", "turn"):
        result = json.loads((work / f"eval_{name}.json").read_text())
        assert result["n"] == 4 and result["data"] == "multihop_test"
        assert {"bridge", "comparison"} >= set(result["by_type"])
    assert json.loads((work / "turn" / "done.json").read_text())["step"] == 1
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    rerun = (work / "progress.log").read_text().split("bench/multihop_rl.py")[-1]
    for stage in ("sft: done", "eval sft: done", "arm curriculum: done", "arm turn: done",
                  "eval turn: done", "wrote the section"):
        assert stage in rerun
    assert ": agentgym " not in rerun  # no stage ran again
