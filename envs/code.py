"""Math with a code interpreter (ReTool protocol), ``agentgym/Code-v0``.

The model reasons in text and writes python as ``<code>```python …```</code>``
(generation stops at ``</code>``); the env runs it in a sandbox and appends
``\\n<interpreter>\\n{output}\\n</interpreter>\\n\\n`` inline, as in ReTool's data. The
episode ends at the first action with a non-empty ``\\boxed{…}`` outside code (ReTool asks
for ``<answer>\\n\\boxed{…}\\n</answer>``; generation also stops at ``</answer>``), or,
without one, at ``#### N`` outside code (the form verl's GSM8K prompt asks for). Reward:
1.0 if the boxed answer is equivalent to ``reward_model.ground_truth``
(:func:`agentgym.envs.math_reward.is_equivalent`), else 0.0; ``info["em"]`` is that correctness.

The interpreter output is stdout then stderr, cut to ``obs_bytes`` UTF-8 bytes (head and
tail kept, a marker in between), followed by a short notice for a timeout, the memory
limit or a sandbox failure (each counts in ``tool_failures``; code that merely raises
counts in ``code_errors``). As in a notebook, the sandbox prints the repr of a bare final
expression. Code on the last allowed turn is not run (its output could not be used). An
action with neither code nor an answer, or with empty code, counts in
``malformed_actions`` and gets a corrective observation.

Turn reward (off by default): with ``run_reward > 0``, the first cell of an episode that
runs without error (exit code 0, no timeout, memory or sandbox failure) earns that much on
its turn, for turn-level credit (``algo.advantage=mt_grpo|gigpo``,
:mod:`agentgym.trainers.turn_credit`). Paid once per episode: printing ``1`` every turn earns
nothing
more; the episode's return is the run reward plus the answer's.
"""

from __future__ import annotations

import functools
import logging
import re
import uuid
from dataclasses import asdict, dataclass

from agentgym.core.registry import check_choices
from agentgym.envs import arith
from agentgym.envs.base import AgentEnv
from agentgym.envs.code_demos import code_demo
from agentgym.envs.code_prompt import code_row, make_prompt, make_tools_prompt  # noqa: F401
from agentgym.envs.function_calling import CallError, function_tool, parse_tool_calls, tool_message
from agentgym.envs.manifest import EnvManifest
from agentgym.envs.math_reward import extract_boxed, is_equivalent
from agentgym.tools.sandbox import Limits, LocalSandbox, SandboxConfig, make_sandbox

logger = logging.getLogger(__name__)
_SANDBOXES: dict[str, object] = {}  # sandbox config (JSON) -> the sandbox built for it

_CODE = re.compile(r"<code>(.*?)</code>", re.DOTALL)
_NOT_PROSE = re.compile(r"<code>.*?(?:</code>|$)|```.*?```", re.DOTALL)
_HASHES = re.compile(r"#### (-?[0-9.,]+)")  # verl's GSM8K answer (reward_score/gsm8k.py)
_FENCE = re.compile(r"```[\w+-]*[ \t]*\n?(.*?)(?:```|$)", re.DOTALL)
INVALID_ACTION = ("\nMy previous action is invalid. If I want to execute code, I should put "
                  "the code between <code> and </code>. If I want to give the final answer, I "
                  "should put \\boxed{answer} between <answer> and </answer>. "
                  "Let me try again.\n")
NO_CODE = "No Python code found between <code> and </code>."
NO_CALL = ("Call the python tool, or give the final answer as <answer>\\boxed{...}</answer>.")

#: Used by ``reset()`` without a dataset row (contract checks, smoke tests).
BUILTIN_PROBLEMS = [
    ("Tom has 3 boxes with 12 apples in each box. He eats 5 apples. How many apples are "
     "left?", "31"),
    ("A train travels 60 km per hour for 2.5 hours. How many kilometres does it travel?",
     "150"),
    ("A shirt costs $20 and is on sale for 15% off. What is the sale price in dollars?", "17"),
    ("What is the sum of the integers from 1 to 100?", "5050"),
]


def parse_action(text: str) -> tuple[str | None, str]:
    """``("answer", boxed)`` if a non-empty box is outside code (else the last ``#### N``
    there: verl's GSM8K answer form), else ``("code", code)`` for the first
    ``<code>…</code>`` (fences stripped), else ``(None, "")``."""
    prose = _NOT_PROSE.sub("", text)
    boxed = extract_boxed(prose)
    if boxed:
        return "answer", boxed
    hashes = _HASHES.findall(prose)
    if hashes:
        return "answer", hashes[-1].replace(",", "")
    m = _CODE.search(text)
    if m is None:
        return None, ""
    code = m.group(1)
    fenced = _FENCE.search(code)
    return "code", (fenced.group(1) if fenced else code).strip()


def truncate_utf8(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` UTF-8 bytes: head and tail, a marker saying what was
    cut between them; never splits a character."""
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    room = limit - len(f"\n[... {len(data)} bytes truncated ...]\n".encode())
    head = data[:room // 2].decode("utf-8", "ignore")
    tail = data[len(data) - (room - room // 2):].decode("utf-8", "ignore")
    cut = len(data) - len(head.encode()) - len(tail.encode())
    return f"{head}\n[... {cut} bytes truncated ...]\n{tail}"


@dataclass
class CodeConfig:
    obs_bytes: int = 1024  # interpreter output shown to the model (env=code), bytes
    protocol: str = "tags"  # tags (ReTool's <code> text) | tools (a python function, Hermes <tool_call>)
    run_reward: float = 0.0  # turn reward: the first cell of an episode that runs without error (0 = off)

    def __post_init__(self) -> None:
        check_choices("code", self, {"protocol": ("tags", "tools")})
        if self.run_reward < 0:
            raise ValueError(f"code.run_reward must be >= 0, got {self.run_reward}")


class CodeEnv(AgentEnv, env_id="agentgym/Code-v0", short="code"):
    """ReTool code-interpreter environment.

    Args:
        sandbox: a :class:`agentgym.tools.sandbox.Sandbox` shared by many envs (never closed here).
            None: a default ``LocalSandbox`` is created on first use and closed with the env.
        obs_bytes: interpreter output shown to the model, in UTF-8 bytes (>= 64).
        stateful: each episode runs its cells in one sandbox session (variables persist
            from cell to cell); the session is closed when the episode ends.
        max_turns: actions per episode (code cells plus the answer).
        protocol: ``tags`` (ReTool's ``<code>`` / ``<interpreter>`` text) or ``tools`` (a
            ``python`` function tool: Hermes ``<tool_call>`` blocks, any number per turn,
            each run and answered by a ``tool`` message; a turn without a call must hold
            the ``\\boxed{}`` answer).
    """

    observation_format = "inline"
    stop_strings = ("</code>", "</answer>")

    def __init__(self, sandbox=None, obs_bytes: int = 1024, stateful: bool = False,
                 max_turns: int | None = None, protocol: str = "tags",
                 run_reward: float = 0.0) -> None:
        super().__init__(max_turns=max_turns)
        if run_reward < 0:
            raise ValueError(f"run_reward must be >= 0, got {run_reward}")
        self.run_reward, self._ran, self._ran_now = run_reward, False, False
        if protocol not in ("tags", "tools"):
            raise ValueError(f"code.protocol={protocol!r}; valid: tags, tools")
        self.protocol = protocol
        if protocol == "tools":
            self.tools = [function_tool("python", "Run a Python script; returns its stdout "
                                        "and stderr.", {"code": {"type": "string"}})]
            self.observation_format, self.stop_strings = "chat", ()
        if obs_bytes < 64:
            raise ValueError(f"obs_bytes must be >= 64 (room for the truncation marker), "
                             f"got {obs_bytes}")
        self.obs_bytes, self.stateful = obs_bytes, stateful
        self._sandbox, self._owns_sandbox = sandbox, sandbox is None
        self._golds: list[str] = []
        self._uid, self._episodes, self._session = uuid.uuid4().hex[:12], 0, None

    def _box(self):
        if self._sandbox is None:
            self._sandbox = LocalSandbox(Limits())
        return self._sandbox

    def _reset(self, row):
        self._end_session()
        self._ran = False  # has a cell run without error (the run reward is paid once)
        self.count("code_errors", 0)  # code that ran and exited non-zero (not a tool failure)
        if row is None:
            row = code_row(*self.pick_row(BUILTIN_PROBLEMS))
        gold = row["reward_model"]["ground_truth"]
        self._golds = [str(g) for g in gold] if isinstance(gold, list) else [str(gold)]
        if self.stateful:
            self._episodes += 1
            self._session = f"code-{self._uid}-{self._episodes}"
        question = (row.get("extra_info") or {}).get("question")
        if self.protocol == "tools" and question:  # the row's prompt teaches the tags
            return [{"role": "user", "content": make_tools_prompt(question)}], \
                {"ground_truth": self._golds}
        return [dict(m) for m in row["prompt"]], {"ground_truth": self._golds}

    def _step(self, action, last_turn):
        self._ran_now = False  # set by _run when a cell of this turn runs without error
        if self.protocol == "tools":
            return self._tools_step(action, last_turn)
        kind, content = parse_action(action)
        if kind == "answer":
            self._end_session()
            em = float(any(is_equivalent(content, g) for g in self._golds))
            return [], em, True, {"em": em, "answer": content, "ground_truth": self._golds}
        if last_turn:
            self._end_session()
        if kind == "code" and content:
            self.count("tool_calls")
            if last_turn:  # no turn left to use the output
                return [], 0.0, False, {"em": 0.0, "ground_truth": self._golds}
            out = self._interpreter(self._run(content))
            return [out], self._run_paid(), False, {}
        self.count("malformed_actions")
        info = {"em": 0.0, "ground_truth": self._golds} if last_turn else {}
        if kind == "code":
            return [self._interpreter(NO_CODE)], 0.0, False, info
        return [{"role": "tool", "content": INVALID_ACTION}], 0.0, False, info

    def _tools_step(self, action: str, last_turn: bool):
        calls = parse_tool_calls(action, self.tools)
        if not calls:
            boxed = extract_boxed(_NOT_PROSE.sub("", action))
            if boxed:
                self._end_session()
                em = float(any(is_equivalent(boxed, g) for g in self._golds))
                return [], em, True, {"em": em, "answer": boxed, "ground_truth": self._golds}
            self.count("malformed_actions")
            info = {"em": 0.0, "ground_truth": self._golds} if last_turn else {}
            if last_turn:
                self._end_session()
            return [{"role": "user", "content": NO_CALL}], 0.0, False, info
        if last_turn:  # no turn left to use the output
            self._end_session()
            return [], 0.0, False, {"em": 0.0, "ground_truth": self._golds}
        messages = []
        for call in calls:
            if isinstance(call, CallError):
                self.count("malformed_actions")
                messages.append(tool_message(call.name or "error", f"Error: {call.message}"))
            elif not call.arguments["code"].strip():
                self.count("malformed_actions")
                messages.append(tool_message("python", f"Error: {NO_CODE}"))
            else:
                self.count("tool_calls")
                messages.append(tool_message("python", self._run(call.arguments["code"])))
        return messages, self._run_paid(), False, {}

    def _run_paid(self) -> float:
        """The turn reward of this turn's cells: ``run_reward`` when one ran without error
        and none had before in the episode."""
        if self._ran_now and not self._ran:
            self._ran = True
            return self.run_reward
        return 0.0

    def _run(self, code: str) -> str:
        try:
            r = self._box().run_sync(code, session=self._session)
        except Exception as e:  # noqa: BLE001 - any sandbox fault is an observation
            self.count("tool_failures")
            self.infra_failure(f"sandbox: {type(e).__name__}: {e}")
            logger.warning("sandbox failed (%s): %s", type(e).__name__, e)
            return f"Sandbox error ({type(e).__name__}): {str(e)[:200]}. The code did not run."
        sep = "\n" if r.stdout and r.stderr and not r.stdout.endswith("\n") else ""
        text = truncate_utf8(r.stdout + sep + r.stderr, self.obs_bytes).rstrip()
        failed = bool(r.error or r.timed_out or r.memory_exceeded or r.exit_code in (-9, -24))
        if r.error:
            notes = [f"Sandbox error: {r.error[:200]}"]
        elif r.timed_out or r.exit_code == -24:
            notes = [f"Timeout: execution stopped after {r.duration_s:.1f}s (time limit)."]
        elif r.memory_exceeded:  # the traceback may already say so
            notes = [] if "MemoryError" in text else ["MemoryError: stopped at the memory limit."]
        elif r.exit_code == -9:
            notes = ["Killed (SIGKILL)."]
        elif r.truncated:
            notes = ["Output limit: the code printed too much and was stopped."]
        elif r.exit_code != 0 and not r.stderr:
            notes = [f"(exit code {r.exit_code})"]
        else:
            notes = []
        if self.stateful and r.session_reset:
            notes.append("The interpreter was restarted: earlier variables are gone.")
        if failed:
            self.count("tool_failures")
        if r.error:  # the sandbox could not run the code (failed to start, broke protocol)
            self.infra_failure(f"sandbox: {r.error[:300]}")
        elif r.exit_code == -9 and not r.timed_out and r.duration_s < self._cpu_limit_s():
            # SIGKILL, yet not the CPU limit's (that takes at least cpu_s) nor the sandbox's
            self.infra_failure("sandbox: the code's process was killed (SIGKILL) from "
                               "outside the sandbox (the host's OOM killer or an operator)")
        elif not failed and r.exit_code != 0:
            self.count("code_errors")
        elif not failed:
            self._ran_now = True
        return "\n".join([text, *notes] if text else notes)

    def _cpu_limit_s(self) -> float:
        """The sandbox's CPU-seconds limit (its hard limit kills with SIGKILL)."""
        limits = getattr(self._box(), "limits", None)
        return float(getattr(limits, "cpu_s", 0.0))

    @staticmethod
    def _interpreter(text: str) -> dict:
        return {"role": "tool", "content": f"\n<interpreter>\n{text}\n</interpreter>\n\n"}

    def _end_session(self) -> None:
        session, self._session = self._session, None
        if session is not None and self._sandbox is not None:
            try:
                self._sandbox.close_session(session)
            except Exception as e:  # noqa: BLE001 - cleanup must not fail an episode
                logger.warning("closing sandbox session %s failed: %s", session, e)

    def close(self) -> None:
        self._end_session()
        if self._owns_sandbox and self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None
        super().close()


# -- what the trainer asks of the code env (envs.manifest) ---------------------------------
def code_kwargs(code: CodeConfig, sandbox: SandboxConfig) -> dict:
    """``code.*`` and ``sandbox.*``: one sandbox per process and sandbox config, shared by
    every env of every factory (a trainer builds a factory per eval), with its own
    concurrency bound; closed at exit."""
    import atexit
    import json

    key = json.dumps(asdict(sandbox), sort_keys=True)
    if key not in _SANDBOXES:
        _SANDBOXES[key] = make_sandbox(sandbox)
        atexit.register(_SANDBOXES[key].close)
        logger.info("started %s sandbox (%s)", sandbox.backend, _SANDBOXES[key].backend)
    return {"sandbox": _SANDBOXES[key], "obs_bytes": code.obs_bytes, "protocol": code.protocol,
            "run_reward": code.run_reward, "stateful": sandbox.stateful}


MANIFEST = EnvManifest(
    sections={"code": CodeConfig, "sandbox": SandboxConfig},
    reads={"max_cells": "sft.max_cells"},
    # ReTool allows many code cells (verl's recipe: 16 turns, 16k tokens). On CPU: 4 actions
    # (up to 3 cells, then the answer) fit the 1024-token response budget when cells print
    # short results, as GSM8K's do; the manager truncates when they don't. GPU users raise
    # rollout.max_turns and rollout.max_response_tokens together.
    presets={"rollout.max_turns": 4, "trainer.eval_data": "gsm8k"},
    datasets={"train": "math/gsm8k_train.jsonl.gz", "gsm8k": "math/gsm8k_test.jsonl",
              "math500": "math/math500.jsonl", "aime24": "math/aime24.jsonl",
              "arith_test": "arith/test.jsonl", "arith": arith.train_rows,
              **{f"arith_test_l{k}": functools.partial(arith.shipped_test_rows, k)
                 for k in arith.LEVELS}},
    kwargs=code_kwargs,
    demonstrate=code_demo,  # the cold start's demonstrations
    demo_options=lambda max_cells: {"max_cells": max_cells},
    demo_requires={"code.protocol": "tags"},  # the builder writes the text tags
    # what the observations come from: the sandbox and how much of its output the model sees
    sources=lambda code, sandbox: {"sandbox": asdict(sandbox), "obs_bytes": code.obs_bytes},
)
