"""``data=arith`` (the generated tool task) and ``data.curriculum=solve_rate``."""

from __future__ import annotations

import json

import pytest

from agentgym.config import build_config
from agentgym.core.types import Trajectory
import agentgym.envs.arith as arith
from agentgym.data.rows import load_rows, write_jsonl
from agentgym.trainers.loop import train
from agentgym.trainers.curriculum import MIN_GROUPS, Curriculum
from toy_envs import level_rows


def test_the_generator_is_deterministic_per_seed():
    a, b = arith.train_rows(seed=3, per_level=50), arith.train_rows(seed=3, per_level=50)
    assert a == b
    other = arith.train_rows(seed=4, per_level=50)
    assert {r["extra_info"]["question"] for r in a} != {r["extra_info"]["question"] for r in other}
    assert [r["extra_info"]["level"] for r in a[:10]] == [1, 2, 3, 4, 5] * 2  # interleaved


def test_the_shipped_heldout_set_is_the_generators_and_never_in_training():
    shipped = load_rows("code", "arith_test")
    assert shipped == arith.test_rows()  # data/arith/test.jsonl is what the code writes
    assert len(shipped) == 5 * arith.TEST_PER_LEVEL
    held = {r["extra_info"]["question"] for r in shipped}
    assert len(held) == len(shipped)
    for seed in (0, 1, 2):
        train_q = [r["extra_info"]["question"] for r in arith.train_rows(seed)]
        assert not held & set(train_q)
        assert len(set(train_q)) == len(train_q)
    # the generator skips the held-out questions: a stream from the held-out seed would
    # reproduce them, so that seed is refused
    with pytest.raises(ValueError, match="held-out"):
        arith.train_rows(arith.TEST_SEED)
    assert len(load_rows("code", "arith_test_l3")) == arith.TEST_PER_LEVEL
    assert {r["extra_info"]["level"] for r in load_rows("code", "arith_test_l3")} == {3}


def test_every_answer_is_what_the_solution_computes():
    from agentgym.envs.math_reward import is_equivalent
    for row in arith.train_rows(seed=5, per_level=40):
        solution = row["extra_info"]["solution"]
        expr = solution.split("<<", 1)[1].split("=", 1)[0]
        truth = row["reward_model"]["ground_truth"]
        assert truth == str(int(truth)) and int(truth) >= 0, row["extra_info"]
        assert is_equivalent(str(eval(expr)), truth)  # Python's own arithmetic
        assert solution.endswith(f"#### {truth}")


def test_an_arith_demonstration_is_one_cell_run_in_the_sandbox():
    from agentgym.data.demo_builders import build_demos
    from agentgym.envs.code import CodeEnv
    row = arith.train_rows(seed=0, per_level=1)[4]  # a level-5 word problem
    (demo,) = build_demos("code", [row], CodeEnv)  # its own sandbox, closed with it
    assert demo["reward"] == 1.0
    assert len(demo["actions"]) == 2
    expr = row["extra_info"]["solution"].split("<<", 1)[1].split("=", 1)[0]
    assert f"print({expr})" in demo["actions"][0]
    assert row["reward_model"]["ground_truth"] in demo["observations"][0][0]["content"]


def _groups(rates: list[float], n: int = 4) -> list[Trajectory]:
    out = []
    for g, rate in enumerate(rates):
        solved = round(rate * n)
        out += [Trajectory(uid=str(g), reward=float(k < solved), info={"em": float(k < solved)})
                for k in range(n)]
    return out


def test_the_level_sampler_advances_past_mastered_levels_and_stays_in_the_band():
    rows = level_rows(20)
    cur = Curriculum(rows, (0.2, 0.8), seed=0)
    seen_levels = []
    script = {1: 1.0, 2: 0.5, 3: 0.0}
    for _ in range(10):
        picked = cur.take(4)
        levels = {rows[i]["extra_info"]["level"] for i in picked}
        assert len(levels) == 1  # one level per step
        seen_levels.append(levels.pop())
        m = cur.observe(picked, _groups([script[seen_levels[-1]]] * 4), 4)
    # level 1 is mastered once MIN_GROUPS groups are in; level 2 stays (0.5 is in the band)
    assert seen_levels == [1] * (MIN_GROUPS // 4) + [2] * (10 - MIN_GROUPS // 4)
    assert m["curriculum/level"] == 2.0 and m["curriculum/in_band"] == 1.0
    assert m["curriculum/solve_rate_L1"] == 1.0 and m["curriculum/solve_rate_L2"] == 0.5
    # the state round-trips: a resumed sampler picks what this one would
    again = Curriculum(rows, (0.2, 0.8), seed=0, state=json.loads(json.dumps(cur.state())))
    assert again.take(4) == cur.take(4)


def test_the_row_sampler_retires_mastered_rows_and_benches_hopeless_ones():
    rows = [{"prompt": [], "extra_info": {"index": i}} for i in range(6)]
    cur = Curriculum(rows, (0.2, 0.8), seed=0)
    picked = cur.take(6)
    assert picked == [0, 1, 2, 3, 4, 5]
    cur.observe(picked, _groups([1.0, 0.0, 0.5, 0.5, 1.0, 0.25]), 4)
    # row 0 and 4 are retired, row 1 sits out the next pass
    assert cur.take(3) == [2, 3, 5]
    assert cur.take(3) == [1, 2, 3]  # the pass after: row 1 is back
    cur.observe([1, 2, 3], _groups([0.5, 0.5, 1.0]), 4)
    assert cur.take(4) == [5, 1, 2, 5]  # rows 0, 3 and 4 retired
    assert cur.metrics()["curriculum/retired"] == pytest.approx(3 / 6)


def test_a_curriculum_run_on_tiny_climbs_to_the_level_in_the_band(tmp_path):
    data = tmp_path / "levels.jsonl"
    write_jsonl(data, level_rows(16))
    cfg = build_config({"env": "agentgym-test/Level-v0", "model": "tiny", "data": str(data),
                        "data.curriculum": "solve_rate", "trainer.total_steps": 4,
                        "trainer.prompts_per_step": 4, "rollout.n": 4,
                        "rollout.max_tokens_per_turn": 6, "trainer.eval_limit": 0,
                        "trainer.save_every": 2, "run_dir": str(tmp_path / "run")})
    run = train(cfg)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["curriculum/level"] for r in rows] == [1.0, 2.0, 2.0, 2.0]
    assert rows[0]["rollout/reward"] == 1.0 and rows[0]["rollout/signal_groups"] == 0.0
    assert all(0.0 < r["rollout/reward"] < 1.0 for r in rows[2:])  # level 2's coin flips
    assert all(r["curriculum/solve_rate_L2"] <= 0.8 for r in rows[2:])
    state = json.loads((run / "checkpoints" / "step_4" / "state.json").read_text())
    assert state["curriculum"]["at"] == 1


def test_a_mixed_run_has_a_sampler_per_env_by_its_own_rows():
    from agentgym.trainers.curriculum import MixedCurriculum, make_curriculum
    levelled = level_rows(4, levels=(1, 2))  # 8 rows with levels
    plain = [{"prompt": [], "env": "search", "extra_info": {"index": i}} for i in range(3)]
    rows = [levelled[0], plain[0], levelled[1], plain[1], levelled[2], plain[2], *levelled[3:]]
    cur = make_curriculum(rows, (0.2, 0.8), seed=0)
    assert isinstance(cur, MixedCurriculum)
    picked = cur.take(4)  # the slots follow the row order: level env, search, level, search
    assert [rows[i]["env"] for i in picked] == ["agentgym-test/Level-v0", "search"] * 2
    assert [rows[i]["extra_info"]["level"] for i in picked[::2]] == [1, 1]
    m = cur.observe(picked, _groups([1.0, 0.0, 1.0, 0.5]), 4)
    assert m["agentgym-test/Level-v0/curriculum/solve_rate_L1"] == 1.0
    assert m["search/curriculum/retired"] == 0.0 and m["search/curriculum/in_band"] == 0.5
    again = make_curriculum(rows, (0.2, 0.8), seed=0, state=json.loads(json.dumps(cur.state())))
    assert again.take(6) == cur.take(6)


def test_the_reward_band_is_the_interval_of_the_mean_over_groups():
    from agentgym.trainers.collection import reward_ci95
    # group means 1.0, 0.5, 0.0, 0.5: sd over groups 0.408, 4 groups
    trajs = _groups([1.0, 0.5, 0.0, 0.5])
    assert reward_ci95(trajs) == pytest.approx(1.96 * (1 / 6) ** 0.5 / 2)
    assert reward_ci95(_groups([0.5])) == 0.0  # one group: no spread to show
    assert reward_ci95(_groups([0.5, 0.5, 0.5])) == 0.0


def test_search_questions_are_ordered_by_difficulty_for_the_curriculum():
    """Single-hop questions whose answer BM25 ranks first come first, HotpotQA last; the
    levels are what the retrieval says, checked here against the passages themselves."""
    from agentgym.core.paths import shipped_corpus
    from agentgym.envs.answerable import MULTI_HOP, TOP1, _bm25, difficulty_levels
    from agentgym.data.rows import question_rows
    cfg = build_config({"env": "search", "data.curriculum": "solve_rate"})
    rows = question_rows(cfg, "train", limit=120).rows
    levels = [r["extra_info"]["level"] for r in rows]
    assert levels == difficulty_levels(rows, shipped_corpus())
    assert set(levels) == {1, 2, 3, 4}
    assert all((lv == MULTI_HOP) == (r["data_source"] == "hotpotqa") for r, lv in zip(rows, levels))
    retriever, index = _bm25(str(shipped_corpus()))
    import bm25s
    from agentgym.envs.rewards import normalize_answer
    from agentgym.envs.search import gold_answers
    for row in [r for r, lv in zip(rows, levels) if lv == TOP1][:5]:
        (top,), _ = retriever.retrieve(bm25s.tokenize([row["extra_info"]["question"]],
                                                      stopwords="en", show_progress=False),
                                       k=1, show_progress=False)
        passage = index.passages[int(top[0])]
        assert any(f" {normalize_answer(g)} " in passage for g in gold_answers(row))
    assert "level" not in question_rows(build_config({"env": "search"}), "train", 5).rows[0][
        "extra_info"]  # only with a curriculum
