"""Data: ``rows`` (datasets, training and held-out rows, mixes, the env's row filter
applied), ``demos`` and ``demo_builders`` (cold-start demonstrations played through the
env). It may import ``agentgym.core``, ``agentgym.config``, ``agentgym.rollout`` and
``agentgym.envs``.
"""
