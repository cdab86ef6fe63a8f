"""Asynchronous training (``trainer.mode=async``): the staleness bound on every consumed
sample, exact reproduction of synchronous training at ``max_staleness=0``, and no group
lost or taken twice across weight updates and a producer restart."""

from __future__ import annotations

import copy
import json
import random

import pytest

from agentgym.config import build_config
from agentgym.data.rows import write_jsonl
from agentgym.rollout.engines.hf import HFEngine
from toy_envs import Gate, letter_rows
from agentgym.trainers.loop import train
from agentgym.trainers.async_steps import AsyncSteps
from agentgym.trainers.workers import LocalWorkers


def _metrics(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_max_staleness_zero_reproduces_sync_training(tmp_path, algo):
    """One step loop, one step source: with no staleness allowed, async training equals
    sync training step for step, with or without a critic (PPO's phases)."""
    data = tmp_path / "toy.jsonl"
    write_jsonl(data, letter_rows(12))
    base = {"env": "agentgym-test/Letter-v0", "model": "tiny", "data": str(data),
            "trainer.prompts_per_step": 2, "rollout.n": 2, "rollout.max_tokens_per_turn": 8,
            "trainer.eval_limit": 0, "trainer.lr": 1e-2, "trainer.total_steps": 4,
            "algo": algo, **({"critic.warmup_steps": 1} if algo == "ppo" else {})}
    sync = _metrics(train(build_config({**base, "run_dir": str(tmp_path / "sync")})))
    asy = _metrics(train(build_config({**base, "trainer.mode": "async",
                                       "trainer.max_staleness": 0,
                                       "run_dir": str(tmp_path / "async")})))
    assert [r["step"] for r in asy] == [r["step"] for r in sync] == [1, 2, 3, 4]
    for a, s in zip(asy, sync):
        assert a["async/staleness_max"] == 0.0 and a["async/dropped_groups"] == 0.0
        for key, value in s.items():
            if key.startswith(("time/", "rollout/generate_s", "rollout/env_s")):
                continue
            # drift = |engine logprob - trainer logprob|, itself float noise (~1e-7): the
            # engine's batches form differently when groups start one by one, which moves
            # that noise, not the samples
            tol = 1e-5 if "drift" in key else 1e-9
            assert a[key] == pytest.approx(value, rel=1e-6, abs=tol), key


def _talk_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    # long-tailed tool latency: most steps fast, a few very slow
    return [{"data_source": "toy", "env": "agentgym-test/Talk-v0",
             "prompt": [{"role": "user", "content": f"Talk #{i}"}],
             "reward_model": {"ground_truth": ""},
             "extra_info": {"index": i, "delay": min(0.4, rng.lognormvariate(-5, 1.5))}}
            for i in range(n)]


def _producer(tiny_model, tiny_tokenizer, max_staleness: int, P: int = 2, n: int = 2,
              rows=None, start_group: int = 0, version: int = 0, taken=()):
    cfg = build_config({"env": "agentgym-test/Talk-v0", "model": "tiny",
                        "trainer.prompts_per_step": P, "rollout.n": n,
                        "rollout.max_turns": 3, "rollout.max_tokens_per_turn": 6,
                        "trainer.mode": "async", "trainer.max_staleness": max_staleness})
    engine = HFEngine(copy.deepcopy(tiny_model), tiny_tokenizer, batch_wait_s=0.002)
    local = LocalWorkers(cfg, engine, tiny_tokenizer)
    if version:  # a resumed run's engine holds the version it resumes from
        local.update_weights(tiny_model.state_dict(), version)
    return AsyncSteps(cfg, local, rows or _talk_rows(40), start_group=start_group,
                        version=version, taken=taken)


def _slow_first_rows(n: int, slow: set[int]) -> list[dict]:
    """Rows whose tool answers instantly, except the ``slow`` ones (0.6 s a turn): those
    groups finish after later ones, are taken out of order or dropped as too stale."""
    return [{"data_source": "toy", "env": "agentgym-test/Talk-v0",
             "prompt": [{"role": "user", "content": f"Talk #{i}"}],
             "reward_model": {"ground_truth": ""},
             "extra_info": {"index": i, "delay": 0.6 if i in slow else 0.0}}
            for i in range(n)]


def test_drops_do_not_shrink_the_schedule(tiny_model, tiny_tokenizer):
    """Every dropped group frees its place: after many drops the producer still keeps
    ``max_staleness`` steps of groups ahead instead of falling back to lockstep."""
    P, ms = 2, 1
    slow = set(range(0, 24, 3))  # one slow group in three: each finishes too stale
    ar = _producer(tiny_model, tiny_tokenizer, ms, P=P, rows=_slow_first_rows(60, slow))
    weights = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    ahead = []
    try:
        for step in range(12):
            trajs, m = ar.take(step, timeout=120)
            for t in trajs:
                assert ar.version - t.policy_version <= ms
            ar.update_weights(weights, ar.version + 1)
            with ar._cv:  # what the producer may keep ahead once it caught up
                ar._cv.wait_for(lambda: not ar._may_start(), timeout=30)
                ahead.append(len(ar.in_flight) + len(ar.done))
    finally:
        ar.close()
    assert len(ar.dropped) >= ms * P + 1  # more drops than the old schedule survived
    # after those drops the window is still (ms + 1) * P groups wide
    assert ahead[-1] == (ms + 1) * P and min(ahead[-4:]) == (ms + 1) * P


def test_resume_after_out_of_order_takes_loses_and_repeats_nothing(tiny_model, tiny_tokenizer):
    """Groups are taken oldest finished first, so what was taken is not a prefix; a run
    resumed from (cursor, taken after it) takes every group exactly once."""
    P, ms = 2, 2
    rows = _slow_first_rows(60, slow={0, 1, 5})
    weights = {k: v.clone() for k, v in tiny_model.state_dict().items()}

    def run(ar, first: int, until) -> AsyncSteps:
        try:
            step = first
            while not until(ar) and step < first + 40:
                ar.take(step, timeout=120)
                ar.update_weights(weights, ar.version + 1)
                step += 1
        finally:
            ar.close()
        return ar

    a = run(_producer(tiny_model, tiny_tokenizer, ms, P=P, rows=rows), 0,
            until=lambda ar: ar.version == 3)
    assert a.taken_after_cursor, "the test needs groups taken out of order before the stop"
    assert a.cursor not in a.consumed + a.dropped
    last = max(a.taken_after_cursor)  # b runs until it has taken everything up to here
    b = run(_producer(tiny_model, tiny_tokenizer, ms, P=P, rows=rows, start_group=a.cursor,
                      version=3, taken=a.taken_after_cursor), 3,
            until=lambda ar: ar.cursor > last)
    taken = a.consumed + a.dropped + b.consumed + b.dropped
    assert len(taken) == len(set(taken))  # nothing trained or dropped twice
    # nothing lost: across both runs, exactly the groups below b's cursor and the ones
    # b lists after it were taken
    assert set(taken) == set(range(b.cursor)) | set(b.taken_after_cursor)
    assert b.cursor > last  # a's gaps were rolled out again, its taken groups skipped
    assert not set(b.consumed + b.dropped) & set(a.taken_after_cursor)


def _gated(row: dict, gate: Gate) -> dict:
    return {**row, "extra_info": {**row["extra_info"], "gate": gate.name}}


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_staleness_is_bounded_and_every_group_counted_once(tiny_model, tiny_tokenizer,
                                                           max_staleness):
    """Two groups are held at their tool calls (toy_envs.Gate), so what the test needs
    happens by construction, not by timing: group 1's episodes wait after their first
    turn until the first weight update has landed (they cross it), and group HELD is
    still in flight when the producer is restarted (the restart loses it). The run then
    goes on until every group up to the lost ones has been taken: a lost group that is
    never rolled out again keeps the cursor below it and fails the test."""
    P, HELD = 2, 6  # by step 3, 8 groups are taken and none is HELD: it has started
    cross, held = Gate(), Gate()
    rows = _talk_rows(40)
    rows[1], rows[HELD] = _gated(rows[1], cross), _gated(rows[HELD], held)
    ar = _producer(tiny_model, tiny_tokenizer, max_staleness, P=P, rows=rows)
    weights = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    seen_uids = []

    def take(step):
        trajs, m = ar.take(step, timeout=120)
        assert len(trajs) == P * 2 and m["async/staleness_max"] <= max_staleness
        for t in trajs:  # every consumed sample, checked
            assert ar.version - t.policy_version <= max_staleness
            assert t.policy_version == min(t.turn_versions)
        seen_uids.extend((t.uid, t.sample_index) for t in trajs)

    try:
        take(0)
        assert cross.arrived.wait(120), "group 1 never reached its first tool call"
        ar.update_weights(weights, 1)  # lands between group 1's first and second turns
        cross.open()
        with ar._cv:
            assert ar._cv.wait_for(lambda: 1 in ar.done, timeout=120)
            crossed = ar.done[1]
        assert any(t.turn_versions[0] == 0 and t.turn_versions[-1] == 1 for t in crossed)
        assert all(t.policy_version == min(t.turn_versions) for t in crossed)
        for step in range(1, 4):
            take(step)
            ar.update_weights(weights, ar.version + 1)
        with ar._cv:
            lost = set(ar.in_flight)
        assert HELD in lost  # it cannot finish while its gate is shut
        ar.restart()  # the producer dies with episodes in flight
        held.open()
        step = 4
        while ar.cursor <= max(lost) and step < 48:  # until every lost group is taken
            take(step)
            ar.update_weights(weights, ar.version + 1)
            step += 1
    finally:
        ar.close()
        cross.close()
        held.close()
    assert ar.stats["restarts"] == 1
    taken = ar.consumed + ar.dropped
    assert len(taken) == len(set(taken))  # nothing taken twice
    assert set(taken) == set(range(ar.cursor)) | set(ar.taken_after_cursor)
    # nothing lost: every scheduled group is taken, finished or still in flight, and the
    # groups the restart lost were rolled out again and taken
    accounted = set(taken) | set(ar.done) | ar.in_flight
    assert set(range(ar.next_group)) <= accounted
    assert lost <= set(taken), f"groups lost by the restart and never taken: {lost - set(taken)}"
    assert len(seen_uids) == len(set(seen_uids))


def test_async_refuses_what_it_does_not_support(tmp_path):
    cfg = build_config({"env": "agentgym-test/Letter-v0", "model": "tiny", "rollout.n": 2,
                        "trainer.mode": "async", "algo": "dapo", "run_dir": str(tmp_path)})
    with pytest.raises(ValueError, match="algo.dynamic_sampling"):
        train(cfg)
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        build_config({"trainer.max_staleness": -1})


def test_async_run_resumes_where_it_stopped(tmp_path):
    """A run stopped after 2 of 4 steps and resumed (trainer.resume=auto) trains on the
    same groups as an uninterrupted one (max_staleness=0: the schedule is deterministic)."""
    data = tmp_path / "toy.jsonl"
    write_jsonl(data, letter_rows(12))
    base = {"env": "agentgym-test/Letter-v0", "model": "tiny", "data": str(data),
            "trainer.prompts_per_step": 2, "rollout.n": 2, "rollout.max_tokens_per_turn": 8,
            "trainer.eval_limit": 0, "trainer.lr": 1e-2, "trainer.mode": "async",
            "trainer.max_staleness": 0, "trainer.save_every": 1}
    straight = _metrics(train(build_config({**base, "trainer.total_steps": 4,
                                            "run_dir": str(tmp_path / "a")})))
    train(build_config({**base, "trainer.total_steps": 2, "run_dir": str(tmp_path / "b")}))
    resumed = _metrics(train(build_config({**base, "trainer.total_steps": 4,
                                           "run_dir": str(tmp_path / "b")})))
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(resumed, straight):
        for key in ("rollout/reward", "train/pg_loss", "train/grad_norm", "rollout/policy_version"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)
