"""The presets a configuration is layered from (:func:`agentgym.config.build_config`):
each env's (its manifest's ``presets``), each algorithm's, the key shorthands, the keys a
mixed run may set per env,
and the recipes (``recipes/*.yaml``: a paper's or the demo's settings as dotted keys).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentgym.core.overrides import load_yaml
from agentgym.core.paths import repo_root
from agentgym.core.registry import did_you_mean

#: Per-environment overrides applied before the user's.
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
    # on-policy distillation alone: the teacher's per-token reverse KL is the whole
    # advantage (no env reward; trainer.teacher names the teacher)
    "opd": {"algo.advantage": "none", "algo.distill_coef": 1.0},
}
ALIASES = {"n": "rollout.n", "seed": "trainer.seed", "backend": "trainer.backend",
           "placement": "ray.placement", "logger": "trainer.logger"}

#: Keys a mixed run may give one value per env, in env order (``rollout.max_turns=[4,2]``
#: with ``env=[search,code]``): each env's episodes, demonstrations and held-out slice
#: follow its own value (:func:`agentgym.rollout.runtime.sub_config`); anything shared
#: (the trainer's sequence budget) takes the largest.
PER_ENV_KEYS = ("rollout.max_turns", "rollout.max_tokens_per_turn",
                "trainer.cold_start_demos", "trainer.eval_limit", "trainer.cold_start_lr",
                "trainer.teacher")
#: those of them whose values are floats, and strings (the others count things)
FLOAT_PER_ENV_KEYS = ("trainer.cold_start_lr",)
STR_PER_ENV_KEYS = ("trainer.teacher",)


def env_presets(env: str) -> dict[str, Any]:
    """The keys env ``env`` sets when chosen (its manifest's ``presets``); {} for a name no
    env has (the config's check names the valid ones)."""
    from agentgym import envs  # lazy: loads gymnasium
    try:
        return dict(envs.env_manifest(env).presets)
    except KeyError:
        return {}


def recipes_dir() -> Path:
    """The shipped recipes: ``recipes/`` at the repository root."""
    return repo_root() / "recipes"


def recipe_names() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def load_recipe(name: str) -> dict[str, Any]:
    """A recipe's keys: ``recipes/NAME.yaml`` or a ``.yaml`` file, a mapping of the same
    dotted keys the command line takes (``rollout.n: 5``), values as YAML parses them."""
    path = Path(name).expanduser() if str(name).endswith((".yaml", ".yml")) \
        else recipes_dir() / f"{name}.yaml"
    if not path.is_file():
        names = recipe_names()
        raise ValueError(f"recipe={name!r}: no such recipe{did_you_mean(str(name), names)}; "
                         f"valid: {', '.join(names)} or a path to a .yaml file")
    # yes/no/on/off stay words, as on the command line (trainer.cold_start: off)
    keys = load_yaml(path.read_text(encoding="utf-8")) or {}
    # a mapping under a dotted key is that key's value (reasoning_gym.config: {...}); under
    # a section's name it is the nested form this file does not take
    if not isinstance(keys, dict) or any(isinstance(v, dict) and "." not in str(k)
                                         for k, v in keys.items()):
        raise ValueError(f"recipe {path}: expected a mapping of dotted keys to values "
                         f"(rollout.n: 5), got {type(keys).__name__}"
                         f"{' with a nested section' if isinstance(keys, dict) else ''}")
    return {str(k): v for k, v in keys.items()}
