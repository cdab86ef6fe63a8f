"""Training: the algorithms (``algos.py``), the recipes (``grpo.py``, ``ppo.py``,
``sft.py``), the critic (``critic.py``) and the backends (``backends/``)."""

from __future__ import annotations


def train(cfg, hooks=None):
    """Run the recipe ``cfg.algo`` needs: :mod:`trainers.ppo` when the advantage estimator
    reads a critic's values (``gae``), else :mod:`trainers.grpo`. Returns the run dir."""
    from trainers.algos import needs_critic
    if needs_critic(cfg.algo.advantage):
        from trainers.ppo import train as recipe
    else:
        from trainers.grpo import train as recipe
    return recipe(cfg, hooks)
