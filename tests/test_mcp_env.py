"""``env=mcp``: a real MCP server (tests/mcp_kv_server.py, written with the official SDK)
over stdio and over streamable HTTP, its tools as function-calling tools, failures as
observations, the server living as long as the run, and 2 GRPO steps against it."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import pytest

from agentgym.cli import main
from agentgym.supervision.server_process import ServerProcess, free_port
from conftest import wait_until
from agentgym.envs.mcp_env import MCPEnv, mcp_row
from agentgym.tools.mcp_client import MCPServerFailed, MCPTools

SERVER = Path(__file__).with_name("mcp_kv_server.py")


def command(pid_file: Path | None = None) -> str:
    extra = f" --pid-file {shlex.quote(str(pid_file))}" if pid_file else ""
    return f"{shlex.quote(sys.executable)} {shlex.quote(str(SERVER))}{extra}"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_stdio_tools_become_function_schemas_and_the_server_ends_with_close(tmp_path):
    pid_file = tmp_path / "pid"
    tools = MCPTools(command=command(pid_file))
    try:
        pid = int(pid_file.read_text())
        assert alive(pid)
        by_name = {t["function"]["name"]: t["function"] for t in tools.schemas}
        assert set(by_name) == {"lookup", "explode"}
        assert by_name["lookup"]["parameters"]["required"] == ["key"]
        assert by_name["lookup"]["parameters"]["properties"]["key"]["type"] == "string"
        assert "capital city" in by_name["lookup"]["description"]
        assert tools.call("lookup", {"key": "kenya"}) == ("Nairobi", False)
        text, failed = tools.call("lookup", {"key": "mars"})
        assert failed and "mars" in text
    finally:
        tools.close()
    wait_until(lambda: not alive(pid), 30, "the MCP server's exit after close()")


def test_streamable_http_server(tmp_path):
    port = free_port()
    server = ServerProcess([sys.executable, str(SERVER), "--http", str(port)],
                           f"http://127.0.0.1:{port}", name="mcp test server")
    server.start()
    try:
        tools = MCPTools(url=f"http://127.0.0.1:{port}/mcp")
        try:
            assert tools.call("lookup", {"key": "peru"}) == ("Lima", False)
        finally:
            tools.close()
    finally:
        server.stop()


def test_a_server_that_does_not_start_is_a_clear_error(tmp_path):
    crash = "import sys; sys.stderr.write('no config here\\n'); raise SystemExit(3)"
    with pytest.raises(MCPServerFailed, match="did not start or answer(.|\\n)*no config here"):
        MCPTools(command=f"{shlex.quote(sys.executable)} -c {shlex.quote(crash)}",
                 connect_timeout_s=60)
    with pytest.raises(ValueError, match="exactly one of mcp.command"):
        MCPTools()


def test_calls_go_through_mcp_and_failures_are_observations(tmp_path):
    pid_file = tmp_path / "pid"
    tools = MCPTools(command=command(pid_file))
    env = MCPEnv(server=tools, max_turns=6)
    try:
        row = mcp_row("What is the capital of Japan?", "Tokyo")
        obs, _ = env.reset(seed=0, options={"row": row})
        assert "Question: What is the capital of Japan?" in obs[0]["content"]
        obs, r, done, _, info = env.step(call("lookup", key="japan"))
        assert obs == [{"role": "tool", "name": "lookup", "content": "Tokyo"}] and not done
        obs, *_ , info = env.step(call("explode", reason="test"))
        assert obs[0]["content"].startswith("Error: ") and info["tool_failures"] == 1
        obs, *_, info = env.step(call("lookup", country="japan"))  # not its schema
        assert "missing required argument(s) ['key']" in obs[0]["content"]
        assert info["malformed_actions"] == 1 and info["infra_failures"] == 0
        os.kill(int(pid_file.read_text()), 9)  # the server dies mid-episode
        obs, *_, info = env.step(call("lookup", key="peru"))
        assert obs[0]["content"].startswith("Error: the tool server failed")
        assert info["infra_failures"] == 1 and info["infra_error"]
        _, reward, done, _, info = env.step("It is <answer> Tokyo </answer>")
        assert done and reward == 1.0 and info["em"] == 1.0
    finally:
        env.close()
        tools.close()


def test_train_two_grpo_steps_against_a_stdio_server(tmp_path):
    pid_file = tmp_path / "pid"
    data = tmp_path / "rows.jsonl"
    rows = [mcp_row(f"What is the capital of {c}?", cap) for c, cap in
            (("France", "Paris"), ("Japan", "Tokyo"), ("Kenya", "Nairobi"), ("Peru", "Lima"))]
    data.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "env"}) + "\n"
                            for r in rows))
    run = tmp_path / "run"
    assert main(["train", "env=mcp", f"mcp.command={command(pid_file)}", f"data={data}",
                 "model=tiny", "trainer.total_steps=2", "trainer.prompts_per_step=2", "n=2",
                 "rollout.max_turns=2", "rollout.max_tokens_per_turn=16",
                 "trainer.cold_start=off", "trainer.eval_limit=0",
                 f"run_dir={run}"]) == 0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "rollout/reward" in s] == [1, 2]
    pid = int(pid_file.read_text())  # the run started the server ...
    wait_until(lambda: not alive(pid), 30, "the MCP server's exit with the run")  # ... and ended it
