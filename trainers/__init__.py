"""Training: the algorithms (``algos.py``), the recipes (``grpo.py``, ``ppo.py``,
``sft.py``), the critic (``critic.py``) and the backends (``backends/``)."""

from __future__ import annotations


def train(cfg, hooks=None):
    """Run ``agentgym train``: the algorithm's settings checked once (:func:`agentgym.trainers.
    phases.check_algo`, before a cold start spends minutes), the cold start
    ``trainer.cold_start`` asks for (:mod:`agentgym.trainers.cold_start`), then the step loop
    (:mod:`agentgym.trainers.loop`, a critic's phases when the estimator reads values).
    Returns the run dir."""
    from agentgym.trainers.cold_start import prepare
    from agentgym.trainers.loop import run
    from agentgym.trainers.phases import check_algo
    check_algo(cfg)
    return run(prepare(cfg, hooks), hooks)
