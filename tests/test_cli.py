"""The agentgym CLI: rollout, eval, check-env, config errors (real model, real retriever)."""

from __future__ import annotations

import json

import pytest

from agentgym.cli import main


def test_rollout_writes_trajectories(tmp_path, retriever_url, capsys):
    out = tmp_path / "traj.jsonl"
    rc = main(["rollout", "env=search", "model=tiny", "n=2", "limit=2", f"out={out}",
               f"retriever.url={retriever_url}", "rollout.max_tokens_per_turn=32"])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4
    for r in rows:
        assert len(r["token_ids"]) == len(r["loss_mask"]) == len(r["logprobs"])
        assert isinstance(r["text"], str) and isinstance(r["reward"], float)
        assert r["terminated"] or r["truncated"]
    assert "traj/s" in capsys.readouterr().out


def test_eval_prints_em_and_format_validity(tmp_path, retriever_url, capsys):
    out, samples = tmp_path / "eval.json", tmp_path / "episodes.jsonl"
    rc = main(["eval", "env=search", "model=tiny", "data=nq", "limit=3", f"out={out}",
               f"samples={samples}", f"retriever.url={retriever_url}",
               "rollout.max_tokens_per_turn=16"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "EM" in printed and "format-valid" in printed
    result = json.loads(out.read_text())
    # samples=: each episode as `agentgym rollout` writes it, the same ones the result counts
    written = [json.loads(line) for line in samples.read_text().splitlines()]
    assert {r["uid"]: r["reward"] for r in written} == \
        {e["uid"]: e["reward"] for e in result["episodes"]}
    assert all(isinstance(r["text"], str) and len(r["tokens"]) == len(r["token_ids"])
               for r in written)
    assert result["n"] == 3 and 0.0 <= result["em"] <= 1.0 and result["temperature"] == 0.0
    lo, hi = result["em_ci95"]
    assert 0.0 <= lo <= result["em"] <= hi <= 1.0
    # one outcome per question, keyed by the row's id, for `agentgym compare`
    episodes = result["episodes"]
    assert len({e["uid"] for e in episodes}) == 3
    assert sum(e["em"] for e in episodes) / 3 == pytest.approx(result["em"])
    assert sum(e["format_valid"] for e in episodes) / 3 == pytest.approx(result["format_valid"])
    assert all(e["answer_seen"] in (0, 1) for e in episodes)  # search: in results?
    # searches per episode (bench/rl_gain.py: how many make a second hop)
    assert sum(e["tool_calls"] for e in episodes) / 3 == pytest.approx(result["mean_tool_calls"])
    assert main(["compare", str(out), str(out)]) == 0  # a model against itself: no change
    assert "gained 0, lost 0; exact McNemar p = 1" in capsys.readouterr().out


def test_check_env_passes_every_registered_env(capsys):
    assert main(["check-env"]) == 0
    assert "ok    agentgym/Search-v0" in capsys.readouterr().out


def test_unknown_key_fails_with_did_you_mean(capsys):
    assert main(["rollout", "env=search", "rollout.temperatur=0.5"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'rollout.temperatur'" in err and "rollout.temperature" in err


def test_unknown_env_and_dataset_fail_clearly(capsys):
    assert main(["eval", "env=serch", "model=tiny"]) == 2
    assert "did you mean 'search'" in capsys.readouterr().err
    assert main(["eval", "env=search", "model=tiny", "data=nqq"]) == 2
    assert "did you mean 'nq'" in capsys.readouterr().err


def test_a_mixed_run_takes_budgets_per_env_and_checks_their_count(capsys):
    from agentgym.config import build_config
    from agentgym.core.overrides import parse_overrides
    from agentgym.rollout.runtime import sub_config
    cfg = build_config(parse_overrides([
        "env=[search,code]", "rollout.max_turns=[3,2]", "rollout.max_tokens_per_turn=[128,64]",
        "trainer.cold_start_demos=[8,32]", "trainer.eval_limit=[20,60]"]))
    # the shared keys hold the largest (the trainer's sequence budgets must fit both envs)
    assert (cfg.rollout.max_turns, cfg.rollout.max_tokens_per_turn) == (3, 128)
    assert (cfg.trainer.cold_start_demos, cfg.trainer.eval_limit) == (32, 60)
    search, code = sub_config(cfg, "search"), sub_config(cfg, "code")
    assert (search.rollout.max_turns, search.rollout.max_tokens_per_turn,
            search.trainer.cold_start_demos, search.trainer.eval_limit) == (3, 128, 8, 20)
    assert (code.rollout.max_turns, code.rollout.max_tokens_per_turn,
            code.trainer.cold_start_demos, code.trainer.eval_limit) == (2, 64, 32, 60)
    assert search.per_env == {} and code.per_env == {}
    # a later single value replaces the list
    again = build_config(parse_overrides(["env=[search,code]", "rollout.max_turns=[3,2]",
                                          "rollout.max_turns=4"]))
    assert again.per_env == {} and again.rollout.max_turns == 4
    assert main(["train", "env=search", "rollout.max_turns=[3,2]"]) == 2
    assert "gives 2 values for the 1 env(s) of env=search" in capsys.readouterr().err
    assert main(["train", "env=[search,code]", "rollout.max_turns=[3,2,1]"]) == 2
    assert "gives 3 values for the 2 env(s)" in capsys.readouterr().err
    assert main(["train", "env=[search,code]", "rollout.max_turns=[3,many]"]) == 2
    assert "rollout.max_turns='many' is not a valid int" in capsys.readouterr().err


def test_wilson_interval():
    from agentgym.reporting.stats import wilson_ci95
    lo, hi = wilson_ci95(0.0, 200)
    assert lo == 0.0 and 0.018 < hi < 0.020
    lo, hi = wilson_ci95(0.5, 100)
    assert abs(lo - 0.404) < 0.002 and abs(hi - 0.596) < 0.002


def test_eval_defaults_to_the_envs_held_out_set(tmp_path, capsys):
    out = tmp_path / "eval.json"
    rc = main(["eval", "env=code", "model=tiny", "limit=1", f"out={out}",
               "rollout.max_tokens_per_turn=8", "rollout.max_turns=1"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["data"] == "gsm8k" and result["n"] == 1
    assert "code / " in capsys.readouterr().out


def test_the_train_table_prints_the_paired_p_value_of_rl_against_sft(tmp_path, capsys):
    """The after-RL row's p-value is the exact McNemar test of the per-question outcomes
    the run wrote (eval/step_N.json), not of the two rates."""
    from agentgym.cli import _print_comparison
    from agentgym.config import build_config
    from agentgym.reporting.stats import exact_binomial_two_sided
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    # 40 questions: 10 right at both steps, 12 gained, 2 lost, 16 wrong at both
    before = [True] * 10 + [False] * 12 + [True] * 2 + [False] * 16
    after = [True] * 10 + [True] * 12 + [False] * 2 + [False] * 16
    for step, outcomes in ((0, before), (6, after)):
        (run / "eval" / f"step_{step}.json").write_text(json.dumps(
            {f"q{i}": {"em": ok, "format_valid": True, "env": "code"}
             for i, ok in enumerate(outcomes)}))
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "eval/count": 40.0, "eval/format_valid": 1.0,
                    "eval/em": sum(o) / 40, "eval/tool_calls": 1.0 + s / 4}) + "\n"
        for s, o in ((0, before), (6, after))))
    _print_comparison(run, build_config({"env": "code", "trainer.eval_data": "arith_test"}))
    out = capsys.readouterr().out
    rl_row = next(line for line in out.splitlines() if "after RL (step 6)" in line)
    p = exact_binomial_two_sided(12, 14)
    assert p < 0.05 and f"{p:.3g} (+12/-2)" in rl_row
    assert "0.300 [" in out and "0.550 [" in rl_row  # the two EMs, 12/40 and 22/40
    # each row's tool calls per episode (the env's word for them: searches for env=search)
    assert "tool calls/episode" in out and " 2.50 " in rl_row


def test_config_shows_what_train_resolves(capsys):
    """``agentgym config`` prints train's config: its group size 5 unless told (algo=ppo's
    preset: 1)."""
    for args, n in ([], 5), (["n=3"], 3), (["algo=ppo"], 1):
        assert main(["config", "env=search", *args]) == 0
        assert json.loads(capsys.readouterr().out)["rollout"]["n"] == n, args


def test_a_hub_id_is_refused_when_the_config_is_read(capsys):
    """``model=Qwen/…`` is refused before anything loads, saying what to pass instead."""
    assert main(["config", "env=search", "model=Qwen/Qwen2.5-3B-Instruct"]) == 2
    err = capsys.readouterr().err
    assert "model.name='Qwen/Qwen2.5-3B-Instruct'" in err and "downloads nothing" in err
    assert "model=~/models/Qwen2.5-3B-Instruct" in err


def test_ctrl_c_ends_train_with_a_line_not_a_traceback_and_status_says_interrupted(tmp_path):
    """Ctrl-C (SIGINT) in the middle of a step: exit 130, one line that says how to go on,
    and the heartbeat's state "interrupted" (what `agentgym status` shows)."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from conftest import wait_until
    root = Path(__file__).resolve().parents[1]
    run = tmp_path / "run"
    # as from a terminal: Python installs its Ctrl-C handler only where SIGINT is not ignored
    code = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from agentgym.cli import main; sys.exit(main(sys.argv[1:]))")
    err = tmp_path / "stderr.log"
    with open(err, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, "train", "env=search", "model=tiny", f"run_dir={run}",
             "trainer.cold_start=off", "trainer.eval_limit=0", "trainer.total_steps=1000",
             "n=2", "trainer.prompts_per_step=2"],
            cwd=root, stdout=subprocess.DEVNULL, stderr=f,
            env={**os.environ, "PYTHONPATH": str(root)})
    try:
        def stepping() -> bool:
            assert proc.poll() is None, err.read_text()[-3000:]
            metrics = run / "metrics.jsonl"  # opened at set-up, a line once a step is done
            return metrics.is_file() and bool(metrics.read_text().strip())
        wait_until(stepping, 600, "the first step")
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    said = err.read_text()
    assert proc.returncode == 130, said[-3000:]
    assert "agentgym train: interrupted (trainer.resume=auto" in said
    assert "Traceback" not in said
    beat = json.loads((run / "heartbeat.json").read_text())
    assert beat["state"] == "interrupted"


def test_ctrl_c_during_the_run_s_set_up_leaves_the_heartbeat_interrupted(tmp_path, monkeypatch,
                                                                        capsys):
    """A Ctrl-C after the watchdog started but before the first step (here: while the
    metrics log opens, a fault injected) ends the watch as "interrupted", not "running"."""
    from agentgym.trainers import session

    def interrupted_while_opening_fault(*_a, **_k):
        raise KeyboardInterrupt
    monkeypatch.setattr(session, "MetricsLogger", interrupted_while_opening_fault)
    run = tmp_path / "run"
    assert main(["train", "env=search", "model=tiny", f"run_dir={run}", "trainer.cold_start=off",
                 "trainer.eval_limit=0", "trainer.total_steps=1", "n=2",
                 "trainer.prompts_per_step=2"]) == 130
    assert "agentgym train: interrupted" in capsys.readouterr().err
    assert json.loads((run / "heartbeat.json").read_text())["state"] == "interrupted"


def test_ctrl_c_whose_closing_fails_too_is_still_an_interrupt_and_closes_the_rest(
        tmp_path, monkeypatch, capsys):
    """A Ctrl-C inside the first step's curve draw, and the draw at close failing as well
    (as when the Ctrl-C lands inside matplotlib's first import; faults injected): still exit
    130 with the one line, the heartbeat "interrupted", and the backend closed after the
    metrics log failed to."""
    from agentgym.reporting.metrics import MetricsLogger
    from agentgym.trainers.backends.single import SingleBackend
    draws, closed = [], []

    def interrupted_then_broken_draw_fault(self):
        draws.append(len(draws))
        if len(draws) == 1:
            raise KeyboardInterrupt
        raise AttributeError("module 'matplotlib' has no attribute 'get_data_path'")
    monkeypatch.setattr(MetricsLogger, "plot", interrupted_then_broken_draw_fault)
    monkeypatch.setattr(SingleBackend, "close", lambda self: closed.append(self))
    run = tmp_path / "run"
    assert main(["train", "env=search", "model=tiny", f"run_dir={run}", "trainer.cold_start=off",
                 "trainer.eval_limit=0", "trainer.total_steps=3", "n=2",
                 "trainer.prompts_per_step=2"]) == 130
    said = capsys.readouterr().err
    assert "agentgym train: interrupted (trainer.resume=auto" in said
    assert "Traceback" not in said
    assert draws == [0, 1] and len(closed) == 1
    assert json.loads((run / "heartbeat.json").read_text())["state"] == "interrupted"
