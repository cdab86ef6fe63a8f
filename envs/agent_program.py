"""``env=agent``: the rows are played by the user's agent program (``agent=pkg.mod:run``,
:mod:`agentgym.serving.agents`), not stepped by an env. It is registered so ``env=agent``
resolves like any env; stepping it is an error that says so, and ``agentgym check-env``
reports it as skipped."""

from __future__ import annotations

from agentgym.envs.base import AgentEnv, NotSteppable
from agentgym.envs.manifest import EnvManifest


class PlayedByProgram(NotSteppable):
    """``env=agent`` is driven by ``agent=``; it has no step loop to check or run."""


class AgentProgram(AgentEnv, env_id="agentgym/Agent-v0", short="agent"):
    """Stands for ``env=agent`` in the registry (see the module docstring)."""

    def __init__(self, max_turns: int | None = None) -> None:
        raise PlayedByProgram("env=agent is played by the agent= program (agent=pkg.mod:run, "
                              "docs/ECOSYSTEM.md); it is not an env to step")

    def _reset(self, row):  # pragma: no cover - never constructed
        raise PlayedByProgram("env=agent is played by agent=")

    def _step(self, action, last_turn):  # pragma: no cover - never constructed
        raise PlayedByProgram("env=agent is played by agent=")


MANIFEST = EnvManifest(
    # the user's agent program plays the rows (agent=); data= names them, no held-out set
    presets={"trainer.eval_limit": 0, "data.answerable_only": False},
    plays_any_rows=True,  # an agent program plays any env's rows
    played_by_program=True,
)
