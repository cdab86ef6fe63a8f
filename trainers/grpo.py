"""GRPO and its critic-free relatives for multi-turn tool-using agents, top to bottom.

    agentgym train env=search                                   # GRPO, smollm2-135m, shipped data
    agentgym train env=search algo=rloo                         # or dr_grpo, reinforce_plus_plus,
                                                                #    reinforce_plus_plus_baseline, dapo, gspo
    agentgym train env=search model=tiny trainer.total_steps=2  # seconds, for a smoke test
    agentgym train env=search run_dir=runs/a trainer.resume=auto  # continue a killed run

(``algo=ppo`` trains a critic too: :mod:`agentgym.trainers.ppo`. Both run the one step
loop of :mod:`agentgym.trainers.loop`; what each phase does is :mod:`agentgym.trainers.phases`.)

Each step:
  1. roll out ``trainer.prompts_per_step`` prompts ``rollout.n`` times each (the
     GenerationManager; engine logprobs and the policy version land on every
     trajectory). With ``algo.dynamic_sampling`` (DAPO), groups whose rewards are all
     equal are dropped and further prompts rolled out until the step is full, for at
     most ``algo.max_sampling_rounds`` rounds;
  2. reference logprobs when ``algo.kl_coef`` > 0; the trainer's old logprobs (a
     separate pass only when the batch takes several optimizer steps or the KL penalty
     is in the reward: with one step they are the update's own forward pass); the
     engine/trainer logprob drift on sampled tokens;
  3. token rewards: each turn's env reward on the last token sampled in that turn, DAPO's
     overlong penalty (``algo.overlong_buffer``) on the last one, and the per-token KL
     penalty when ``algo.kl_mode=reward``; then the registered estimator
     ``algo.advantage`` (``grpo``, ``rloo``, ``reinforce_plus_plus``, …);
  4. ``trainer.ppo_epochs`` x ``trainer.mini_batches`` optimizer steps of the policy loss
     ``algo.policy_loss``, micro-batched under ``trainer.micro_batch_tokens`` with
     gradient accumulation, aggregated by ``algo.loss_agg_mode`` over the mini-batch;
  5. sync the new weights into the rollout engine (policy version + 1);
  6. log metrics (JSONL, TensorBoard, reward PNG) and save HF checkpoints.
"""

from __future__ import annotations

from pathlib import Path

from agentgym.config import Config
from agentgym.trainers.algos import needs_critic
from agentgym.trainers.hooks import Hooks
from agentgym.trainers.loop import train as _loop_train


def train(cfg: Config, hooks: Hooks | None = None) -> Path:
    """Run a critic-free algorithm (GRPO, RLOO, REINFORCE++, DAPO, GSPO …) as configured
    (the step loop: :mod:`agentgym.trainers.loop`); return the run directory."""
    if needs_critic(cfg.algo.advantage):
        raise ValueError(f"algo.advantage={cfg.algo.advantage!r} reads a critic's values: "
                         f"run it with trainers.ppo.train (trainers.train picks the recipe)")
    return _loop_train(cfg, hooks)
