"""Tools served over MCP, ``agentgym/MCP-v0`` (``env=mcp``).

The env's tools are an MCP server's (:mod:`agentgym.tools.mcp_client`): ``mcp.command="python
server.py"`` launches one over stdio, ``mcp.url=http://host:8000/mcp`` reaches one over
streamable HTTP; without either, the calculator of :mod:`agentgym.tools.mcp_calculator`. Its tools
reach the prompt as OpenAI function schemas (their input schemas unchanged), through the
envs' function calling (:mod:`agentgym.envs.function_calling`): the model calls them in Hermes
``<tool_call>`` blocks, each call goes to the server through MCP, and its result comes
back as a ``tool`` message. A call that does not parse or fit its schema, or that the
server answers with an error, is an observation saying so (``malformed_actions`` /
``tool_failures``); a server that cannot be reached or does not answer is an
infrastructure failure too (:meth:`~agentgym.envs.base.AgentEnv.infra_failure`).

A reply without a tool call is the answer: the text inside ``<answer>…</answer>`` if there
is one, else the whole reply. Reward: its normalized exact match with
``reward_model.ground_truth`` (a string, a list or ``{"target": …}``); ``reward=`` replaces
it with the user's function or a judge (:mod:`agentgym.envs.plugins`), as for every env.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from agentgym.envs.base import AgentEnv
from agentgym.envs.function_calling import CallError, parse_tool_calls, tool_message
from agentgym.envs.manifest import EnvManifest
from agentgym.envs.rewards import exact_match
from agentgym.tools.errors import ToolError, ToolTimeout, ToolUnavailable

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
PROMPT = ("Use the tools to work out the answer. When you have it, reply without a tool call "
          "and give it as <answer> ... </answer>.\n\nQuestion: {question}")
NO_TOOLS = "No tool call and no <answer> ... </answer>; call a tool or give the answer."

#: used by ``reset()`` without a dataset row (contract checks) with the default calculator
BUILTIN_PROBLEMS = [("What is 1234 multiplied by 5678?", "7006652"),
                    ("What is 98765 minus 43210?", "55555"),
                    ("What is 3 divided by 8?", "0.375")]


def mcp_row(question: str, answer: str, source: str = "builtin") -> dict:
    """A verl-format row for the MCP env."""
    return {"data_source": source,
            "prompt": [{"role": "user", "content": PROMPT.format(question=question)}],
            "ability": "tool-use", "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"question": question}, "env": "mcp"}


def calc_rows(n: int, seed: int) -> list[dict]:
    """``n`` calculator questions (``data=calc``: seed 0, ``data=calc_test``: seed 1) whose
    numbers are too long to multiply in one's head: the tools are the way to the answer."""
    import random
    rng, rows = random.Random(seed), []
    for i in range(n):
        a, b = rng.randint(100, 9999), rng.randint(100, 9999)
        op, word, value = rng.choice([("+", "plus", a + b), ("-", "minus", a - b),
                                      ("*", "multiplied by", a * b)])
        row = mcp_row(f"What is {a} {word} {b}?", str(value), f"calc{op}")
        row["extra_info"]["index"] = i
        rows.append(row)
    return rows


def golds_of(row: dict) -> list[str]:
    gold = row["reward_model"]["ground_truth"]
    if isinstance(gold, dict):
        gold = gold.get("target", "")
    return [str(g) for g in gold] if isinstance(gold, list) else [str(gold)]


@dataclass
class MCPConfig:  # env=mcp: the MCP server whose tools the env offers (neither: a calculator)
    command: str = ""  # launched, spoken to over stdio: "python my_server.py"
    url: str = ""  # or reached over streamable HTTP: http://host:8000/mcp
    timeout_s: float = 30.0  # one tool call


class MCPEnv(AgentEnv, env_id="agentgym/MCP-v0", short="mcp"):
    """An MCP server's tools as a multi-turn function-calling env.

    Args:
        command / url: the server (see the module docstring); neither: the calculator.
        timeout_s: one tool call's budget.
        server: an already connected :class:`agentgym.tools.mcp_client.MCPTools` (else the
            process's shared connection to ``command`` / ``url``).
        max_turns: actions per episode (tool-call turns plus the answer).
    """

    observation_format = "chat"

    def __init__(self, command: str = "", url: str = "", timeout_s: float = 30.0,
                 server=None, max_turns: int | None = None) -> None:
        super().__init__(max_turns=max_turns)
        if server is None:
            from agentgym.tools.mcp_client import shared  # lazy: loads httpx
            server = shared(command, url, timeout_s)
        self.server = server
        self.tools = server.schemas
        self._golds: list[str] = []

    def _reset(self, row):
        if row is None:
            row = mcp_row(*self.pick_row(BUILTIN_PROBLEMS))
        self._golds = golds_of(row)
        return [dict(m) for m in row["prompt"]], {"ground_truth": self._golds}

    def _step(self, action, last_turn):
        calls = parse_tool_calls(action, self.tools)
        if not calls:
            m = _ANSWER.search(action)
            answer = (m.group(1) if m else action).strip()
            if not answer:
                self.count("malformed_actions")
                info = {"em": 0.0, "ground_truth": self._golds} if last_turn else {}
                return [{"role": "user", "content": NO_TOOLS}], 0.0, False, info
            em = exact_match(answer, self._golds)
            return [], em, True, {"em": em, "answer": answer, "ground_truth": self._golds}
        if last_turn:  # no turn left to read the results
            return [], 0.0, False, {"em": 0.0, "ground_truth": self._golds}
        return [self._run(call) for call in calls], 0.0, False, {}

    def _run(self, call) -> dict:
        if isinstance(call, CallError):
            self.count("malformed_actions")
            return tool_message(call.name or "error", f"Error: {call.message}")
        self.count("tool_calls")
        try:
            text, failed = self.server.call(call.name, call.arguments)
        except (ToolUnavailable, ToolTimeout) as e:
            self.count("tool_failures")
            self.infra_failure(f"{type(e).__name__}: {e}")
            return tool_message(call.name, f"Error: the tool server failed: {e}")
        except ToolError as e:
            self.count("tool_failures")
            return tool_message(call.name, f"Error: {e}")
        if failed:
            self.count("tool_failures")
            return tool_message(call.name, f"Error: {text}")
        return tool_message(call.name, text)


def mcp_kwargs(mcp: MCPConfig) -> dict:
    """``mcp.*``: one connection per process and server, shared by every env."""
    from agentgym.tools.mcp_client import shared  # lazy: loads httpx
    return {"server": shared(mcp.command, mcp.url, mcp.timeout_s)}


MANIFEST = EnvManifest(
    sections={"mcp": MCPConfig},
    datasets={"calc": functools.partial(calc_rows, 500, 0),
              "calc_test": functools.partial(calc_rows, 100, 1)},
    # the calculator's problems unless data= names others (mcp.command / mcp.url: a server)
    presets={"data.name": "calc", "trainer.eval_data": "calc_test"},
    kwargs=mcp_kwargs,
)
