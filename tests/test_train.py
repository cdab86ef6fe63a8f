"""Training end to end: the CLI on the search env, and a learning test on a toy env."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentgym.cli import main
from agentgym.config import build_config
from agentgym.data.rows import write_jsonl
from toy_envs import letter_rows
from agentgym.trainers.loop import train



def test_cli_train_two_steps_leaves_checkpoint_metrics_and_png(tmp_path, retriever_url, capsys):
    run = tmp_path / "run"
    # an entropy bonus keeps the update running: with the untrained model's all-zero
    # rewards it would be skipped, and with it the drift measurement checked below
    rc = main(["train", "env=search", "model=tiny", "trainer.total_steps=2",
               "trainer.prompts_per_step=2", "n=2", "rollout.max_tokens_per_turn=24",
               "rollout.max_response_tokens=256", "trainer.eval_limit=2",
               "algo.entropy_coef=0.001", "trainer.cold_start=off",
               f"retriever.url={retriever_url}", f"run_dir={run}"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "step    1 | reward" in out and "step    2 | reward" in out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert steps[1]["rollout/policy_version"] == 1.0  # step 2 sampled the synced weights
    assert steps[0]["rollout/drift_max"] < 1e-3
    assert (run / "reward_curve.png").stat().st_size > 1000
    assert list((run / "tensorboard").iterdir())
    assert json.loads((run / "config.json").read_text())["trainer"]["total_steps"] == 2
    ckpt = run / "checkpoints" / "step_2"
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape[-1] >= 1


def test_the_curve_is_drawn_at_the_first_step_then_at_most_every_plot_every_s_and_at_close(
        tmp_path):
    """A redraw costs as much as a small model's update: within plot_every_s the PNG keeps
    the first step's curve, and close() draws every step logged since."""
    from agentgym.reporting.metrics import MetricsLogger
    log = MetricsLogger(tmp_path / "hourly", plot_every_s=3600)
    log.log(1, {"rollout/reward": 0.5})
    first = log.png.read_bytes()
    log.log(2, {"rollout/reward": 0.25})
    log.log(3, {"rollout/reward": 0.75})
    assert log.png.read_bytes() == first  # not redrawn within the hour
    log.close()
    assert log.png.read_bytes() != first  # the last two steps drawn at the end
    every = MetricsLogger(tmp_path / "every", plot_every_s=0)
    every.log(1, {"rollout/reward": 0.5})
    one = every.png.read_bytes()
    every.log(2, {"rollout/reward": 0.25})
    assert every.png.read_bytes() != one  # redrawn at each step
    drawn = every.png.stat().st_mtime_ns
    every.close()
    assert every.png.stat().st_mtime_ns == drawn  # nothing new to draw at the end


def test_a_curve_draw_cut_short_is_drawn_again_at_close(tmp_path, monkeypatch):
    """A Ctrl-C inside a redraw (a fault injected into the PNG's write) leaves the steps
    undrawn, so close() draws them."""
    from matplotlib.figure import Figure

    from agentgym.reporting.metrics import MetricsLogger
    log = MetricsLogger(tmp_path / "run", plot_every_s=3600)
    real = Figure.savefig

    def interrupted_write_fault(self, *a, **k):
        monkeypatch.setattr(Figure, "savefig", real)  # once
        raise KeyboardInterrupt
    monkeypatch.setattr(Figure, "savefig", interrupted_write_fault)
    with pytest.raises(KeyboardInterrupt):
        log.log(1, {"rollout/reward": 0.5})
    assert not log.png.exists()
    log.close()
    assert log.png.stat().st_size > 0


def test_a_step_0_eval_that_fails_closes_the_metrics_log(tmp_path, retriever_url, monkeypatch):
    """A set-up that fails after the session's parts exist (a fault injected into the
    step-0 eval) raises its own error and closes them: the metrics log's TensorBoard
    writer leaves no thread behind in the calling process (a notebook or a sweep)."""
    import threading

    from agentgym.trainers.session import Session

    def eval_fault(self, step):
        raise RuntimeError("eval_fault: the step-0 eval failed")
    monkeypatch.setattr(Session, "evaluate", eval_fault)
    before = set(threading.enumerate())
    cfg = build_config({"env": "search", "model": "tiny", "trainer.total_steps": 1,
                        "trainer.prompts_per_step": 2, "rollout.n": 2,
                        "rollout.max_tokens_per_turn": 8, "trainer.eval_limit": 2,
                        "trainer.cold_start": "off", "retriever.url": retriever_url,
                        "run_dir": str(tmp_path / "run")})
    with pytest.raises(RuntimeError, match="eval_fault"):
        train(cfg)
    left = [t.name for t in set(threading.enumerate()) - before
            if type(t).__name__ == "_AsyncWriterThread"]
    assert not left, f"TensorBoard writer threads left running: {left}"
    heartbeat = json.loads((tmp_path / "run" / "heartbeat.json").read_text())
    assert heartbeat["state"] == "failed"


def _weights(path):
    from safetensors.torch import load_file
    return load_file(str(path / "model.safetensors"))


def test_resume_matches_an_uninterrupted_run(tmp_path):
    data = tmp_path / "toy.jsonl"
    write_jsonl(data, letter_rows(8))
    base = {"env": "agentgym-test/Letter-v0", "model": "tiny", "data": str(data),
            "trainer.prompts_per_step": 2, "rollout.n": 2, "rollout.max_tokens_per_turn": 4,
            "trainer.eval_limit": 0, "trainer.save_every": 1, "trainer.lr": 1e-3}
    straight = train(build_config({**base, "trainer.total_steps": 3,
                                   "run_dir": str(tmp_path / "a")}))
    resumed_dir = tmp_path / "b"
    train(build_config({**base, "trainer.total_steps": 1, "run_dir": str(resumed_dir)}))
    # A killed save leaves a .tmp folder behind; resume must ignore it.
    (resumed_dir / "checkpoints" / "step_7.tmp").mkdir()
    train(build_config({**base, "trainer.total_steps": 3, "run_dir": str(resumed_dir)}))
    rows = [json.loads(x) for x in (resumed_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["rollout/policy_version"] == 1.0 and rows[2]["rollout/policy_version"] == 2.0
    a, b = _weights(straight / "checkpoints" / "step_3"), _weights(resumed_dir / "checkpoints" / "step_3")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k
    first = _weights(straight / "checkpoints" / "step_1")
    assert any(not torch.equal(first[k], a[k]) for k in a)  # training moved the weights


def test_grpo_learns_toy_env(tmp_path):
    data = tmp_path / "toy.jsonl"
    write_jsonl(data, letter_rows(64))
    cfg = build_config({"env": "agentgym-test/Letter-v0", "model": "tiny", "data": str(data),
                        "trainer.total_steps": 30, "trainer.prompts_per_step": 4,
                        "rollout.n": 8, "rollout.max_tokens_per_turn": 8,
                        "trainer.lr": 1e-2, "trainer.eval_limit": 0, "trainer.save_every": 100,
                        "trainer.seed": 0, "run_dir": str(tmp_path / "run")})
    run = train(cfg)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["rollout/reward"] for r in rows if "rollout/reward" in r]
    start, end = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    # Measured: about 0.11 at the start (random init), about 0.5 after 20 steps.
    assert end > start + 0.25 and end > 2 * start, (start, end)


def test_a_mixed_run_of_two_envs(tmp_path, retriever_url):
    """``env=[search,code]``: rows of both envs mixed by ``data.mix``, each group one env,
    metrics and the held-out eval env by env."""
    import json

    from agentgym.cli import main
    from agentgym.config import build_config
    from agentgym.core.overrides import parse_overrides
    from agentgym.data.rows import heldout_rows, training_rows
    overrides = ["env=[search,code]", "data.mix=[3,1]", "limit=40", "trainer.eval_limit=2"]
    cfg = build_config(parse_overrides(overrides))
    rows = training_rows(cfg).rows
    counts = {e: sum(r["env"] == e for r in rows) for e in ("search", "code")}
    assert counts == {"search": 60, "code": 20}  # 80 rows in the share 3:1
    held = heldout_rows(cfg).rows
    assert [r["env"] for r in held] == ["search", "search", "code", "code"]
    assert held[2]["data_source"] != held[0]["data_source"]  # code's own held-out set
    run = tmp_path / "mixed"
    assert main(["train", "env=[search,code]", "model=tiny", f"run_dir={run}",
                 "trainer.total_steps=2", "trainer.prompts_per_step=4", "n=2", "limit=8",
                 "trainer.eval_limit=[2,3]", f"retriever.url={retriever_url}",
                 "rollout.max_tokens_per_turn=[8,4]", "rollout.max_turns=[2,1]",
                 "trainer.cold_start=off"]) == 0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "rollout/reward" in m]
    assert len(steps) == 2
    seen = {k.split("/")[0] for m in steps for k in m if k.endswith("/rollout/reward")}
    assert seen == {"search", "code"}
    for m in steps:  # every trajectory counted under its env
        envs_in_step = [e for e in ("search", "code") if f"{e}/rollout/count" in m]
        assert envs_in_step and m["rollout/count"] == 8
        assert sum(m[f"{e}/rollout/count"] for e in envs_in_step) == 8
    # budgets per env (rollout.max_turns=[2,1], rollout.max_tokens_per_turn=[8,4])
    code = [m for m in steps if "code/rollout/count" in m]
    assert code and all(m["code/rollout/turns"] == 1 and m["code/rollout/generated_tokens"] <= 4
                        for m in code)
    search = [m for m in steps if "search/rollout/count" in m]
    assert all(m["search/rollout/turns"] <= 2 and m["search/rollout/generated_tokens"] <= 16
               for m in search)
    assert max(m["search/rollout/generated_tokens"] for m in search) > 4  # more than code's
    evals = [m for m in metrics if "eval/em" in m]  # trainer.eval_limit=[2,3]
    assert evals and all(m["search/eval/count"] == 2 and m["code/eval/count"] == 3
                         for m in evals)
    config = json.loads((run / "config.json").read_text())
    assert config["env"] == "search,code"
    assert config["per_env"] == {"trainer.eval_limit": [2, 3], "rollout.max_turns": [2, 1],
                                 "rollout.max_tokens_per_turn": [8, 4]}
    assert config["rollout"]["max_turns"] == 2 and config["trainer"]["eval_limit"] == 3
