"""A coding agent in a repository (SWE-bench's tasks), ``agentgym/SWE-v0``.

An episode is one row of SWE-bench's schema (:mod:`agentgym.envs.swe_rows`): the agent gets
the problem statement and a workspace of the repository at ``base_commit``
(:class:`agentgym.tools.workspace.Workspace`: copy-on-write, sandboxed, no network, kept
across the episode's turns, removed at its end) and acts until it submits or runs out of
turns. Two protocols (``swe.protocol``):

* ``bash`` (mini-swe-agent's): each reply holds exactly one
  ````` ```mswea_bash_command ````` block (```` ```bash ```` is taken too); the env answers
  ``<returncode>N</returncode>`` and ``<output>…</output>`` in a user message. A command
  whose output starts with the line ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` (exit 0)
  submits: ``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``.
* ``tools`` (SWE-agent's and OpenHands'): Hermes function calls of ``bash``,
  ``str_replace_editor`` (view, create, str_replace, insert, undo_edit; run inside the
  sandbox, :mod:`agentgym.tools._swe_editor`) and ``submit``; each answered by a ``tool``
  message.

Long outputs are cut to ``swe.obs_bytes`` (head and tail, with the count of what was cut).
A reply without a command, or with two, and a malformed call are observations counted in
``malformed_actions``; a command stopped at a limit counts in ``tool_failures``.

Reward: after submit, or after the last turn's command, the workspace's diff is graded by
SWE-bench's rule (:mod:`agentgym.envs.swe_grade`): 1.0 when every FAIL_TO_PASS and
PASS_TO_PASS test passes, else 0.0. A harness that cannot grade is an infrastructure
failure. Per-episode metrics: ``resolved`` (also ``em``, the trainer's correctness),
``f2p``, ``p2p``, ``applied``, ``submitted``, ``test_s``, ``diff_lines``, with the base's
counters (turns, tool failures, malformed), and ``format_valid``: the protocol followed (a
command run, then a submit with a non-empty diff that applies). The funnel of a task:
``opened_test`` (a command named a file of the failing checks), ``opened_file`` (the file
the gold patch fixes), ``edited_file`` (the diff edits it), ``ran_tests``.
"""

from __future__ import annotations

import json
import logging
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from agentgym.core.registry import check_choices
from agentgym.envs.base import AgentEnv
from agentgym.envs.function_calling import CallError, function_tool, parse_tool_calls, tool_message
from agentgym.envs.manifest import EnvManifest
from agentgym.envs.swe_builtin import builtin_rows
from agentgym.envs.swe_demos import swe_demo
from agentgym.envs.swe_make import make_tasks
from agentgym.envs.swe_grade import (grade, repo_cache, repo_python, swe_root, validate,
                                    workspace_root)
from agentgym.envs.swe_rows import SUBMIT, adapt_row, find_repo, is_swe_row, patch_files
from agentgym.tools.workspace import CommandLimits, Workspace
from agentgym.envs.code import truncate_utf8

logger = logging.getLogger(__name__)

_BLOCK = re.compile(r"```(?:mswea_bash_command|bash|sh)[ \t]*\n(.*?)\n?```", re.DOTALL)
EDITOR = Path(__file__).resolve().parent.parent / "tools" / "_swe_editor.py"
_TOOLS_DIR = "/agentgym"

SYSTEM_BASH = (
    "You are a software engineer working in a repository at /testbed. You act by running "
    "bash commands.\n\nYour reply must contain exactly ONE bash code block with ONE command "
    "(or commands joined with && or ||), after a THOUGHT that explains it:\n\n"
    "THOUGHT: why this command.\n\n```mswea_bash_command\nyour_command_here\n```\n\n"
    "Each command runs in a new shell in /testbed; files persist, the directory and "
    "environment variables do not. There is no network.")
INSTANCE_BASH = (
    "Please solve this issue:\n\n{problem}\n\nWork step by step: find the code involved, "
    "reproduce the problem, edit the source to fix it, run the tests, and when you are done "
    f"submit with this command alone:\n\n```mswea_bash_command\necho {SUBMIT}\n```\n\n"
    "Do not edit the tests.")
INSTANCE_TOOLS = (
    "<uploaded_files>\n/testbed\n</uploaded_files>\nI've uploaded a python code repository in "
    "the directory /testbed. Consider the following issue:\n\n<issue>\n{problem}\n</issue>\n\n"
    "Make the minimal changes to non-test files in /testbed so that the issue is resolved. "
    "Find the code involved, reproduce the problem, fix it, check your fix, then call "
    "submit.")
FORMAT_ERROR = ("Format error: your reply must contain exactly one ```mswea_bash_command``` "
                "block; it contained {n}. To finish, run `echo " + SUBMIT + "` alone.")
NO_CALL = "Call a tool (bash, str_replace_editor), or submit when you are done."

TOOLS = [
    function_tool("bash", "Run a bash command in /testbed (a new shell each time; no network).",
                  {"command": {"type": "string", "description": "The command to run."}}),
    function_tool(
        "str_replace_editor",
        "View, create and edit files. view: a file with line numbers (view_range [start, "
        "end]) or a directory 2 levels deep; create: a new file (file_text); str_replace: "
        "replace old_str, which must occur exactly once, by new_str; insert: new_str after "
        "line insert_line; undo_edit: revert the last edit of path. Paths are absolute.",
        {"command": {"type": "string",
                     "enum": ["view", "create", "str_replace", "insert", "undo_edit"]},
         "path": {"type": "string"}, "file_text": {"type": "string"},
         "old_str": {"type": "string"}, "new_str": {"type": "string"},
         "insert_line": {"type": "integer"},
         "view_range": {"type": "array", "items": {"type": "integer"}}},
        required=["command", "path"]),
    function_tool("submit", "Submit your changes: the episode ends and they are graded.", {}),
]


@dataclass
class SWEConfig:
    protocol: str = "bash"  # bash (mini-swe-agent: one bash block a turn, echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT submits) | tools (bash, str_replace_editor, submit calls)
    repos: str = ""  # folder of the rows' repositories, <owner>__<name> (git folder or .bundle); a row's repo_path comes first
    python: str = ""  # the interpreter the agent's commands and the tests get as `python` ('': the repository's own environment, of swe.packages)
    packages: list[str] = field(default_factory=lambda: ["pytest"])  # the repository's environment: these installed distributions (and theirs) copied from this interpreter, once per repository
    obs_bytes: int = 10000  # of a command's output shown to the model (head and tail), bytes
    command_s: float = 60.0  # wall seconds per command (and CPU seconds per process)
    test_s: float = 300.0  # wall seconds of the harness's test run
    memory_mb: int = 2048  # address space per process, MiB
    max_procs: int = 64  # processes and threads of an episode at once
    disk_mb: int = 256  # what an episode may write to its workspace, MiB
    validate_workers: int = 2  # rows graded at once by agentgym swe validate
    episode_s: float = 1800.0  # env=mini-swe-agent: wall seconds of an episode (its wall_time_limit_seconds)
    sources: list[str] = field(default_factory=list)  # agentgym swe make-tasks: the pinned sources to make tasks of, by name ([]: all)

    def __post_init__(self) -> None:
        check_choices("swe", self, {"protocol": ("bash", "tools")})
        for key in ("obs_bytes", "command_s", "test_s", "memory_mb", "max_procs", "disk_mb",
                    "validate_workers", "episode_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"swe.{key} must be > 0, got {getattr(self, key)}")
        if self.obs_bytes < 256:
            raise ValueError(f"swe.obs_bytes must be >= 256 (room for a head and a tail), "
                             f"got {self.obs_bytes}")


def parse_bash(text: str) -> list[str]:
    """The bash blocks of a reply (mini-swe-agent's ``mswea_bash_command``, or ``bash``)."""
    return [b.strip() for b in _BLOCK.findall(text)]


def render(result, obs_bytes: int) -> str:
    """A command's result as mini-swe-agent shows it."""
    notes = []
    if result.timed_out:
        notes.append("The command timed out and was killed.")
    if result.output_limited:
        notes.append("The command printed too much and was killed.")
    if result.quota_exceeded:
        notes.append("The workspace is over its disk quota: remove files you made.")
    code = "" if result.exit_code is None else result.exit_code
    body = result.output if len(result.output.encode()) <= obs_bytes + 64 else \
        _cut(result.output, obs_bytes)
    text = f"<returncode>{code}</returncode>\n<output>\n{body}</output>"
    return "\n".join([text, *notes])


def _cut(text: str, limit: int) -> str:
    return truncate_utf8(text, limit)


class SWEEnv(AgentEnv, env_id="agentgym/SWE-v0", short="swe"):
    """Coding-agent environment over SWE-bench rows (see the module docstring).

    Args:
        protocol, repos, python, packages, obs_bytes, command_s, test_s, memory_mb,
            max_procs, disk_mb: as :class:`SWEConfig`'s.
        max_turns: actions per episode.
    """

    observation_format = "chat"

    def __init__(self, max_turns: int | None = None, protocol: str = "bash", repos: str = "",
                 python: str = "", packages: tuple[str, ...] = ("pytest",),
                 obs_bytes: int = 10000, command_s: float = 60.0, test_s: float = 300.0,
                 memory_mb: int = 2048, max_procs: int = 64, disk_mb: int = 256) -> None:
        super().__init__(max_turns=max_turns)
        SWEConfig(protocol, repos, python, list(packages), obs_bytes, command_s, test_s,
                  memory_mb, max_procs, disk_mb)  # checks the values
        self.protocol, self.repos, self.python = protocol, repos, python
        self.packages = list(packages)
        self.obs_bytes, self.test_s = obs_bytes, test_s
        self.limits = CommandLimits(wall_s=command_s, cpu_s=command_s, memory_mb=memory_mb,
                                    max_procs=max_procs, keep_output_bytes=obs_bytes,
                                    disk_mb=disk_mb)
        if protocol == "tools":
            self.tools = TOOLS
        self._ws: Workspace | None = None
        self._row: dict = {}
        self._seen: list[str] = []  # the episode's commands and the paths it edited
        self._base: Path | None = None

    def _reset(self, row):
        self._close_workspace()
        if row is None:
            row = self.pick_row(builtin_rows(swe_root() / "builtin"))
        if is_swe_row(row):
            row = adapt_row(row, "reset")
        self._row, self._seen = row, []
        self._base = repo_cache().base(row["repo"], find_repo(row, self.repos),
                                       row["base_commit"])
        self._python = repo_python(row, self.python, self.packages)
        self._ws = Workspace(self._base, workspace_root(), self.limits, self._python,
                             binds={str(EDITOR.parent): _TOOLS_DIR})
        for key in ("command_exits", "diff_lines"):
            self.count(key, 0)
        problem = str(row["problem_statement"])
        if self.protocol == "tools":
            return [{"role": "user", "content": INSTANCE_TOOLS.format(problem=problem)}], {}
        return [{"role": "system", "content": SYSTEM_BASH},
                {"role": "user", "content": INSTANCE_BASH.format(problem=problem)}], {}

    def _step(self, action, last_turn):
        if self.protocol == "tools":
            obs, submitted = self._tools_turn(action)
        else:
            obs, submitted = self._bash_turn(action)
        if submitted or last_turn:
            return [], *self._finish(submitted)
        return obs, 0.0, False, {}

    def _bash_turn(self, action: str) -> tuple[list[dict], bool]:
        blocks = parse_bash(action)
        if len(blocks) != 1:
            self.count("malformed_actions")
            return [{"role": "user", "content": FORMAT_ERROR.format(n=len(blocks))}], False
        result = self._command(blocks[0])
        if result.exit_code == 0 and result.output.lstrip().startswith(SUBMIT):
            return [], True
        return [{"role": "user", "content": render(result, self.obs_bytes)}], False

    def _tools_turn(self, action: str) -> tuple[list[dict], bool]:
        calls = parse_tool_calls(action, self.tools)
        if not calls:
            self.count("malformed_actions")
            return [{"role": "user", "content": NO_CALL}], False
        messages = []
        for call in calls:
            if isinstance(call, CallError):
                self.count("malformed_actions")
                messages.append(tool_message(call.name or "error", f"Error: {call.message}"))
            elif call.name == "submit":
                return [], True
            elif call.name == "bash":
                result = self._command(call.arguments["command"])
                messages.append(tool_message("bash", render(result, self.obs_bytes)))
            else:
                messages.append(tool_message("str_replace_editor", self._edit(call.arguments)))
        return messages, False

    def _command(self, command: str):
        self.count("tool_calls")
        self._seen.append(command)
        result = self._ws.run(command)
        if result.error:
            self.count("tool_failures")
            self.infra_failure(f"workspace: {result.error}")
        elif result.timed_out or result.output_limited or result.quota_exceeded:
            self.count("tool_failures")
        elif result.exit_code != 0:
            self.count("command_exits")  # the command failed: the agent's business
        return result

    def _edit(self, arguments: dict) -> str:
        self.count("tool_calls")
        self._seen.append(str(arguments.get("path", "")))
        r = self._ws.run(f"python -I -S {shlex.quote(_TOOLS_DIR + '/' + EDITOR.name)}",
                         stdin=json.dumps(arguments).encode())
        if r.error or r.exit_code not in (0, 1):
            self.count("tool_failures")
            if r.error:
                self.infra_failure(f"workspace: {r.error}")
            return f"Error: the editor failed ({r.error or r.output.strip()[-300:]})"
        if r.exit_code == 1:
            self.count("command_exits")
        return _cut(r.output.rstrip("\n"), self.obs_bytes)

    def _finish(self, submitted: bool) -> tuple[float, bool, dict]:
        """Grade the workspace's diff; ``(reward, terminated, info)``."""
        info = {"submitted": float(submitted), "resolved": 0.0, "em": 0.0, "f2p": 0.0,
                "p2p": 0.0, "applied": 0.0, "test_s": 0.0, "format_valid": 0.0}
        try:
            diff = self._ws.diff()
        except RuntimeError as e:
            self.infra_failure(f"workspace: {e}")
            self._close_workspace()
            return 0.0, submitted, info
        self._close_workspace()
        self.count("diff_lines", sum(1 for line in diff.splitlines()
                                     if line[:1] in "+-" and line[:3] not in ("+++", "---")))
        limits = CommandLimits(wall_s=self.test_s, cpu_s=self.test_s,
                               memory_mb=self.limits.memory_mb, max_procs=self.limits.max_procs,
                               disk_mb=self.limits.disk_mb)
        g = grade(self._row, self._base, diff, workspace_root(), limits, self.test_s,
                  self._python)
        if g.infra:
            self.infra_failure(f"harness: {g.infra}")
        ran = self._counters.get("tool_calls", 0) > 0
        info.update(resolved=float(g.resolved), em=float(g.resolved), f2p=float(g.f2p),
                    p2p=float(g.p2p), applied=float(g.applied), test_s=round(g.test_s, 3),
                    format_valid=float(submitted and ran and bool(diff) and g.applied))
        info.update(self._funnel(diff))
        if g.dropped:
            info["test_edits_dropped"] = g.dropped
        return float(g.resolved), submitted, info

    def _funnel(self, diff: str) -> dict[str, float]:
        """How far the episode got, step by step: a command (or the editor) named a file of
        the failing checks, named the file the gold patch fixes, the diff edits that file,
        a command ran the tests."""
        said = "\n".join(self._seen)
        tests = {t.split("::", 1)[0] for t in self._row["FAIL_TO_PASS"]}
        gold = set(patch_files(str(self._row["patch"])))
        return {"opened_test": float(any(f in said for f in tests)),
                "opened_file": float(any(f in said for f in gold)),
                "edited_file": float(bool(gold & set(patch_files(diff)))),
                "ran_tests": float(any(w in said for w in ("pytest", "unittest", "tox")))}

    def _close_workspace(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            ws.close()

    def close(self) -> None:
        self._close_workspace()
        super().close()


# -- what the trainer asks of the SWE env (envs.manifest) ----------------------------------
def swe_kwargs(swe: SWEConfig) -> dict:
    """``swe.*`` as the env's constructor arguments."""
    return {"protocol": swe.protocol, "repos": swe.repos, "python": swe.python,
            "packages": tuple(swe.packages),
            "obs_bytes": swe.obs_bytes, "command_s": swe.command_s, "test_s": swe.test_s,
            "memory_mb": swe.memory_mb, "max_procs": swe.max_procs, "disk_mb": swe.disk_mb}


MANIFEST = EnvManifest(
    sections={"swe": SWEConfig},
    # mini-swe-agent's default is 250 steps; on a CPU an episode's turns share one
    # response budget, so ten: the demonstrations' four to seven turns (look, edit, test,
    # submit, with a search and an empty one) and room (docs/decisions/envs-swe.md, "the tenth
    # design")
    presets={"rollout.max_turns": 10, "data.name": "train", "trainer.eval_data": "test",
             "rollout.max_response_tokens": 4096, "rollout.max_tokens_per_turn": 384,
             "sft.max_length": 5120},
    # the shipped tasks (agentgym swe make-tasks; data/README.md), split by repository, and
    # the built-in ones (a repository made on the fly, two bugs)
    datasets={"train": "swe/train.jsonl.gz", "test": "swe/test.jsonl.gz",
              "builtin": lambda: builtin_rows(swe_root() / "builtin")},
    kwargs=swe_kwargs,
    adapt_row=adapt_row,
    demonstrate=swe_demo,  # the cold start's demonstrations
    commands={"swe": {"validate": validate, "make-tasks": make_tasks}},
    reads={"out": "out", "limit": "limit", "seed": "trainer.seed"},  # make-tasks's
    episode_metrics=("resolved", "f2p", "p2p", "applied", "submitted", "test_s",
                     "diff_lines", "opened_test", "opened_file", "edited_file", "ran_tests"),
    tool_calls_label="commands",
    sources=lambda swe: {"protocol": swe.protocol, "obs_bytes": swe.obs_bytes},
)
