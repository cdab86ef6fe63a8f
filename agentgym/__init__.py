"""AgentGym: reinforcement learning for multi-turn, tool-using LLM agents.

The layout, layer by layer (docs/ARCHITECTURE.md): ``core`` (the ground floor); ``tools``,
``retriever_server`` and ``models`` on it; ``envs`` on ``tools``; then ``presets``,
``config``, ``rollout``, ``data``, ``reporting`` and ``serving``; ``trainers``; ``cli`` on
top. ``envs``, ``tools``, ``trainers`` and ``retriever_server`` are folders beside this one
in the repository and subpackages of it once installed (:mod:`agentgym._layout` finds them
in a checkout).
"""

from agentgym import _layout

_layout.install()
