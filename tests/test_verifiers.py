"""``env=verifiers``: a verifiers (0.4) environment written with its own API
(tests/vf_envs/vf_calc: a taskset, an MCP tool, two weighted ``@vf.reward`` functions),
played by verifiers' own harness in verifiers' own Python (.venv-verifiers, built by
``make test``) against AgentGym's engine. The model's replies are scripted (a tool call,
then an answer; tests/fakes.py ``ScriptedCalcModel``), since random weights never call a
tool; verifiers, its harness program, its tool server and its rubric run for real."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from agentgym.config import build_config
from agentgym.envs.verifiers_env import DEFAULT_VENV, VerifiersConfig
from fakes import ScriptedCalcModel

VENV_PYTHON = Path(DEFAULT_VENV) / "bin" / "python"
pytestmark = pytest.mark.skipif(
    not VENV_PYTHON.exists(),
    reason=f"{DEFAULT_VENV} (verifiers 0.4's own environment) is built by `make test`")

ENV_KEYS = {"verifiers.env": "vf_calc", "verifiers.path": "tests/vf_envs",
            "verifiers.python": str(VENV_PYTHON)}


def vf_cfg(**keys):
    return build_config({"env": "verifiers", "model": "tiny", **ENV_KEYS, **keys})


@pytest.fixture(scope="module")
def scripted_calc_engine():
    from agentgym.rollout.engines.base import ENGINES
    if "scripted-calc-model" not in ENGINES.names():
        ENGINES.register("scripted-calc-model", "fakes:ScriptedCalcModel")
    return "scripted-calc-model"


def test_rows_are_the_tasksets_tasks_with_the_last_fifth_held_out():
    from agentgym.data.rows import load_rows
    cfg = vf_cfg()
    train = load_rows("verifiers", "train", 0, cfg=cfg)
    test = load_rows("verifiers", "test", 0, cfg=cfg)
    assert [r["extra_info"]["task"] for r in train] == list(range(8))
    assert [r["extra_info"]["task"] for r in test] == [8, 9]
    assert train[1]["prompt"] == [{"role": "user",
                                   "content": "What is 1 + 5? Use the add tool."}]
    assert train[1]["reward_model"]["ground_truth"] == "6"


def test_an_episode_has_the_exact_tokens_and_verifiers_weighted_reward(
        tiny_model, tiny_tokenizer):
    """Three episodes of one task: each a tool call, the tool's result as verifiers'
    harness sent it, and an answer. The trajectory is the engine's own prompt and sampled
    ids; the loss mask covers exactly the sampled ids; the reward is 0.75 * correct +
    0.25 * brief as verifiers' rubric computed it."""
    from agentgym.data.rows import load_rows
    from agentgym.serving.agents import program_manager
    cfg = vf_cfg(n=3)
    engine = ScriptedCalcModel(tiny_model, tiny_tokenizer)
    manager = program_manager(_Closed(), engine, tiny_tokenizer, cfg)
    row = load_rows("verifiers", "train", 0, cfg=cfg)[2]  # What is 2 + 7?
    try:
        trajs = asyncio.run(manager.run([row], n=3))
        stats = manager.take_stats()
    finally:
        manager.close()
    assert stats["agent/failed"] == 0.0 and len(trajs) == 3
    assert sorted(t.reward for t in trajs) == pytest.approx([0.25, 0.75, 1.0])
    calls = list(zip(engine.prompts, engine.produced))
    firsts = [(p, o) for p, o in calls if "<|im_start|>tool" not in tiny_tokenizer.decode(p)]
    assert len(firsts) == 3 and len({(tuple(p), tuple(o)) for p, o in firsts}) == 1
    first, call = firsts[0]  # one task: each episode's first call is the same
    for traj in trajs:
        assert traj.metrics["tool_calls"] == 1.0 and traj.metrics["turns"] == 2.0
        (second, answer_ids), = [(p, o) for p, o in calls
                                 if len(p) > len(first) and traj.token_ids == p + o]
        assert second[:len(first) + len(call)] == first + call  # extends the first call
        sampled = [i for i, m in zip(traj.token_ids, traj.loss_mask) if m]
        assert sampled == call + answer_ids  # the mask: the sampled ids, nothing else
        (obs,) = [s for s in traj.segments if s.kind == "observation"]
        seen = tiny_tokenizer.decode(traj.token_ids[obs.start:obs.end])
        assert "<|im_start|>tool" in seen and "9" in seen  # calc_add's result
        assert all(m == 0 for m in traj.loss_mask[obs.start:obs.end])
        answer = tiny_tokenizer.decode(answer_ids, skip_special_tokens=True).strip()
        want = 0.75 * ("9" in answer.split()) + 0.25 * (len(answer) <= 12)
        assert traj.reward == pytest.approx(want)


def test_train_one_grpo_step(tmp_path, scripted_calc_engine):
    from agentgym.cli import main
    run = tmp_path / "run"
    keys = [f"{k}={v}" for k, v in ENV_KEYS.items()]
    assert main(["train", "env=verifiers", *keys, "model=tiny", "trainer.total_steps=1",
                 "trainer.prompts_per_step=2", "n=3", "trainer.eval_limit=0",
                 "rollout.max_tokens_per_turn=64", f"engine={scripted_calc_engine}",
                 f"run_dir={run}"]) == 0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (step,) = [s for s in steps if "rollout/reward" in s]
    assert step["agent/failed"] == 0.0 and step["rollout/tool_calls"] == 1.0
    assert step["rollout/reward"] == pytest.approx((0.25 + 0.75 + 1.0) / 3)
    assert step["rollout/adv_abs"] > 0 and step["train/grad_norm"] > 0  # it updated


def test_eval_plays_the_held_out_tasks(tmp_path, scripted_calc_engine):
    from agentgym.cli import main
    out = tmp_path / "eval.json"
    keys = [f"{k}={v}" for k, v in ENV_KEYS.items()]
    assert main(["eval", "env=verifiers", *keys, "model=tiny", "data=test",
                 f"engine={scripted_calc_engine}", f"out={out}"]) == 0
    result = json.loads(out.read_text())
    # tasks 8 and 9; the scripted replies are right-and-brief then right-and-wordy
    assert result["n"] == 2 and result["em"] == pytest.approx((1.0 + 0.75) / 2)


def test_check_env_loads_the_taskset_and_reads_its_rubric(capsys):
    from agentgym.cli import main
    keys = [f"{k}={v}" for k, v in ENV_KEYS.items()]
    assert main(["check-env", "verifiers", *keys]) == 0
    assert capsys.readouterr().out.strip() == (
        "ok    agentgym/Verifiers-v0: vf_calc: 10 tasks (8 train, 2 held out), "
        "rubric brief x 0.25, correct x 0.75")
    assert main(["check-env", "verifiers", *keys, "verifiers.config={num_tasks: 1}"]) == 1
    assert "has 1 task(s)" in capsys.readouterr().out


def test_a_worker_killed_mid_episode_fails_that_episode_and_the_next_is_played(
        tiny_model, tiny_tokenizer):
    """Fault injection: the verifiers worker (and the harness it started) is SIGKILLed
    when the engine gets the episode's first call. That episode is counted failed and not
    trained on; the next episode starts a new worker and is played. The killed worker's
    episode folders are removed, and nothing is left in verifiers' own cache."""
    import os
    import signal
    import time

    from agentgym.data.rows import load_rows
    from agentgym.serving.agents import program_manager
    cfg = vf_cfg()
    engine = ScriptedCalcModel(tiny_model, tiny_tokenizer)
    manager = program_manager(_Closed(), engine, tiny_tokenizer, cfg)
    killed = []
    real = engine.generate
    runtimes = Path.home() / ".cache" / "verifiers" / "runtimes" / "subprocess"
    before = set(runtimes.glob("*"))
    ports_before = set(Path("/tmp").glob("vf-port-*"))

    async def generate_then_kill_the_worker(*args, **kwargs):
        if not killed:
            worker = manager.program.worker()
            killed.append((worker.proc.pid, Path(worker.workdirs)))
            os.killpg(worker.proc.pid, signal.SIGKILL)
        return await real(*args, **kwargs)
    engine.generate = generate_then_kill_the_worker
    row = load_rows("verifiers", "train", 0, cfg=cfg)[2]
    try:
        assert asyncio.run(manager.run([row], n=1)) == []
        assert manager.take_stats()["agent/failed"] == 1.0
        (traj,) = asyncio.run(manager.run([row], n=1))
        assert manager.take_stats()["agent/failed"] == 0.0
        assert manager.program.worker().proc.pid != killed[0][0] and traj.reward > 0
        deadline = time.monotonic() + 60  # the worker's reader removes them once it is gone
        while killed[0][1].exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not killed[0][1].exists()
    finally:
        manager.close()
    assert set(runtimes.glob("*")) <= before
    assert set(Path("/tmp").glob("vf-port-*")) <= ports_before  # verifiers' port files too


class _Closed:
    def close(self):
        pass


def test_a_taskset_that_does_not_load_names_itself():
    from agentgym.envs.verifiers_env import VerifiersWorker
    cfg = VerifiersConfig(env="no_such_taskset", python=str(VENV_PYTHON))
    with pytest.raises(ValueError, match="no_such_taskset.*not found"):
        VerifiersWorker(cfg)
