"""PPO with a critic for multi-turn tool-using agents, top to bottom.

    agentgym train env=search algo=ppo                          # smollm2-135m policy and critic
    agentgym train env=search algo=ppo model=tiny trainer.total_steps=2
    agentgym train env=search algo=ppo critic.warmup_steps=5 critic.lr=1e-5 algo.lam=0.95

The phases of :mod:`agentgym.trainers.grpo`, plus a value model (:mod:`agentgym.trainers.critic`):
  1. roll out ``trainer.prompts_per_step`` prompts (``rollout.n`` = 1 by default: the
     critic is the baseline, no groups needed);
  2. old (and reference) logprobs; the critic's values of every token's state and of
     each whole sequence;
  3. token rewards (each turn's env reward on its last sampled token, minus the
     per-token KL penalty with ``algo.kl_mode=reward``), then GAE (``algo.gamma``,
     ``algo.lam``) over sampled tokens only, so values at observation tokens never
     enter an advantage; a terminated episode bootstraps 0 after its last token, a
     truncated one the critic's value of the state it was cut off in;
  4. the critic's clipped value update (``critic.value_clip``) toward GAE's returns,
     then the policy update — skipped for the first ``critic.warmup_steps`` steps, so
     the policy does not follow advantages of an untrained critic;
  5. weight sync to the rollout engine (when the policy changed);
  6. metrics; checkpoints hold the critic in ``checkpoints/step_N/critic`` (HF format).
"""

from __future__ import annotations

import time
from pathlib import Path

from agentgym.config import Config
from agentgym.trainers.algos import needs_critic
from agentgym.trainers.critic import Critic
from agentgym.trainers.grpo import advantages, open_session, score, update_policy
from agentgym.trainers.sampling import collect
from agentgym.trainers.local_rollout import Hooks


def train(cfg: Config, hooks: Hooks | None = None) -> Path:
    """Run PPO (``algo=ppo``, or any estimator that reads values) as configured; return
    the run directory."""
    if not needs_critic(cfg.algo.advantage):
        raise ValueError(f"algo.advantage={cfg.algo.advantage!r} uses no critic; PPO's recipe "
                         f"needs one (algo.advantage=gae, or algo=ppo)")
    s = open_session(cfg, hooks, make_critic=lambda path, cluster: Critic(cfg, path, cluster))
    critic = s.critic
    try:
        for step in range(s.start, cfg.trainer.total_steps):
            t0 = time.perf_counter()
            # 1. rollouts
            trajs, s.cursor, m = collect(cfg, s.rollout, s.rows, s.cursor, step, s.hooks,
                                         s.curriculum)
            t1 = time.perf_counter()
            policy_updated = False
            if trajs:
                # 2. old / reference logprobs and the critic's values
                batch, rewards, mm = score(cfg, s.backend, s.ref, trajs, s.tokenizer,
                                           s.temperature)
                tc = time.perf_counter()
                batch.extra["values"], batch.extra["last_values"] = critic.values(batch)
                # 3. GAE over sampled tokens
                adv, ma = advantages(cfg, batch, rewards)
                m.update({**mm, **ma, "time/logprobs_s": tc - t1})
                s.write_samples(step + 1, trajs, batch)
                # 4. critic, then policy (after the critic's warm-up)
                m.update(critic.update(batch, step, s.hooks))
                tu = time.perf_counter()
                m["time/critic_s"] = tu - tc
                if step >= cfg.critic.warmup_steps:
                    m.update(update_policy(cfg, s.backend, batch, s.temperature, step, s.hooks))
                    m["time/update_s"] = time.perf_counter() - tu
                    policy_updated = True
            t2 = time.perf_counter()
            # 5. weight sync (the policy is unchanged during the critic's warm-up)
            if policy_updated:
                s.sync()
            t3 = time.perf_counter()
            # 6. metrics and checkpoints (the critic's in checkpoints/step_N/critic)
            m.update({"train/policy_updated": float(policy_updated),
                      "time/rollout_s": t1 - t0, "time/train_s": t2 - t1, "time/sync_s": t3 - t2,
                      "time/generate_s": m["rollout/generate_s"], "time/env_s": m["rollout/env_s"],
                      "time/step_s": time.perf_counter() - t0})
            s.end_step(step + 1, m)
        s.finish()
    finally:
        s.close()
    return s.run_dir
