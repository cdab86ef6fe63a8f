"""Recipes (``recipes/*.yaml``, ``recipe=NAME``): a paper's or the demo's settings as the
command line's dotted keys, layered under the user's overrides."""

from __future__ import annotations

import json

import pytest

from agentgym.cli import main
from agentgym.config import all_keys, build_config, to_dict
from agentgym.core.overrides import parse_overrides
from agentgym.presets import load_recipe, recipe_names


@pytest.mark.parametrize("name", recipe_names())
def test_every_recipe_resolves_to_known_keys(name):
    keys = load_recipe(name)
    assert keys, f"recipes/{name}.yaml is empty"
    cfg = build_config(parse_overrides([f"recipe={name}"]), {"rollout.n": 5})
    known = set(all_keys(cfg)) | {"env", "model", "data", "algo"}
    assert set(keys) <= known
    assert cfg.recipe == name
    # YAML 1.1 reads off/no/yes as booleans; a text key must keep the word, as on the
    # command line ("trainer.cold_start: off" resolved to "False", a model folder's name)
    flat = to_dict(cfg)
    texts = [f"{section}.{k}" for section, d in flat.items() if isinstance(d, dict)
             for k, v in d.items() if v in ("True", "False")]
    assert texts == []


def test_yes_no_on_off_stay_words_in_a_recipe_as_on_the_command_line(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer.cold_start: off\nengine.prefix_cache: off\n"
                      "trainer.log_samples: 3\n")
    cfg = build_config(parse_overrides([f"recipe={recipe}"]))
    given = build_config(parse_overrides(["trainer.cold_start=off", "engine.prefix_cache=off"]))
    assert cfg.trainer.cold_start == given.trainer.cold_start == "off"
    assert cfg.engine.prefix_cache is given.engine.prefix_cache is False


def test_the_demo_recipe_is_the_measured_command_and_later_keys_win():
    # make demo runs recipe=cpu_demo: the keys measured in docs/BENCHMARKS.md, "make demo"
    measured = ["env=[search,code]", "data=[multihop_curriculum,arith]", "trainer.eval_data=[nq,arith_test]",
                "data.mix=[1,7]", "data.curriculum=solve_rate", "trainer.total_steps=5",
                "trainer.prompts_per_step=8", "n=4", "trainer.lr=2e-5", "search.reward=f1",
                "rollout.max_turns=[3,2]", "rollout.max_tokens_per_turn=[96,64]",
                "trainer.cold_start_probe=4", "trainer.cold_start_demos=[64,32]",
                "trainer.cold_start_lr=[2e-4,5e-5]", "sft.epochs=1", "trainer.eval_limit=[20,60]"]
    by_hand = to_dict(build_config(parse_overrides(measured), {"rollout.n": 5}))
    by_recipe = to_dict(build_config(parse_overrides(["recipe=cpu_demo"]), {"rollout.n": 5}))
    assert by_recipe == {**by_hand, "recipe": "cpu_demo"}
    # the user's keys come after the recipe's, the command's defaults before
    cfg = build_config(parse_overrides(["recipe=cpu_demo", "n=8", "trainer.eval_limit=[5,5]"]),
                       {"rollout.n": 5})
    assert cfg.rollout.n == 8 and cfg.per_env["trainer.eval_limit"] == [5, 5]
    assert cfg.trainer.lr == 2e-5  # the recipe's, over the default 1e-6


def test_eval_stays_greedy_under_a_recipe(tmp_path):
    recipe = tmp_path / "hot.yaml"
    recipe.write_text("env: search\nrollout.temperature: 1.0\nrollout.n: 5\n")
    out = tmp_path / "eval.json"
    assert main(["eval", f"recipe={recipe}", "model=tiny", "limit=1", f"out={out}",
                 "rollout.max_tokens_per_turn=4", "rollout.max_turns=1"]) == 0
    result = json.loads(out.read_text())
    assert result["temperature"] == 0.0 and result["n"] == 1


def test_bad_recipes_fail_clearly(tmp_path, capsys):
    assert main(["config", "recipe=cpu_dem"]) == 2
    assert "recipe='cpu_dem': no such recipe (did you mean 'cpu_demo'?)" in \
        capsys.readouterr().err
    nested = tmp_path / "nested.yaml"
    nested.write_text("rollout:\n  n: 5\n")
    with pytest.raises(ValueError, match="mapping of dotted keys.*nested section"):
        load_recipe(str(nested))
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("rollout.temperatur: 0.5\n")
    with pytest.raises(KeyError, match="did you mean 'rollout.temperature'"):
        build_config(parse_overrides([f"recipe={unknown}"]))


def test_config_prints_the_resolved_recipe(capsys):
    assert main(["config", "recipe=cpu_demo", "trainer.total_steps=2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["recipe"] == "cpu_demo" and printed["env"] == "search,code"
    assert printed["trainer"]["total_steps"] == 2
    assert printed["per_env"]["trainer.cold_start_demos"] == [64, 32]


#: what makes a recipe's step fit a test on the CPU; everything else (the algorithm, its
#: loss, clip ranges, KL, entropy, learning rate and schedule, turn limits' meaning,
#: protocol, checkpointing) stays the recipe's
SHRINK = ["trainer.total_steps=1", "trainer.prompts_per_step=2", "trainer.mini_batches=1",
          "trainer.nprocs=1", "trainer.offload=false", "trainer.backend=single",
          "trainer.device=cpu", "trainer.eval_limit=0", "trainer.cold_start=off",
          "trainer.save_every=1", "limit=4", "rollout.max_tokens_per_turn=8",
          "rollout.max_response_tokens=512", "rollout.max_turns=2"]


@pytest.mark.parametrize("name", recipe_names())
def test_one_step_of_each_recipe_on_its_shrunk_architecture(tmp_path, name, retriever_url):
    """The recipe's own keys, its model's family at tiny size (model=tiny:SHAPE), a batch
    small enough for the CPU, and a scripted reward (a random model's answers are all
    wrong, which would leave the update nothing to do): one step updates with the recipe's
    loss and writes a checkpoint."""
    recipe = load_recipe(name)
    shape = recipe["model"]
    group = 1 if recipe.get("algo") == "ppo" else 2
    run = tmp_path / "run"
    # a teacher (on-policy distillation) at tiny size of its own shape, as the student is
    teacher = [f"trainer.teacher=tiny:{recipe['trainer.teacher']}"] \
        if recipe.get("trainer.teacher") else []
    assert main(["train", f"recipe={name}", f"model=tiny:{shape}", f"rollout.n={group}",
                 f"run_dir={run}", f"retriever.url={retriever_url}", *teacher,
                 "reward=fakes:scripted_length_reward", *SHRINK]) == 0
    config = json.loads((run / "config.json").read_text())
    assert config["recipe"] == name and config["algo"]["name"] == recipe.get("algo", "grpo")
    for key in ("algo.kl_coef", "algo.clip_high", "algo.entropy_coef", "trainer.lr"):
        section, field = key.split(".")
        if key in recipe:
            assert config[section][field] == pytest.approx(recipe[key]), key
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    update = [m for m in steps if m.get("step") == 1 and "train/loss" in m]
    assert update and update[0]["train/skipped_steps"] == 0
    assert update[0]["train/grad_norm"] > 0 and update[0]["train/loss"] == update[0]["train/loss"]
    assert (run / "checkpoints" / "step_1" / "state.json").exists()
