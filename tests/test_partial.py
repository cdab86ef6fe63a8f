"""Partial rollouts (rollout.partial, trainer.mode=async): a generation in flight when new
weights land stops at the next step and continues under them, each token stamped with the
version that sampled it and carrying that version's logprob. The interruption is placed
deterministically: the model's forward blocks on a gate (fault injection) at a chosen
decode step while the test pauses the engine."""

from __future__ import annotations

import asyncio
import copy
import json
import threading

import pytest
import torch

from agentgym.core.types import SamplingParams
from agentgym.rollout.engines.hf import HFEngine


class BlockingForward:
    """The model's forward, held at its ``at``-th call until :meth:`release` (fault
    injection: a slow step the test can place an update in). A forward pre-hook: the
    engine's model runner calls the model's hooks as the model's own forward does."""

    def __init__(self, model, at: int) -> None:
        self.at, self.calls = at, 0
        self.arrived, self._go = threading.Event(), threading.Event()
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.calls += 1
        if self.calls == self.at:
            self.arrived.set()
            if not self._go.wait(120):
                raise TimeoutError("the test never released the forward")

    def release(self) -> None:
        self._go.set()


def logprobs_of(model, ids: list[int], start: int) -> list[float]:
    """Each token's logprob from position ``start`` on under ``model`` (full forward, fp32)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [float(logp[t - 1, ids[t]]) for t in range(start, len(ids))]


def perturbed(model):
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return other


@pytest.mark.parametrize("runner", ["asyncio.run", "engine.run"])
@pytest.mark.parametrize("partial", [True, False])
def test_a_generation_in_flight_continues_under_the_new_weights(tiny_model, tiny_tokenizer,
                                                                partial, runner):
    """``engine.run``: the test's thread runs the steps (and the held forward) while the
    scenario's event loop runs in the engine's helper thread."""
    model = copy.deepcopy(tiny_model)
    new = perturbed(tiny_model)
    engine = HFEngine(model, tiny_tokenizer, batch_wait_s=0.001, prefix_cache=True)
    gate = BlockingForward(model, at=8)  # the prefill, then decode steps: held at the 7th
    prompt = tiny_tokenizer.encode("Once upon a time", add_special_tokens=False)
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0, seed=3)

    async def scenario():
        task = asyncio.ensure_future(engine.generate(prompt, sampling))
        await asyncio.to_thread(gate.arrived.wait, 120)
        pause = asyncio.ensure_future(engine.pause(partial=partial))
        await asyncio.sleep(0)  # pause() has marked the engine before the step goes on
        gate.release()
        await pause
        engine.update_weights(new.state_dict(), 1)
        engine.resume()
        return await task

    try:
        out = (engine.run if runner == "engine.run" else asyncio.run)(scenario())
    finally:
        engine.close()
    assert len(out.ids) == 24  # (seeded: no EOS before the budget)
    if not partial:  # the request finished on the old weights first
        assert out.token_versions is None and out.policy_version == 0
        assert out.logprobs == pytest.approx(logprobs_of(tiny_model, prompt + out.ids,
                                                         len(prompt)), abs=1e-4)
        return
    versions = out.token_versions
    assert versions is not None and versions == sorted(versions) and set(versions) == {0, 1}
    k = versions.index(1)
    assert k == 8  # the first token from the prefill, six decode steps, the held one
    assert out.policy_version == 0  # the oldest
    ids = prompt + out.ids
    old_lp = logprobs_of(tiny_model, ids, len(prompt))
    new_lp = logprobs_of(new, ids, len(prompt))
    assert out.logprobs[:k] == pytest.approx(old_lp[:k], abs=1e-4)
    assert out.logprobs[k:] == pytest.approx(new_lp[k:], abs=1e-4)
    assert engine.stats["preempted"] == 1


def test_async_training_with_partial_rollouts(tmp_path):
    """Three asynchronous steps with rollout.partial=true on a multi-turn env: every
    trained token carries the version that sampled it, never older than the bound, in
    order within a trajectory; the step metrics report the token staleness."""
    from agentgym.config import build_config
    from agentgym.data.rows import write_jsonl
    from toy_envs import letter_rows
    from agentgym.trainers.loop import train
    data = tmp_path / "talk.jsonl"
    write_jsonl(data, [{**r, "env": "agentgym-test/Talk-v0"} for r in letter_rows(24)])
    cfg = build_config({"env": "agentgym-test/Talk-v0", "model": "tiny", "data": str(data),
                        "trainer.mode": "async", "trainer.max_staleness": 1,
                        "rollout.partial": True, "trainer.total_steps": 3,
                        "trainer.prompts_per_step": 2, "rollout.n": 2, "rollout.max_turns": 3,
                        "rollout.max_tokens_per_turn": 16, "trainer.eval_limit": 0,
                        "trainer.log_samples": 100, "trainer.save_every": 100,
                        "run_dir": str(tmp_path / "run")})
    run = train(cfg)
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "rollout/reward" in m]
    assert len(steps) == 3
    for m in steps:
        assert 0 <= m["async/token_staleness_mean"] <= m["async/token_staleness_max"] <= 1
        assert 0 <= m["async/mixed_version_share"] <= 1 and "engine/preempted" in m
    for p in (run / "samples").glob("step_*.jsonl"):
        for line in p.read_text().splitlines():
            r = json.loads(line)
            versions = r["token_versions"]
            assert len(versions) == sum(r["loss_mask"]) and versions == sorted(versions)
            assert r["step"] - 1 - versions[0] <= 1  # trained at version step - 1


def test_a_request_finishing_in_the_interrupted_step_leaves_the_engine_working(tiny_model,
                                                                              tiny_tokenizer):
    """Two requests decode side by side; the first (the lower slot) reaches its budget in
    the step a partial pause interrupts. Taking that step in finishes it and moves the
    other's keys/values into its slot; the other continues under the new weights. (That
    move outside inference mode once killed the engine's thread: the pause then waited
    forever, and a run's weight sync with it.)"""
    model = copy.deepcopy(tiny_model)
    new = perturbed(tiny_model)
    engine = HFEngine(model, tiny_tokenizer, batch_wait_s=0.05, prefix_cache=True)
    gate = BlockingForward(model, at=8)  # the prefill, then decode steps: held at the 7th
    prompt = tiny_tokenizer.encode("Once upon a time", add_special_tokens=False)
    short = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
    long = SamplingParams(max_new_tokens=24, temperature=1.0, seed=3)

    async def scenario():
        first = asyncio.ensure_future(engine.generate(prompt, short))
        second = asyncio.ensure_future(engine.generate(prompt, long))
        await asyncio.to_thread(gate.arrived.wait, 120)
        pause = asyncio.ensure_future(engine.pause(partial=True))
        await asyncio.sleep(0)  # pause() has marked the engine before the step goes on
        gate.release()
        await asyncio.wait_for(pause, 120)
        engine.update_weights(new.state_dict(), 1)
        engine.resume()
        return await asyncio.wait_for(asyncio.gather(first, second), 120)

    try:
        a, b = asyncio.run(scenario())
    finally:
        engine.close()
    assert gate.calls > 8  # the prefill was one forward, the held one its 7th decode step
    assert len(a.ids) == 8 and a.token_versions is None and a.policy_version == 0
    assert len(b.ids) == 24 and b.token_versions.index(1) == 8
    assert engine.stats["preempted"] == 1  # the second only: the first had finished
