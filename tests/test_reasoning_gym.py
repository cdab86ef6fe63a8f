"""``env=reasoning_gym``: reasoning-gym's own generators and scorers (the real package,
no mock of it), its rows, seeds, mixes and curriculum levels, the code tool in the real
sandbox, and one GRPO step of a training run on scripted answers."""

from __future__ import annotations

import json

import pytest

reasoning_gym = pytest.importorskip("reasoning_gym")

from agentgym.cli import main  # noqa: E402
from agentgym.config import build_config  # noqa: E402
from agentgym.core.overrides import parse_overrides  # noqa: E402
from agentgym.data.rows import load_rows  # noqa: E402
from agentgym.envs import check_env, make_env  # noqa: E402
from agentgym.envs.reasoning_gym_env import ReasoningGymConfig, ReasoningGymEnv  # noqa: E402
from agentgym.rollout.engines.base import ENGINES  # noqa: E402
from agentgym.trainers import loop  # noqa: E402
from fakes import AnsweringEngine  # noqa: E402

if "test-answering" not in ENGINES:
    ENGINES.register("test-answering", AnsweringEngine)


def _cfg(*keys: str):
    return build_config(parse_overrides(["env=reasoning_gym", *keys]))


def _rows(split: str, *keys: str) -> list[dict]:
    return load_rows("reasoning_gym", split, cfg=_cfg(*keys))


def test_rows_are_the_generators_entries_and_the_held_out_seeds_are_others():
    keys = ("reasoning_gym.tasks=leg_counting", "reasoning_gym.size=40",
            "reasoning_gym.eval_size=20", "reasoning_gym.seed=7", "reasoning_gym.eval_seed=5000")
    train, test = _rows("train", *keys), _rows("test", *keys)
    ds = reasoning_gym.create_dataset("leg_counting", seed=7, size=40)
    for row in train:  # entry i of the package's own dataset, its answer the ground truth
        entry = ds[row["extra_info"]["index"]]
        assert row["extra_info"]["question"] == entry["question"] == row["prompt"][-1]["content"]
        assert row["reward_model"]["ground_truth"] == entry["answer"]
        assert row["prompt"][0] == {"role": "system",
                                    "content": reasoning_gym.utils.SYSTEM_PROMPTS["default"]}
    held = reasoning_gym.create_dataset("leg_counting", seed=5000, size=20)
    assert [r["extra_info"]["question"] for r in test] == [held[i]["question"] for i in range(20)]
    assert not {r["extra_info"]["question"] for r in train} & \
        {r["extra_info"]["question"] for r in test}
    assert _rows("train", *keys) == train  # the same seed, the same rows
    with pytest.raises(ValueError, match=r"overlap: .*eval_seed >= 1007"):
        ReasoningGymConfig(seed=7, size=1000, eval_seed=500)


def test_small_settings_skip_held_out_questions_and_hold_each_once():
    keys = ("reasoning_gym.tasks=leg_counting", "reasoning_gym.size=60",
            "reasoning_gym.eval_size=30",
            "reasoning_gym.config={min_animals: 1, max_animals: 1, max_instances: 3}")
    train, test = _rows("train", *keys), _rows("test", *keys)
    questions = [r["extra_info"]["question"] for r in test]
    assert len(questions) == len(set(questions)) < 30  # few distinct questions: kept once
    assert train and not {r["extra_info"]["question"] for r in train} & set(questions)


def test_a_weighted_mix_interleaves_its_tasks_in_proportion():
    rows = _rows("train", "reasoning_gym.tasks=[leg_counting,spell_backward]",
                 "reasoning_gym.weights=[3,1]", "reasoning_gym.size=40",
                 "reasoning_gym.config={spell_backward: {min_word_len: 3, max_word_len: 5}}")
    tasks = [r["extra_info"]["task"] for r in rows]
    assert tasks.count("leg_counting") == 30 and tasks.count("spell_backward") == 10
    assert tasks[:4].count("spell_backward") == 1  # the first k rows keep the shares
    spelled = [r for r in rows if r["extra_info"]["task"] == "spell_backward"]
    assert all(3 <= len(r["reward_model"]["ground_truth"]) <= 5 for r in spelled)
    with pytest.raises(ValueError, match="mixes settings and task names"):
        _rows("train", "reasoning_gym.tasks=[leg_counting,spell_backward]",
              "reasoning_gym.config={min_animals: 2}")
    with pytest.raises(ValueError, match="unknown task 'leg_countin'.*did you mean 'leg_counting'"):
        _rows("train", "reasoning_gym.tasks=leg_countin")
    with pytest.raises(ValueError, match=r"weights=\[1.0\] gives 1 weights for 2 task"):
        _cfg("reasoning_gym.tasks=[leg_counting,spell_backward]", "reasoning_gym.weights=[1]")


def test_levels_follow_the_tasks_curriculum_for_the_solve_rate_sampler():
    rows = _rows("train", "reasoning_gym.tasks=leg_counting", "reasoning_gym.levels=3",
                 "reasoning_gym.size=60")
    assert {r["extra_info"]["level"] for r in rows[:3]} == {1, 2, 3}  # interleaved
    curriculum = reasoning_gym.factory.create_curriculum("leg_counting")
    def animals(row: dict) -> int:  # "… if you have 5 ants, 2 cats?": the animals named
        return len(row["extra_info"]["question"].split("you have")[1].split(","))

    for level in (1, 2, 3):  # each level's rows: the curriculum's settings at that level
        curriculum.set_global_level(level - 1)
        most = curriculum.generate_configuration({}).max_animals
        assert max(animals(r) for r in rows if r["extra_info"]["level"] == level) <= most
    assert max(animals(r) for r in rows if r["extra_info"]["level"] == 3) > 1
    from agentgym.trainers.curriculum import Curriculum
    assert Curriculum(rows, (0.2, 0.8), seed=0).by_level  # data.curriculum=solve_rate's levels


def test_the_reward_is_the_tasks_own_score_of_the_answer_regenerated_from_the_row():
    row = _rows("train", "reasoning_gym.tasks=spell_backward", "reasoning_gym.size=3")[0]
    ds = reasoning_gym.create_dataset("spell_backward", seed=0, size=3)
    entry = ds[row["extra_info"]["index"]]
    env = make_env("reasoning_gym")
    try:
        check_env(env)
        for answer in (entry["answer"], entry["answer"][:-1], "x" + entry["answer"], ""):
            env.reset(options={"row": row})
            _, reward, terminated, truncated, info = env.step(
                f"Reversed, it reads:\n<answer> {answer} </answer>")
            assert reward == ds.score_answer(answer, entry) == info["score"]
            assert info["em"] == float(answer == entry["answer"]) and terminated
        solved = ReasoningGymEnv(reward="solved")  # reasoning_gym.reward=solved: 1 or 0
        solved.reset(options={"row": row})
        _, reward, _, _, info = solved.step(f"<answer>{entry['answer'][:-1]}</answer>")
        assert (reward, info["score"]) == (0.0, ds.score_answer(entry["answer"][:-1], entry)) \
            and 0 < info["score"] < 1  # partial credit in the metric, not the reward
        solved.close()
        env.reset(options={"row": row})
        _, reward, terminated, _, info = env.step("no tags at all")  # the reply is the answer
        assert (reward, terminated, info["malformed_actions"]) == (0.0, True, 1)
        moved = json.loads(json.dumps(row))
        moved["extra_info"]["seed"] = 1  # another entry than the row's question
        with pytest.raises(ValueError, match="makes another question"):
            env.reset(options={"row": moved})
    finally:
        env.close()


def test_the_code_tool_runs_cells_in_the_sandbox_then_scores_the_answer():
    from agentgym.tools.sandbox import LocalSandbox, Limits
    cfg = _cfg("reasoning_gym.tasks=leg_counting", "reasoning_gym.tool=code",
               "reasoning_gym.size=2")
    row = load_rows("reasoning_gym", "train", cfg=cfg)[0]
    assert "<code>" in row["prompt"][0]["content"]  # the prompt teaches the tool
    gold = row["reward_model"]["ground_truth"]
    with LocalSandbox(Limits()) as box:
        env = ReasoningGymEnv(tool="code", sandbox=box, max_turns=3)
        check_env(env)
        env.reset(options={"row": row})
        assert env.stop_strings == ("</code>", "</answer>")
        obs, reward, terminated, _, info = env.step(
            f"Let me add it up.\n<code>\n```python\nprint({gold} * 1)\n```\n</code>")
        assert obs == [{"role": "tool", "content": f"\n<interpreter>\n{gold}\n</interpreter>\n\n"}]
        assert (reward, terminated, info["tool_calls"]) == (0.0, False, 1)
        _, reward, terminated, _, info = env.step(f"<answer>{gold}</answer>")
        assert (reward, terminated, info["em"]) == (1.0, True, 1.0)
        env.close()


def test_a_reasoning_gym_mix_trains_one_grpo_step_with_the_answers_alone_in_the_loss(
        tmp_path, monkeypatch):
    keys = ["reasoning_gym.tasks=[leg_counting,spell_backward]", "reasoning_gym.size=8",
            "reasoning_gym.config={spell_backward: {max_word_len: 6}}"]
    rows = _rows("train", *keys)
    monkeypatch.setattr(AnsweringEngine, "answers", {r["extra_info"]["question"]:
                                                     r["reward_model"]["ground_truth"]
                                                     for r in rows})
    trained: list[tuple[str, str]] = []  # (the whole sequence, its loss-masked tokens)
    update = loop.update_policy

    def recording_update(cfg, backend, batch, *args, **kwargs):
        tok = resolve_tokenizer()
        for ids, keep, mask in zip(batch.input_ids, batch.attention_mask, batch.loss_mask):
            trained.append((tok.decode(ids[keep.bool()].tolist()),
                            tok.decode(ids[mask.bool()].tolist()).replace(tok.eos_token, "")))
        return update(cfg, backend, batch, *args, **kwargs)

    monkeypatch.setattr(loop, "update_policy", recording_update)
    run = tmp_path / "run"
    assert main(["train", "env=reasoning_gym", *keys, "model=tiny", "engine=test-answering",
                 "trainer.total_steps=1", "trainer.prompts_per_step=2", "n=2",
                 "trainer.cold_start=off", "trainer.eval_limit=0", f"run_dir={run}"]) == 0
    step = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert step["step"] == 1 and step["rollout/reward"] == 0.5  # right on even samples
    assert step["train/grad_norm"] > 0 and step["train/skipped_steps"] == 0  # a real update
    assert step["rollout/score"] == 0.5  # the env's episode metric
    assert len(trained) == 4
    first_two = {r["extra_info"]["task"] for r in rows[:2]}
    assert first_two == {"leg_counting", "spell_backward"}
    replies = {f"<answer>{a}</answer>" for a in [*AnsweringEngine.answers.values(), "no idea"]}
    for whole, masked in trained:  # the loss reads the sampled answer, nothing else
        assert masked in replies and whole.endswith(masked + resolve_tokenizer().eos_token)
        assert whole.count(reasoning_gym.utils.SYSTEM_PROMPTS["default"].strip()) == 1


def resolve_tokenizer():
    from agentgym.models.zoo import load_tokenizer, resolve_model
    return load_tokenizer(resolve_model("tiny"))


def test_demonstrations_answer_or_print_the_entrys_expression_and_are_scored():
    from agentgym.envs.reasoning_gym_env import rg_demo
    from agentgym.tools.sandbox import LocalSandbox, Limits
    keys = ("reasoning_gym.tasks=basic_arithmetic", "reasoning_gym.size=12",
            "reasoning_gym.config={min_digits: 2, max_digits: 3, operators: ['+', '-', '*']}")
    plain = _rows("train", *keys)
    env = ReasoningGymEnv()
    demos = [rg_demo(r, env) for r in plain]
    env.close()
    assert all(d["actions"] == [f"<answer>{r['reward_model']['ground_truth']}</answer>"]
               and d["reward"] == 1.0 for d, r in zip(demos, plain))
    with LocalSandbox(Limits()) as box:
        env = ReasoningGymEnv(tool="code", sandbox=box, max_turns=2)
        coded = [(rg_demo(r, env), r) for r in _rows("train", *keys, "reasoning_gym.tool=code")]
        env.close()
    assert len(coded) == 12 and all(d is not None for d, _ in coded)  # +, -, * print exactly
    for demo, row in coded:
        expression = reasoning_gym.create_dataset(
            "basic_arithmetic", seed=0, size=row["extra_info"]["size"],
            **row["extra_info"]["settings"])[row["extra_info"]["index"]]["metadata"]["expression"]
        assert f"print({expression})" in demo["actions"][0]
        gold = row["reward_model"]["ground_truth"]
        shown = demo["observations"][0][0]["content"]
        assert shown == f"\n<interpreter>\n{gold}\n</interpreter>\n\n"
        assert demo["actions"][1] == f"<answer>{gold}</answer>"
    with LocalSandbox(Limits()) as box:  # a task whose entries carry no expression: none
        env = ReasoningGymEnv(tool="code", sandbox=box, max_turns=2)
        row = _rows("train", "reasoning_gym.tasks=spell_backward", "reasoning_gym.size=1",
                    "reasoning_gym.tool=code")[0]
        assert rg_demo(row, env) is None
        env.close()


def test_the_recipe_is_the_measured_command():
    # docs/BENCHMARKS.md, "reasoning-gym: RL after the cold start": run rg-3's keys
    from agentgym.config import to_dict
    measured = ["env=reasoning_gym", "model=smollm2-135m", "reasoning_gym.tasks=basic_arithmetic",
                "reasoning_gym.tool=code", "reasoning_gym.reward=solved",
                "reasoning_gym.config={min_terms: 2, max_terms: 3, min_digits: 2, max_digits: 3}",
                "reasoning_gym.size=2000", "reasoning_gym.eval_size=200",
                "trainer.eval_limit=200", "trainer.total_steps=10", "trainer.prompts_per_step=8",
                "rollout.n=8", "trainer.lr=2e-5", "trainer.cold_start_demos=64", "sft.epochs=1",
                "rollout.max_turns=2", "rollout.max_tokens_per_turn=64"]
    by_hand = to_dict(build_config(parse_overrides(measured)))
    assert to_dict(build_config(parse_overrides(["recipe=reasoning_gym_cpu"]))) == \
        {**by_hand, "recipe": "reasoning_gym_cpu"}
