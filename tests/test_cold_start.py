"""The cold start inside ``agentgym train`` (trainers/cold_start/) and the training data
that can reward (answerable questions, the F1 reward, the signal metric).

The decision tests script the probe's model output (a ScriptedEngine: protocol-following
answers, or text with no action tags); the SFT, the post-SFT probe and the RL steps run
the real tiny model against the real local retriever.
"""

from __future__ import annotations

import json
import random

import pytest

from agentgym.config import build_config
from agentgym.data.rows import load_rows, training_rows
from fakes import ScriptedEngine

# budgets a demonstration fits (its first action is about 40 tiny-tokenizer tokens); one
# passage per search keeps the sequences short
FAST = {"env": "search", "model.name": "tiny", "rollout.max_tokens_per_turn": 96,
        "rollout.max_response_tokens": 1024, "rollout.max_turns": 3, "retriever.topk": 1,
        "sft.epochs": 1, "sft.batch_size": 2, "trainer.cold_start_probe": 2,
        "trainer.cold_start_demos": 4, "trainer.eval_limit": 0}


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    """A cold-start cache of this test's own (the tiny model is passed by path, so it is
    not rebuilt there)."""
    monkeypatch.setenv("AGENTGYM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _cfg(tmp_path, tiny_path, retriever_url, name="run", **over):
    return build_config({**FAST, "model.path": str(tiny_path),
                         "retriever.url": retriever_url, "run_dir": str(tmp_path / name),
                         **over})


def _scripted(tiny_tokenizer, text, episodes=2, turns=3):
    return ScriptedEngine(tiny_tokenizer, [text] * (episodes * turns))


def test_auto_skips_the_cold_start_when_the_probe_follows_the_protocol(
        tmp_path, tiny_path, tiny_tokenizer, retriever_url, cache):
    from agentgym.trainers.cold_start import prepare
    cfg = _cfg(tmp_path, tiny_path, retriever_url)
    engine = _scripted(tiny_tokenizer, "<answer> Canberra </answer>")
    out = prepare(cfg, probe_engine=engine)
    assert out.model.path == str(tiny_path)
    record = json.loads((tmp_path / "run" / "cold_start" / "cold_start.json").read_text())
    assert record["decision"] == "skipped" and record["model"] is None
    assert record["probe_before"]["format_valid"] == 1.0 and record["probe_before"]["count"] == 2
    assert not (tmp_path / "run" / "cold_start" / "metrics.jsonl").exists()
    assert len(engine.produced) == 2  # each probe episode answered at once


def test_auto_runs_below_the_threshold_and_a_second_run_reuses_the_cache(
        tmp_path, tiny_path, tiny_tokenizer, retriever_url, cache):
    from agentgym.trainers.cold_start import prepare
    cfg = _cfg(tmp_path, tiny_path, retriever_url, "first")
    out = prepare(cfg, probe_engine=_scripted(tiny_tokenizer, "I do not know the tags."))
    stage = tmp_path / "first" / "cold_start"
    record = json.loads((stage / "cold_start.json").read_text())
    assert record["decision"] == "ran"
    assert record["probe_before"]["format_valid"] == 0.0
    assert record["demos"] == 4 and record["rows_looked_at"] >= 4
    assert len((stage / "demos.jsonl").read_text().splitlines()) == 4
    # the SFT stage's own metrics and loss curve in the run directory
    losses = [json.loads(line)["train/loss"] for line in
              (stage / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 == record["sft"]["steps"]  # 4 demos, batch 2, 1 epoch
    assert (stage / "loss_curve.png").stat().st_size > 1000
    model = cache / "cold_start" / record["cache"].rsplit("/", 1)[-1] / "model"
    assert out.model.path == str(model) == record["model"]
    assert (model / "config.json").is_file() and (model / "model.safetensors").is_file()
    assert not (model / "trainer_state.pt").exists()  # the model only, no optimizer state
    assert "probe_after" in record and record["probe_after"]["count"] == 2
    assert out.run_dir == str(tmp_path / "first")

    # same inputs: the SFT is not run again
    again = prepare(_cfg(tmp_path, tiny_path, retriever_url, "second"),
                    probe_engine=_scripted(tiny_tokenizer, "Still no tags."))
    second = json.loads((tmp_path / "second" / "cold_start" / "cold_start.json").read_text())
    assert second["decision"] == "reused" and again.model.path == str(model)
    assert not (tmp_path / "second" / "cold_start" / "metrics.jsonl").exists()
    # ... and its loss curve is the cached SFT's, so a rerun's cold_start/ still shows it
    assert (tmp_path / "second" / "cold_start" / "loss_curve.png").read_bytes() == \
        (stage / "loss_curve.png").read_bytes()

    # another SFT setting is another key: it runs again
    other = prepare(_cfg(tmp_path, tiny_path, retriever_url, "third",
                         **{"trainer.cold_start_lr": 2e-4}),
                    probe_engine=_scripted(tiny_tokenizer, "No tags."))
    assert other.model.path != str(model)
    third = json.loads((tmp_path / "third" / "cold_start" / "cold_start.json").read_text())
    assert third["decision"] == "ran"


def test_off_and_path_are_honoured(tmp_path, tiny_path, retriever_url, cache):
    from agentgym.trainers.cold_start import prepare
    cfg = _cfg(tmp_path, tiny_path, retriever_url, **{"trainer.cold_start": "off"})
    assert prepare(cfg) is cfg  # nothing probed, nothing written
    assert not (tmp_path / "run").exists()
    given = _cfg(tmp_path, tiny_path, retriever_url,
                 **{"trainer.cold_start": str(tiny_path), "model.path": ""})
    assert prepare(given).model.path == str(tiny_path)
    # a run folder: its newest complete checkpoint (the README's SFT -> RL commands)
    import shutil
    run = tmp_path / "sft"
    for step, complete in ((1, True), (2, True), (3, False)):
        ckpt = shutil.copytree(tiny_path, run / "checkpoints" / f"step_{step}")
        if complete:
            (ckpt / "state.json").write_text('{"step": %d}' % step)
    from_run = _cfg(tmp_path, tiny_path, retriever_url,
                    **{"trainer.cold_start": str(run), "model.path": ""})
    assert prepare(from_run).model.path == str(run / "checkpoints" / "step_2")
    bad = _cfg(tmp_path, tiny_path, retriever_url,
               **{"trainer.cold_start": str(tmp_path / "nowhere")})
    with pytest.raises(ValueError, match="nowhere.*neither a Hugging Face model folder.*"
                                         "or a run folder.*or auto, or off"):
        prepare(bad)


def test_env_without_a_builder_starts_rl_as_is(tmp_path, tiny_path, cache):
    from agentgym.trainers.cold_start import prepare
    cfg = build_config({"env": "agentgym-test/Letter-v0", "model.path": str(tiny_path),
                        "run_dir": str(tmp_path / "run")})
    assert prepare(cfg).model.path == str(tiny_path)


def test_cli_train_runs_the_cold_start_then_rl(tmp_path, tiny_path, retriever_url, cache,
                                                capsys):
    """The real tiny model (no scripting): its probe is format-invalid, so `agentgym train`
    builds demonstrations, runs SFT, and trains RL from the SFT model."""
    from agentgym.cli import main
    run = tmp_path / "run"
    args = [f"{k}={v}" for k, v in FAST.items()] + [
        f"model.path={tiny_path}", f"retriever.url={retriever_url}", "trainer.total_steps=1",
        "trainer.prompts_per_step=2", "n=2", "trainer.eval_limit=2"]
    assert main(["train", *args, f"run_dir={run}"]) == 0
    out = capsys.readouterr().out
    assert "cold start: probing" in out and "building 4 demonstrations, then SFT" in out
    # the held-out "before" eval plays in the probe's batch, not in an engine of its own
    assert "with its eval on 2 held-out questions (nq)" in out
    assert "cold start: evaluating tiny" not in out
    # RL's step-0 eval measures the SFT model: no probe after the SFT
    assert "RL's step-0 eval measures the result" in out and "step    1 | reward" in out
    assert "cold start: format-valid 0.00 ->" not in out
    # the held-out comparison: the base model, the SFT model (RL step 0), after RL
    assert "held-out: 2 questions of nq" in out
    for label in ("before (tiny)", "after SFT (RL step 0)", "after RL (step 1)"):
        assert label in out
    record = json.loads((run / "cold_start" / "cold_start.json").read_text())
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["path"] == record["model"]  # RL started from the SFT model
    assert record["eval_before"]["count"] == 2 and record["probe_before"]["count"] == 2
    assert (run / "checkpoints" / "step_1" / "model.safetensors").is_file()
    # the probe result is cached: a second run neither probes nor trains SFT again
    assert main(["train", *args, f"run_dir={tmp_path / 'again'}"]) == 0
    out = capsys.readouterr().out
    assert "probe of tiny read from the cache" in out
    assert "held-out eval of tiny read from the cache" in out
    assert "reusing the cached SFT model" in out and "RL's step-0 eval measures it" in out


# --- training data that can reward -------------------------------------------------------
def test_answerable_rows_hold_a_gold_answer_in_the_corpus():
    """The index's verdict against a brute-force scan of the whole corpus, on a sample."""
    from agentgym.envs.answerable import CorpusIndex, answerable
    from agentgym.core.paths import shipped_corpus
    from agentgym.envs.rewards import normalize_answer
    from agentgym.envs.search import gold_answers
    rows = random.Random(0).sample(load_rows("search", "train"), 40)
    index = CorpusIndex.from_file(shipped_corpus())
    text = "\n".join(index.passages)
    brute = [any(f" {normalize_answer(g)} " in text for g in gold_answers(r) if
                 normalize_answer(g)) for r in rows]
    assert answerable(rows, shipped_corpus()) == brute
    assert 0 < sum(brute) < len(rows)  # the sample has both kinds


def test_training_rows_keep_the_answerable_questions_with_the_shipped_corpus():
    on = training_rows(build_config({"env": "search"}))
    off = training_rows(build_config({"env": "search", "data.answerable_only": False}))
    assert on.total == off.total == len(off.rows) == 3000
    assert on.answerable == len(on.rows) and 0.4 * 3000 < len(on.rows) < 0.7 * 3000
    assert "have a gold answer in the corpus" in on.describe("train")
    # another corpus: the filter cannot know, so every row stays
    other = training_rows(build_config({"env": "search", "retriever.url": "http://x:1"}))
    assert other.answerable is None and len(other.rows) == 3000
    limited = training_rows(build_config({"env": "search", "limit": 7}))
    assert limited.rows == on.rows[:7]  # the first answerable ones


def test_heldout_rows_are_filtered_like_the_training_rows():
    from agentgym.envs.answerable import answerable
    from agentgym.data.rows import heldout_rows
    from agentgym.core.paths import shipped_corpus
    cfg = build_config({"env": "search", "trainer.eval_limit": 30})
    held = heldout_rows(cfg)
    nq = load_rows("search", cfg.trainer.eval_data)
    expected = [r for r, ok in zip(nq, answerable(nq, shipped_corpus())) if ok][:30]
    assert held.rows == expected and held.total == len(nq) and held.answerable < len(nq)
    assert "30 held-out rows from nq" in held.describe("nq", "held-out")
    unfiltered = heldout_rows(build_config({"env": "search", "trainer.eval_limit": 30,
                                            "data.answerable_only": False}))
    assert unfiltered.rows == nq[:30] and unfiltered.answerable is None
    assert heldout_rows(build_config({"env": "search", "trainer.eval_limit": 0})).rows == []


def test_f1_reward_gives_partial_credit():
    from agentgym.envs.search import SearchEnv, search_row
    row = search_row("who painted the mona lisa", ["Leonardo da Vinci"])
    for reward, expected in (("em", 0.0), ("f1", 0.8)):
        env = SearchEnv(retriever=object(), reward=reward)
        env.reset(options={"row": row})
        _, r, terminated, _, info = env.step("<answer> da Vinci </answer>")
        assert terminated and info["em"] == 0.0 and r == pytest.approx(expected)
    with pytest.raises(ValueError, match="reward='bleu'; valid: em, f1"):
        SearchEnv(reward="bleu")


def test_signal_groups_is_the_share_of_groups_whose_rewards_differ():
    from agentgym.core.types import Trajectory
    from agentgym.trainers.collection import rollout_metrics
    rewards = {"a": [1.0, 0.0], "b": [0.0, 0.0], "c": [1.0, 1.0], "d": [0.5, 0.0]}
    trajs = [Trajectory(uid=uid, reward=r, terminated=True, metrics={"malformed_actions": 0})
             for uid, rs in rewards.items() for r in rs]
    assert rollout_metrics(trajs)["rollout/signal_groups"] == 0.5


def test_a_gold_answer_that_normalization_erases_is_not_matched_by_an_empty_answer():
    # SQuAD normalization turns "A+" (a blood type in the shipped training data) into "",
    # which an empty or article-only answer also becomes: no reward for saying nothing
    from agentgym.envs.rewards import exact_match, f1_score
    for empty in ("", "the", "A", " a "):
        assert exact_match(empty, ["A+", "AB+"]) == 0.0
        assert f1_score(empty, ["A+", "AB+"]) == 0.0
    assert exact_match("a+", ["A+", "AB+"]) == 1.0 and f1_score(" A+ ", ["A+"]) == 1.0
    assert exact_match("AB+", ["A+", "AB+"]) == 1.0
    # ordinary answers keep SQuAD normalization
    assert exact_match("The Beatles!", ["beatles"]) == 1.0
    assert f1_score("the Beatles band", ["Beatles"]) == pytest.approx(2 * 0.5 * 1 / 1.5)


def test_a_mixed_run_cold_starts_every_env_from_its_own_data(
        tmp_path, tiny_path, tiny_tokenizer, retriever_url, cache):
    """``env=[search,code] data=[train,arith]``: each env probed on its own training rows,
    demonstrations built by each env's builder, one SFT over all of them."""
    from agentgym.trainers.cold_start import prepare
    cfg = _cfg(tmp_path, tiny_path, retriever_url, env="search,code", **{
        "data.name": "train,arith", "trainer.eval_data": "nq,arith_test"})
    out = prepare(cfg, probe_engine=_scripted(tiny_tokenizer, "No tags here.", episodes=4))
    stage = tmp_path / "run" / "cold_start"
    record = json.loads((stage / "cold_start.json").read_text())
    assert record["decision"] == "ran" and out.model.path == record["model"]
    before = record["probe_before"]
    assert set(before["envs"]) == {"search", "code"} and before["count"] == 4
    assert all(p["format_valid"] == 0.0 and p["count"] == 2 for p in before["envs"].values())
    demos = [json.loads(line) for line in (stage / "demos.jsonl").read_text().splitlines()]
    assert [d["env"] for d in demos] == ["search"] * 4 + ["code"] * 4
    assert all(d["row"]["data_source"] == "arith" for d in demos[4:])  # data=[train,arith]
    assert set(record["probe_after"]["envs"]) == {"search", "code"}


def test_probe_and_eval_played_in_one_batch_are_told_apart_by_row(
        tmp_path, tiny_path, tiny_tokenizer, retriever_url):
    """``play``: row sets played in one batch give each set its own figures; two sets that
    share a row id (which tells trajectories apart) are played in turn instead."""
    from agentgym.trainers.cold_start.probe import play
    from agentgym.trainers.hooks import Hooks
    cfg = _cfg(tmp_path, tiny_path, retriever_url)
    train, held = load_rows("search", "train", 3), load_rows("search", "nq", 2)
    # every episode answers at once: format-valid
    engine = ScriptedEngine(tiny_tokenizer, ["<answer> Canberra </answer>"] * 10)
    a, b = play(cfg, tiny_path, [train, held], Hooks(), engine)
    assert (a["count"], b["count"]) == (3, 2) and a["format_valid"] == b["format_valid"] == 1.0
    engine = ScriptedEngine(tiny_tokenizer, ["<answer> Canberra </answer>"] * 10)
    a, b = play(cfg, tiny_path, [train, train[:2]], Hooks(), engine)  # shared ids
    assert (a["count"], b["count"]) == (3, 2)


def test_the_cache_key_holds_per_env_rates_only_when_given():
    """Per-env SFT rates change the SFT, so they key its cache; one rate keys it as before
    (the caches of runs without per-env rates stay valid)."""
    from agentgym.trainers.cold_start.sft_stage import sft_settings
    one = sft_settings(build_config({"env": "search,code"}))
    per = sft_settings(build_config({"env": "search,code",
                                      "trainer.cold_start_lr": [2e-4, 1e-4]}))
    assert "lr_by_env" not in one and one["lr"] == 1e-4
    assert per["lr_by_env"] == [2e-4, 1e-4] and per["lr"] == 2e-4


def test_the_probe_and_before_eval_keys_leave_out_the_sft_s_per_env_values():
    """A mixed run's per-env demonstration counts and SFT rates change the SFT, not what
    the base model plays: its probe and "before" eval stay cached across them; a per-env
    rollout budget plays differently and keys them."""
    from agentgym.trainers.cold_start.probe import play_inputs

    def played(**keys):
        cfg = build_config({"env": "search,code", **keys})
        return play_inputs({"model": "m", "per_env": cfg.per_env})
    base = played(**{"rollout.max_turns": [3, 2]})
    assert base == {"model": "m", "per_env": {"rollout.max_turns": [3, 2]}}
    assert played(**{"rollout.max_turns": [3, 2], "trainer.cold_start_demos": [32, 16],
                     "trainer.cold_start_lr": [2e-4, 5e-5], "trainer.eval_limit": [20, 60]}) == base
    assert played(**{"rollout.max_turns": [4, 2]}) != base
    assert played(**{"trainer.cold_start_demos": [32, 16]}) == {"model": "m"}


def test_the_cache_key_holds_the_demonstration_builders_source():
    """A change to how an env demonstrates (its builder's module) makes a new cache key, so
    the cold start builds new demonstrations rather than reusing those of the old code."""
    import inspect
    from pathlib import Path
    from agentgym import envs
    from agentgym.core.paths import file_digest
    from agentgym.trainers.cold_start.demos import builder
    for env in ("search", "swe"):
        cfg = build_config({"env": env})
        source = Path(inspect.getsourcefile(envs.env_manifest(env).demonstrate))
        assert builder(cfg, env)["builder_source"] == file_digest(source)
    assert Path(inspect.getsourcefile(envs.env_manifest("swe").demonstrate)).name == \
        "swe_demos.py"
