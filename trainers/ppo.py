"""PPO with a critic for multi-turn tool-using agents, top to bottom.

    agentgym train env=search algo=ppo                          # smollm2-135m policy and critic
    agentgym train env=search algo=ppo model=tiny trainer.total_steps=2
    agentgym train env=search algo=ppo critic.warmup_steps=5 critic.lr=1e-5 algo.lam=0.95

The one step loop of :mod:`agentgym.trainers.loop`, with the value model's phases
(:mod:`agentgym.trainers.critic`):
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

from pathlib import Path

from agentgym.config import Config
from agentgym.trainers.algos import needs_critic
from agentgym.trainers.hooks import Hooks
from agentgym.trainers.loop import train as _loop_train


def train(cfg: Config, hooks: Hooks | None = None) -> Path:
    """Run PPO (``algo=ppo``, or any estimator that reads values) as configured (the step
    loop: :mod:`agentgym.trainers.loop`); return the run directory."""
    if not needs_critic(cfg.algo.advantage):
        raise ValueError(f"algo.advantage={cfg.algo.advantage!r} uses no critic; PPO's recipe "
                         f"needs one (algo.advantage=gae, or algo=ppo)")
    return _loop_train(cfg, hooks)
