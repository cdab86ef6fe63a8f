"""The names a run's config may choose, each stated once, here, for the unit that owns it.

``agentgym.config`` sits below the trainers and the rollout, and ``agentgym config`` and
``agentgym plan`` load no torch, so the names and their flags live in this torch-free unit.
Each owner takes its names from here and implements them (a test keeps every owner's
implementations equal to its names); the config validates against them.

Each vocabulary, its owner and the config key it checks:

- :data:`ADVANTAGES`: ``trainers.algos.ADVANTAGES`` (registered estimators); ``algo.advantage``
- :data:`POLICY_LOSSES`: ``trainers.algos.POLICY_LOSSES``; ``algo.policy_loss``
- :data:`LOSS_AGG_MODES`: ``trainers.algos.aggregate``; ``algo.loss_agg_mode``
- :data:`KL_ESTIMATORS`: ``trainers.algos.kl_estimate``; ``algo.kl_estimator``
- :data:`KL_MODES`: ``trainers.phases`` (the penalty's place); ``algo.kl_mode``
- :data:`OFF_POLICY_MODES`: ``trainers.rollout_correction.behaviour_weights``; ``algo.off_policy``
- :data:`CONTEXT_STRATEGIES`: ``rollout.context`` (besides ``module:function``); ``rollout.context``
- :data:`WEIGHT_SYNC_MODES`: ``rollout.engines.sglang_weights``; ``engine.weight_sync``
- :data:`BACKENDS`: ``trainers.backends.factory.make_backend``; ``trainer.backend``
- :data:`ZERO_STAGES`: ``trainers.backends.ranks`` (DeepSpeed's ZeRO); ``trainer.zero_stage``
- :data:`LR_SCHEDULES`: ``trainers.backends.single.lr_lambda``; ``trainer.lr_schedule``
- :data:`MIXED_PRECISIONS`: ``core.device.mixed_precision``; ``trainer.mixed_precision``
- :data:`ON_INFRA_ERROR`: ``rollout.manager`` and ``trainers.collection``; ``rollout.on_infra_error``

An estimator registered outside the project (``trainers.algos.estimator("mine",
needs_critic=True)``) adds its name and flags here, so a config built after it accepts it.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentgym.core.registry import did_you_mean


@dataclass(frozen=True)
class Estimator:
    """What an advantage estimator reads besides the rewards."""

    needs_critic: bool = False  # a critic's values: a value model trains beside the policy
    needs_groups: bool = False  # the other samples of its prompt: rollout.n >= 2


#: the advantage estimators and their flags (``trainers.algos`` registers one function each)
ADVANTAGES: dict[str, Estimator] = {
    "grpo": Estimator(needs_groups=True),
    "rloo": Estimator(needs_groups=True),
    "reinforce_plus_plus": Estimator(),
    "reinforce_plus_plus_baseline": Estimator(needs_groups=True),
    "gae": Estimator(needs_critic=True),
    "none": Estimator(),  # zeros: on-policy distillation alone (algo=opd)
    "mt_grpo": Estimator(needs_groups=True),  # turn-level (trainers.turn_credit)
    "gigpo": Estimator(needs_groups=True),
    "gae_turn": Estimator(needs_critic=True),
}
POLICY_LOSSES = ("ppo_clip", "dual_clip", "gspo")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3", "abs")
KL_MODES = ("loss", "reward")
OFF_POLICY_MODES = ("recompute", "decoupled", "tis", "seq_tis", "geo_tis", "mis", "seq_mis",
                    "geo_mis")
CONTEXT_STRATEGIES = ("keep", "drop_observations", "summarize")
WEIGHT_SYNC_MODES = ("disk", "distributed", "tensor")
BACKENDS = ("single", "fsdp", "deepspeed")
SHARDED_BACKENDS = BACKENDS[1:]  # rank processes, each holding a shard
ZERO_STAGES = (1, 2, 3)
LR_SCHEDULES = ("constant", "cosine")  # after the linear warmup
MIXED_PRECISIONS = ("", "bf16", "fp32")  # "": bf16 autocast on a GPU, fp32 on the CPU
ON_INFRA_ERROR = ("retry", "drop", "keep")  # a tool failure not the policy's


def estimator(name: str) -> Estimator:
    """The flags of the estimator ``name``; an unknown one fails with the valid names."""
    if name not in ADVANTAGES:
        raise ValueError(f"algo.advantage={name!r}{did_you_mean(name, list(ADVANTAGES))}; "
                         f"valid: {', '.join(ADVANTAGES)}")
    return ADVANTAGES[name]
