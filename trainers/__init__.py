"""Training: the algorithms (``algos.py``), the recipes (``grpo.py``, ``ppo.py``,
``sft.py``), the critic (``critic.py``) and the backends (``backends/``)."""

from __future__ import annotations


def train(cfg, hooks=None):
    """Run the recipe ``cfg.algo`` needs: :mod:`trainers.ppo` when the advantage estimator
    reads a critic's values (``gae``), else :mod:`trainers.grpo`; first the cold start
    ``trainer.cold_start`` asks for (:mod:`trainers.cold_start`). Returns the run dir."""
    from trainers.algos import needs_critic
    from trainers.cold_start import prepare
    from trainers.grpo import check_algo
    check_algo(cfg)  # settings that clash fail before a cold start spends minutes
    cfg = prepare(cfg, hooks)
    if needs_critic(cfg.algo.advantage):
        from trainers.ppo import train as recipe
    else:
        from trainers.grpo import train as recipe
    return recipe(cfg, hooks)
