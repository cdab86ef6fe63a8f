"""Data: ``rows`` (datasets, training and held-out rows, mixes, the answerable filter),
``answerable`` (which questions the shipped corpus can answer), ``demos`` and
``demo_builders`` (cold-start demonstrations played through the env). It may import
``agentgym.core``, ``agentgym.config``, ``agentgym.rollout`` and ``envs``.

``from agentgym.data import load_rows`` (the module this package replaced) still works
for one release, with a DeprecationWarning; import from ``agentgym.data.rows``.
"""

from agentgym._compat import deprecated_attributes

__getattr__ = deprecated_attributes(__name__, "agentgym.data.rows")
