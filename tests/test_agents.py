"""``env=agent``: agents written against the OpenAI SDK, trained from their calls' exact
token ids (agentgym.serving.agents). Tool-calling replies need a model that writes tool
calls, which random weights never do: those tests script the engine's output (a fake for
the model only); everything else runs the tiny model."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from agentgym.config import build_config
from agentgym.rollout.engines.hf import HFEngine
from agentgym.serving.agents import AgentManager
from agentgym.envs.search import search_row
from fakes import ScriptedServed

CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "capital of France"}}\n</tool_call>'


def cfg_for(agent: str, **keys):
    return build_config({"env": "agent", "agent": agent, "model": "tiny", **keys})


def row(question: str, answers=("Paris",), i: int = 0) -> dict:
    r = search_row(question, list(answers))
    r["extra_info"] = {"question": question, "index": i}
    return r


def play(manager: AgentManager, rows, n=1):
    try:
        return asyncio.run(manager.run(rows, n=n))
    finally:
        manager.close()


def test_an_sdk_agent_calling_search_yields_one_exact_trajectory(
        tiny_model, tiny_tokenizer, retriever_url, monkeypatch):
    monkeypatch.setenv("SEARCH_URL", retriever_url)
    engine = ScriptedServed(tiny_model, tiny_tokenizer, [f"{CALL} + eos", "Paris + eos"])
    manager = AgentManager(engine, tiny_tokenizer, cfg_for("examples.search_agent:run"))
    (traj,) = play(manager, [row("What is the capital of France?")])
    assert traj.reward == 1.0 and traj.info["parts"] == 1
    first, second = engine.prompts
    assert traj.token_ids[:len(first)] == first  # the first prompt as sent ...
    assert traj.token_ids[:len(second)] == second  # ... and the second extends it exactly
    assert traj.sampled_ids() == engine.produced[0] + engine.produced[1]
    sampled_lp = [lp for lp, m in zip(traj.logprobs, traj.loss_mask) if m]
    assert sampled_lp == [-0.25 * (k + 1) for k in range(len(engine.produced[0]))] + \
        [-0.25 * (k + 1) for k in range(len(engine.produced[1]))]
    (obs,) = [s for s in traj.segments if s.kind == "observation"]
    seen = tiny_tokenizer.decode(traj.token_ids[obs.start:obs.end])
    assert "<|im_start|>tool" in seen and "Paris" in seen  # the retriever's passages
    assert traj.metrics["tool_calls"] == 1.0 and traj.metrics["turns"] == 2.0


def test_a_rewritten_history_yields_several_trajectories_with_exact_masks(
        tiny_model, tiny_tokenizer):
    engine = ScriptedServed(tiny_model, tiny_tokenizer, ["Lyon + eos", "Paris + eos"])
    manager = AgentManager(engine, tiny_tokenizer, cfg_for("agents_for_tests:rewriting_agent"))
    trajs = play(manager, [row("Capital of France?")])
    assert [t.info["part"] for t in trajs] == [0, 1] and len({t.info["episode"]
                                                              for t in trajs}) == 1
    for traj, prompt, produced in zip(trajs, engine.prompts, engine.produced):
        assert traj.token_ids == prompt + produced
        assert traj.loss_mask == [0] * len(prompt) + [1] * len(produced)
        assert traj.reward == 0.5
    stats = manager.take_stats()
    assert stats["agent/trajectories_per_episode"] == 2.0 and stats["agent/failed"] == 0.0


def test_an_episodes_rows_count_once_in_the_group_advantage():
    from agentgym.trainers.algos import grpo_advantages
    rewards = torch.tensor([[1.0], [1.0], [0.0]])
    mask = torch.ones(3, 1)
    adv, _ = grpo_advantages(rewards, mask, group_ids=["q"] * 3, episode_ids=["a", "a", "b"])
    two, _ = grpo_advantages(rewards[1:], mask[1:], group_ids=["q"] * 2)
    want = [two[0, 0].item(), two[0, 0].item(), two[1, 0].item()]  # two episodes' values
    assert adv[:, 0].tolist() == pytest.approx(want)


def test_the_recorded_tokens_are_trained_on_and_drift_is_measured(tiny_model, tiny_tokenizer):
    """The model sampled a non-canonical split of a word; the next call's prompt keeps
    those ids (one trajectory), and the re-rendered prompt's difference is counted."""
    word = next(w for w in ("hello", "world", "paris", "answer")
                if len(tiny_tokenizer.encode(w, add_special_tokens=False)) < len(w))
    split = [tiny_tokenizer.convert_tokens_to_ids(c) for c in word]
    eos = tiny_tokenizer.eos_token_id
    engine = ScriptedServed(tiny_model, tiny_tokenizer, [split + [eos], "done + eos"])
    manager = AgentManager(engine, tiny_tokenizer,
                           cfg_for("agents_for_tests:concurrent_agent"))
    from agents_for_tests import Barrier
    Barrier.n, Barrier.running, Barrier.event = 1, 0, asyncio.Event()
    (traj,) = play(manager, [row("Say a word.")])
    assert traj.sampled_ids() == split + [eos] + engine.produced[1]
    stats = manager.take_stats()
    assert stats["agent/drift_calls"] == 1.0 and stats["agent/drift_tokens"] > 0


def test_n_agents_run_concurrently_each_on_its_own_episode(tiny_model, tiny_tokenizer):
    from agents_for_tests import Barrier
    rows = [row(q, i=i) for i, q in enumerate(["Who wrote Hamlet?", "Where is Lima?",
                                               "What is ten plus two?"])]
    Barrier.n, Barrier.running, Barrier.event = 6, 0, None
    engine = HFEngine(tiny_model, tiny_tokenizer)
    manager = AgentManager(engine, tiny_tokenizer, cfg_for(
        "agents_for_tests:concurrent_agent", **{"rollout.max_tokens_per_turn": 6}))

    async def main():
        Barrier.event = asyncio.Event()
        try:
            return await manager.run(rows, n=2)
        finally:
            manager.close()
    try:
        trajs = asyncio.run(main())
    finally:
        engine.close()
    assert len(trajs) == 6 and [(t.uid, t.sample_index) for t in trajs] == \
        [(str(i), k) for i in range(3) for k in range(2)]
    for t in trajs:
        question = rows[int(t.uid)]["extra_info"]["question"]
        assert question in tiny_tokenizer.decode(t.token_ids[:t.prompt_length])
        assert t.metrics["turns"] == 2.0 and t.info["parts"] == 1


def test_an_agent_that_raises_is_counted_and_not_trained_on(tiny_model, tiny_tokenizer):
    engine = HFEngine(tiny_model, tiny_tokenizer)
    manager = AgentManager(engine, tiny_tokenizer, cfg_for("agents_for_tests:failing_agent"))
    try:
        trajs = play(manager, [row("fail here", i=0), row("fine here", i=1)])
    finally:
        engine.close()
    assert [t.uid for t in trajs] == ["1"]
    assert manager.take_stats()["agent/failed"] == 1.0


def test_an_agent_may_take_the_base_url(tiny_model, tiny_tokenizer):
    engine = HFEngine(tiny_model, tiny_tokenizer)
    manager = AgentManager(engine, tiny_tokenizer, cfg_for("agents_for_tests:url_agent"))
    try:
        (traj,) = play(manager, [row("hi")])
    finally:
        engine.close()
    assert traj.reward == 0.25


@pytest.fixture(scope="module")
def scripted_agent_engine():
    from agentgym.rollout.engines.base import ENGINES
    if "scripted-agent-model" not in ENGINES.names():
        ENGINES.register("scripted-agent-model", "fakes:ScriptedAgentModel")
    return "scripted-agent-model"


@pytest.mark.parametrize("engine", ["hf", "scripted"])
def test_train_two_grpo_steps_of_the_example_agent_and_inspect_them(
        tmp_path, retriever_url, monkeypatch, scripted_agent_engine, engine):
    """The example agent (openai SDK, function calling, the real local retriever) trains
    2 GRPO steps: on the tiny model as it samples, and on a scripted model that does call
    the search tool (so the tool's passages are in what is trained)."""
    from agentgym.cli import main
    from agentgym.reporting.inspector import load
    monkeypatch.setenv("SEARCH_URL", retriever_url)
    data = tmp_path / "questions.jsonl"
    rows = [row(q, a, i) for i, (q, a) in enumerate([("Who wrote Hamlet?", ["Shakespeare"]),
                                                      ("Capital of Peru?", ["Lima"])])]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    name = scripted_agent_engine if engine == "scripted" else "hf"
    assert main(["train", "env=agent", "agent=examples.search_agent:run", f"data={data}",
                 "model=tiny", "trainer.total_steps=2", "trainer.prompts_per_step=2", "n=2",
                 "rollout.max_tokens_per_turn=96", "trainer.cold_start=off",
                 f"engine={name}", "trainer.log_samples=4", f"run_dir={run}"]) == 0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if "rollout/reward" in s]
    assert [s["step"] for s in trained] == [1, 2]
    assert [(s["agent/failed"], s["agent/trajectories_per_episode"]) for s in trained] == \
        [(0.0, 1.0)] * 2
    samples, _, _ = load(run)
    assert samples and all(s["e"] == "agent" for s in samples)
    if engine == "scripted":
        assert [s["rollout/tool_calls"] for s in trained] == [1.0, 1.0]
        assert all('"name": "search"' in "".join(s["tok"]) and  # the call, then its passages
                   "<|im_start|>tool\n" in "".join(s["tok"]) for s in samples)


def test_reward_scores_an_agent_that_returns_none(tiny_model, tiny_tokenizer):
    engine = ScriptedServed(tiny_model, tiny_tokenizer, ["fine + eos"])
    manager = AgentManager(engine, tiny_tokenizer, cfg_for(
        "agents_for_tests:silent_agent", reward="agents_for_tests:reply_length"))
    r = {**row("hi"), "data_source": "nq"}
    (traj,) = play(manager, [r])
    assert traj.reward == 1.5 and traj.info["answer"] == "fine"


def two_questions(tmp_path):
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps(row(q, i=i)) + "\n"
                            for i, q in enumerate(["Who wrote Hamlet?", "Capital of Peru?"])))
    return data


def test_asynchronous_training_plays_agents_too(tmp_path):
    from agentgym.cli import main
    data = two_questions(tmp_path)
    run = tmp_path / "run"
    assert main(["train", "env=agent", "agent=agents_for_tests:rewriting_agent",
                 f"data={data}", "model=tiny", "trainer.total_steps=2",
                 "trainer.prompts_per_step=2", "n=2", "rollout.max_tokens_per_turn=8",
                 "trainer.cold_start=off", "trainer.mode=async", f"run_dir={run}"]) == 0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if "agent/trajectories_per_episode" in s]
    assert len(trained) == 2 and all(s["agent/trajectories_per_episode"] == 2.0
                                     for s in trained)


def test_eval_plays_the_agent_greedily_one_result_per_episode(tmp_path):
    from agentgym.cli import main
    data = two_questions(tmp_path)
    out = tmp_path / "eval.json"
    assert main(["eval", "env=agent", "agent=agents_for_tests:rewriting_agent",
                 f"data={data}", "model=tiny", "rollout.max_tokens_per_turn=8",
                 f"out={out}"]) == 0
    result = json.loads(out.read_text())
    assert result["n"] == 2 and result["em"] == 0.5  # the agent's reward, once per episode


def test_an_episode_makes_at_most_max_turns_calls(tiny_model, tiny_tokenizer):
    engine = HFEngine(tiny_model, tiny_tokenizer)
    manager = AgentManager(engine, tiny_tokenizer, cfg_for(
        "agents_for_tests:chatty_agent", **{"rollout.max_turns": 3}))
    try:
        trajs = play(manager, [row("hi")])
    finally:
        engine.close()
    assert trajs[0].reward == 3.0 and sum(t.metrics["turns"] for t in trajs) == 3.0
