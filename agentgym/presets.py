"""The presets a configuration is layered from (:func:`agentgym.config.build_config`):
each env's, each algorithm's, the key shorthands, and the keys a mixed run may set per env.
"""

from __future__ import annotations

from typing import Any

#: Per-environment overrides applied before the user's.
ENV_PRESETS: dict[str, dict[str, Any]] = {
    "search": {},  # Search-R1's budgets are the dataclass defaults
    # ReTool allows many code cells (verl's recipe: 16 turns, 16k tokens). On CPU: 4
    # actions (up to 3 cells, then the answer) fit the 1024-token response budget when
    # cells print short results, as GSM8K's do; the manager truncates when they don't.
    # GPU users raise rollout.max_turns and rollout.max_response_tokens together.
    "code": {"rollout.max_turns": 4, "trainer.eval_data": "gsm8k"},
    # an answer, and one retry when it has no \boxed{} (geometry.tool=true: allow more turns)
    "geometry": {"rollout.max_turns": 2, "trainer.eval_data": "test"},
}
#: ``algo=NAME``: the keys each algorithm sets, applied after the env preset and the
#: command's defaults, before the user's overrides. Names follow verl's estimators.
ALGO_PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {},
    # Dr. GRPO (Liu et al. 2025): no std division, token sums over a constant length
    "dr_grpo": {"algo.norm_adv_by_std": False, "algo.loss_agg_mode": "seq-mean-token-sum-norm"},
    "rloo": {"algo.advantage": "rloo"},
    # REINFORCE++: a KL penalty (when algo.kl_coef > 0) goes into the token rewards, as k1
    # (in a reward only the score-function gradient flows, and for k3 that one is biased)
    "reinforce_plus_plus": {"algo.advantage": "reinforce_plus_plus", "algo.kl_mode": "reward",
                            "algo.kl_estimator": "k1"},
    "reinforce_plus_plus_baseline": {"algo.advantage": "reinforce_plus_plus_baseline",
                                     "algo.kl_mode": "reward", "algo.kl_estimator": "k1"},
    # DAPO (Yu et al. 2025): clip-higher, token-mean, dynamic sampling, overlong shaping
    "dapo": {"algo.clip_high": 0.28, "algo.loss_agg_mode": "token-mean",
             "algo.dynamic_sampling": True, "algo.overlong_buffer": 256},
    "gspo": {"algo.policy_loss": "gspo", "algo.clip_low": 3e-4, "algo.clip_high": 4e-4,
             "algo.loss_agg_mode": "seq-mean-token-mean"},
    # PPO with a critic and GAE; one sample per prompt (no groups needed)
    "ppo": {"algo.advantage": "gae", "rollout.n": 1},
}
ALIASES = {"n": "rollout.n", "seed": "trainer.seed", "backend": "trainer.backend",
           "placement": "ray.placement", "logger": "trainer.logger"}

#: Keys a mixed run may give one value per env, in env order (``rollout.max_turns=[4,2]``
#: with ``env=[search,code]``): each env's episodes, demonstrations and held-out slice
#: follow its own value (:func:`agentgym.rollout.runtime.sub_config`); anything shared
#: (the trainer's sequence budget) takes the largest.
PER_ENV_KEYS = ("rollout.max_turns", "rollout.max_tokens_per_turn",
                "trainer.cold_start_demos", "trainer.eval_limit")
