"""``agentgym train``: one entry (:func:`train`) and one step loop for every algorithm, top
to bottom.

    agentgym train env=search                      # GRPO, smollm2-135m, shipped data
    agentgym train env=search algo=rloo            # or dr_grpo, reinforce_plus_plus, dapo, gspo, …
    agentgym train env=search algo=ppo             # the same loop, with a critic's phases
    agentgym train env=search algo=ppo critic.warmup_steps=5 critic.lr=1e-5 algo.lam=0.95
    agentgym train env=search trainer.mode=async   # any of them, rolling out while it trains
    agentgym train env=search model=tiny trainer.total_steps=2    # seconds, for a smoke test
    agentgym train env=search run_dir=runs/a trainer.resume=auto  # continue a killed run

:func:`train` checks the algorithm's settings (:func:`~agentgym.trainers.phases.check_algo`),
runs the cold start ``trainer.cold_start`` asks for (:mod:`agentgym.trainers.cold_start`),
then the steps. Whether a critic trains beside the policy is the config's answer,
``cfg.algo.needs_critic`` (the estimators that read values: ``gae``, ``gae_turn``);
checkpoints then hold it in ``checkpoints/step_N/critic``.

Each step, phase by phase:
  1. rollouts: the step source's next trajectories (:func:`~agentgym.trainers.session.
     step_source`: this step's prompts with the current weights, or with
     ``trainer.mode=async`` the next finished groups within the staleness bound);
  2. old and reference logprobs and the token rewards (:func:`~agentgym.trainers.phases.score`);
     with a critic, its values of every token's state and of each sequence's last
     (:mod:`agentgym.trainers.critic`);
  3. advantages, ``algo.advantage`` (:func:`~agentgym.trainers.phases.advantages`);
  4. the critic's update toward the returns, then the policy's
     (:func:`~agentgym.trainers.phases.update_policy`), which waits ``critic.warmup_steps``
     steps so it does not follow an untrained critic's advantages;
  5. the new weights into the rollout engines (when the policy changed);
  6. metrics, periodic eval, checkpoints (:meth:`~agentgym.trainers.session.Session.end_step`).
"""

from __future__ import annotations

import time
from pathlib import Path

from agentgym.config import Config
from agentgym.core.device import peak_memory_gb
from agentgym.supervision.watchdog import closed_with_end_state
from agentgym.trainers.cold_start import prepare
from agentgym.trainers.phases import advantages, check_algo, score, update_policy
from agentgym.trainers.hooks import Hooks
from agentgym.trainers.session import Session, open_session, step_source
from agentgym.trainers.critic import Critic


def train(cfg: Config, hooks: Hooks | None = None) -> Path:
    """Run ``agentgym train`` as ``cfg`` says: the algorithm's settings checked once
    (:func:`check_algo`, before a cold start spends minutes or a model loads), the cold
    start (:func:`~agentgym.trainers.cold_start.prepare`), then the steps (:func:`run`).
    Returns the run directory."""
    check_algo(cfg)
    return run(prepare(cfg, hooks), hooks)


def run(cfg: Config, hooks: Hooks | None = None) -> Path:
    """The steps of ``cfg`` (settings already checked: :func:`check_algo`), from the latest
    checkpoint on; return the run directory."""
    make_critic = None
    if cfg.algo.needs_critic:
        make_critic = lambda path, cluster: Critic(cfg, path, cluster)  # noqa: E731
    s = open_session(cfg, hooks, make_critic=make_critic)
    with closed_with_end_state(s.close):
        source = step_source(cfg, s)
        for step in range(s.start, cfg.trainer.total_steps):
            s.end_step(step + 1, one_step(cfg, s, source, step))
        s.finish()
    return s.run_dir


def one_step(cfg: Config, s: Session, source, step: int) -> dict[str, float]:
    """Phases 1-5 of step ``step`` (module docstring); returns the step's metrics."""
    t0 = time.perf_counter()
    # 1. rollouts (their deadline counts from the last episode to finish)
    with s.watch.stage("rollout", step + 1):
        trajs, m = source.take(step)
    s.cursor, s.taken = source.cursor, source.taken_after_cursor
    t1 = time.perf_counter()
    with s.watch.stage("update", step + 1):  # from the last minibatch trained
        policy_updated = _train(cfg, s, trajs, step, m, t1)
    t2 = time.perf_counter()
    # 5. weight sync (the policy is unchanged during the critic's warm-up)
    if policy_updated:
        s.sync()
    else:
        source.weights_unchanged()
    t3 = time.perf_counter()
    if s.critic is not None:
        m["train/policy_updated"] = float(policy_updated)
    m.update({"time/rollout_s": t1 - t0, "time/train_s": t2 - t1, "time/sync_s": t3 - t2,
              "time/generate_s": m["rollout/generate_s"], "time/env_s": m["rollout/env_s"],
              "time/step_s": time.perf_counter() - t0})
    if (peak := peak_memory_gb(getattr(s.backend, "device", None))) is not None:
        m["perf/peak_memory_gb"] = peak  # this process's GPU: policy, engine, ref
    return m


def _train(cfg: Config, s: Session, trajs, step: int, m: dict, t1: float) -> bool:
    """Phases 2-4 (module docstring); whether the policy changed."""
    policy_updated = False
    if trajs:  # none when dynamic sampling left nothing to train on
        # 2. old / reference logprobs, token rewards; the critic's values
        batch, rewards, mm = score(cfg, s.backend, s.ref, trajs, s.tokenizer, s.temperature,
                                   s.teachers)
        if s.critic is not None:
            batch.values, batch.last_values = s.critic.values(batch)
        # 3. advantages
        _, ma = advantages(cfg, batch, rewards)
        tc = time.perf_counter()
        m.update({**mm, **ma, "time/logprobs_s": tc - t1})
        s.write_samples(step + 1, trajs, batch)
        # 4. the critic, then the policy (after the critic's warm-up)
        if s.critic is not None:
            m.update(s.critic.update(batch, step, s.hooks))
            m["time/critic_s"] = time.perf_counter() - tc
        if s.critic is None or step >= cfg.critic.warmup_steps:
            tu = time.perf_counter()
            m.update(update_policy(cfg, s.backend, batch, s.temperature, step, s.hooks))
            m["time/update_s"] = time.perf_counter() - tu
            policy_updated = True
    return policy_updated
