"""AgentGym: reinforcement learning for multi-turn, tool-using LLM agents.

The layout, layer by layer (docs/ARCHITECTURE.md): ``core`` (the ground floor), then
``config``, ``models``, ``rollout``, ``data``, ``reporting`` and ``serving``, and ``cli`` on
top; ``envs``, ``tools`` and ``retriever_server`` sit on ``core``, ``trainers`` under ``cli``.
Old module paths (``agentgym.types``, ``agentgym.manager``, …) still import, with a
DeprecationWarning, for one release (:mod:`agentgym._compat`).
"""

from agentgym import _compat

_compat.install()
