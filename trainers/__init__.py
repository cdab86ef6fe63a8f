"""Training: the algorithms (``algos.py``), the recipes (``grpo.py``, ``ppo.py``,
``sft.py``), the critic (``critic.py``) and the backends (``backends/``)."""

from __future__ import annotations

from agentgym._compat import serve_old_name

serve_old_name(__name__)  # `import trainers`, the old name: it now is agentgym.trainers


def train(cfg, hooks=None):
    """Run the recipe ``cfg.algo`` needs: :mod:`agentgym.trainers.ppo` when the advantage estimator
    reads a critic's values (``gae``), else :mod:`agentgym.trainers.grpo`; first the cold start
    ``trainer.cold_start`` asks for (:mod:`agentgym.trainers.cold_start`). Returns the run dir."""
    from agentgym.trainers.algos import needs_critic
    from agentgym.trainers.cold_start import prepare
    from agentgym.trainers.grpo import check_algo
    check_algo(cfg)  # settings that clash fail before a cold start spends minutes
    cfg = prepare(cfg, hooks)
    if needs_critic(cfg.algo.advantage):
        from agentgym.trainers.ppo import train as recipe
    else:
        from agentgym.trainers.grpo import train as recipe
    return recipe(cfg, hooks)
