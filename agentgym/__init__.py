"""AgentGym: reinforcement learning for multi-turn, tool-using LLM agents.

The layout, layer by layer (docs/ARCHITECTURE.md): ``core`` (the ground floor); ``tools``,
``retriever_server`` and ``models`` on it; ``envs`` on ``tools``; then ``presets``,
``config``, ``rollout``, ``data``, ``reporting`` and ``serving``; ``trainers``; ``cli`` on
top. ``envs``, ``tools``, ``trainers`` and ``retriever_server`` are folders beside this one
in the repository and subpackages of it once installed (:mod:`agentgym._compat` finds them
in a checkout). Old module paths (``agentgym.types``, ``envs``, ``trainers.grpo``, …) still
import, with a DeprecationWarning, for one release.
"""

from agentgym import _compat

_compat.install()
