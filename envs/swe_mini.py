"""mini-swe-agent, unmodified, trained on SWE tasks: ``env=mini-swe-agent``.

    agentgym train env=mini-swe-agent model=... data=builtin   # or data=FILE of SWE-bench rows

The PyPI package ``mini-swe-agent``'s own loop (``minisweagent.agents.default.DefaultAgent``,
with its text-based config ``mini_textbased.yaml`` and its ``LitellmTextbasedModel``) plays
each row. AgentGym supplies two things only:

* its **model**: the episode's OpenAI endpoint on the rollout engine (``base_url``,
  :mod:`agentgym.serving.agents`), which records every call's exact token ids;
* its **environment**: :class:`WorkspaceEnvironment`, mini-swe-agent's ``Environment``
  protocol (``execute``, ``get_template_vars``, ``serialize``) over the episode's sandboxed
  workspace (:class:`agentgym.tools.workspace.Workspace`): no command runs on the host.

The reward is the SWE env's harness on the workspace's diff (:mod:`agentgym.envs.swe_grade`);
a harness that cannot grade fails the episode (kept out of the gradient). Deadlines: each
call is the agents' (``deadlines.turn_s``, ``deadlines.env_step_s`` without one), the
episode's is mini-swe-agent's own ``wall_time_limit_seconds`` (``swe.episode_s``), its step
limit ``rollout.max_turns``; every ``swe.*`` key applies as in ``env=swe``.
"""

from __future__ import annotations

import logging
import os
import platform
import shlex

from agentgym.envs.agent_program import AgentProgram
from agentgym.envs.manifest import EnvManifest
from agentgym.envs.swe import SUBMIT
from agentgym.envs.swe_builtin import builtin_rows
from agentgym.envs.swe_grade import grade, repo_cache, repo_python, swe_root, workspace_root
from agentgym.envs.swe_rows import adapt_row, find_repo
from agentgym.tools.workspace import CommandLimits, Workspace

logger = logging.getLogger(__name__)


def _import_minisweagent():
    """mini-swe-agent, imported quietly: no banner, its global config under the cache, and
    litellm's model table read from its own package (no fetch)."""
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", str(swe_root() / "mini-swe-agent"))
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    os.environ.setdefault("MSWEA_COST_TRACKING", "ignore_errors")
    import litellm
    import minisweagent
    litellm.suppress_debug_info = True  # it prints a banner to stdout on each unpriced call
    return minisweagent


class WorkspaceEnvironment:
    """mini-swe-agent's ``Environment`` protocol over an episode's workspace.

    Args:
        workspace: the episode's workspace; commands run there, in ``/testbed``.
        timeout: wall seconds per command (the workspace's own limits apply too).
    """

    def __init__(self, workspace: Workspace, timeout: float) -> None:
        from pydantic import BaseModel
        wall_s = timeout

        class Config(BaseModel):
            cwd: str = "/testbed"
            timeout: float = wall_s

        self.config, self.workspace = Config(), workspace

    def execute(self, action: dict, cwd: str = "", *, timeout: float | None = None) -> dict:
        """Run ``action["command"]``; raise mini-swe-agent's ``Submitted`` on its sentinel,
        as its own environments do."""
        from minisweagent.exceptions import Submitted
        command = str(action.get("command", ""))
        if cwd:
            command = f"cd {shlex.quote(cwd)} && {command}"
        r = self.workspace.run(command, wall_s=timeout or self.config.timeout)
        notes = []
        if r.timed_out:
            notes.append(f"the command timed out after {r.duration_s:.0f} s and was killed")
        if r.output_limited:
            notes.append("the command printed too much and was killed")
        if r.quota_exceeded:
            notes.append("the workspace is over its disk quota")
        if r.error:
            notes.append(f"the sandbox failed: {r.error}")
        output = {"output": r.output, "returncode": -1 if r.exit_code is None else r.exit_code,
                  "exception_info": "; ".join(notes)}
        lines = r.output.lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT and r.exit_code == 0:
            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})
        return output

    def get_template_vars(self, **kwargs) -> dict:
        return {**self.config.model_dump(), **platform.uname()._asdict(), **kwargs}

    def serialize(self) -> dict:
        return {"info": {"config": {"environment": self.config.model_dump(mode="json"),
                                    "environment_type": f"{__name__}.WorkspaceEnvironment"}}}


class MiniSWEAgentProgram:
    """Plays one row with mini-swe-agent (see the module docstring); built with the run's
    config (:attr:`agentgym.envs.manifest.EnvManifest.program`)."""

    def __init__(self, cfg) -> None:
        import yaml
        mini = _import_minisweagent()
        from minisweagent.config import get_config_path
        self.swe, self.max_turns = cfg.section("swe"), cfg.rollout.max_turns
        self.temperature = cfg.rollout.temperature
        self.config = yaml.safe_load(get_config_path("mini_textbased.yaml").read_text())
        self.version = mini.__version__

    def play(self, row: dict, base_url: str) -> float:
        """One episode: mini-swe-agent's loop against ``base_url``; the harness's reward."""
        from minisweagent.agents.default import DefaultAgent
        from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel
        swe = self.swe
        row = adapt_row(row, "mini-swe-agent") if "reward_model" not in row else row
        base = repo_cache().base(row["repo"], find_repo(row, swe.repos), row["base_commit"])
        limits = CommandLimits(wall_s=swe.command_s, cpu_s=swe.command_s,
                               memory_mb=swe.memory_mb, max_procs=swe.max_procs,
                               disk_mb=swe.disk_mb, keep_output_bytes=swe.obs_bytes)
        python = repo_python(row, swe.python, swe.packages)
        with Workspace(base, workspace_root(), limits, python) as ws:
            model = LitellmTextbasedModel(
                **{**self.config.get("model", {}), "model_name": "openai/agentgym",
                   "cost_tracking": "ignore_errors",
                   "model_kwargs": {"api_base": base_url, "api_key": "agentgym",
                                    "temperature": self.temperature, "drop_params": True}})
            agent = DefaultAgent(model, WorkspaceEnvironment(ws, swe.command_s),
                                 **{**self.config["agent"], "step_limit": self.max_turns,
                                    "cost_limit": 0.0,
                                    "wall_time_limit_seconds": int(swe.episode_s)})
            result = agent.run(str(row["problem_statement"]))
            diff = ws.diff()
        test_limits = CommandLimits(wall_s=swe.test_s, cpu_s=swe.test_s,
                                    memory_mb=swe.memory_mb, max_procs=swe.max_procs,
                                    disk_mb=swe.disk_mb)
        g = grade(row, base, diff, workspace_root(), test_limits, swe.test_s, python)
        if g.infra:
            raise RuntimeError(f"the SWE harness could not grade {row['instance_id']}: {g.infra}")
        logger.debug("%s: mini-swe-agent %s ended %s; resolved %s", row["instance_id"],
                     self.version, result.get("exit_status"), g.resolved)
        return float(g.resolved)

    def close(self) -> None:
        pass  # each episode's workspace is removed as it ends


class MiniSWEAgentEnv(AgentProgram, env_id="agentgym/MiniSWEAgent-v0", short="mini-swe-agent"):
    """Stands for ``env=mini-swe-agent`` in the registry: mini-swe-agent plays the rows."""


MANIFEST = EnvManifest(
    presets={"rollout.max_turns": 8, "data.name": "builtin", "trainer.eval_limit": 0},
    datasets={"builtin": lambda: builtin_rows(swe_root() / "builtin")},
    adapt_row=adapt_row,
    played_by_program=True,
    program="agentgym.envs.swe_mini:MiniSWEAgentProgram",
    tool_calls_label="commands",
)
