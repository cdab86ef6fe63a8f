"""Function calling (envs.function_calling, search.protocol=tools): OpenAI schemas into the
prompt (the template's ``tools=`` or the Hermes system-message fallback), Hermes
``<tool_call>`` blocks parsed and checked, several calls in one turn answered by ``tool``
messages, with scripted model output, a real retriever, and exact ids and masks."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
from fakes import ScriptedEngine
from test_manager import ROW, assert_mask_exact

from agentgym.rollout.chat import ChatTokens
from agentgym.config import RolloutConfig
from agentgym.rollout.manager import GenerationManager
from agentgym.envs.function_calling import (CallError, ToolCall, fallback_system_message,
                                   function_tool, parse_tool_calls)
from agentgym.envs.search import SearchEnv

TOOLS = [function_tool("search", "Search.", {"query": {"type": "string"}}),
         function_tool("calc", "Arithmetic.", {"a": {"type": "integer"},
                                               "op": {"type": "string", "enum": ["+", "-"]}},
                       required=["a"])]


def call(name, **args) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def test_parse_tool_calls_checks_each_against_its_schema():
    text = (f"<think>two</think>{call('search', query='x')}\n{call('calc', a=2, op='+')}"
            "<tool_call>{not json}</tool_call>" + call("fly", to="moon") + call("calc", a="2")
            + call("calc", op="+") + call("calc", a=True) + call("calc", a=1, op="*")
            + '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"y\\"}"}</tool_call>'
            + "<tool_call>\n{\"name\": \"search\"")
    out = parse_tool_calls(text, TOOLS)
    assert out[:2] == [ToolCall("search", {"query": "x"}), ToolCall("calc", {"a": 2, "op": "+"})]
    errors = [c.message for c in out[2:8]]
    assert all(isinstance(c, CallError) for c in out[2:8])
    assert errors[0].startswith("the tool call is not valid JSON")
    assert errors[1] == "unknown tool 'fly'; available: search, calc"
    assert errors[2] == "calc: argument 'a' must be integer, got str \"2\""
    assert errors[3] == "calc: missing required argument(s) ['a']; expected ['a', 'op']"
    assert errors[4] == "calc: argument 'a' must be integer, got bool true"
    assert errors[5] == "calc: argument 'op' must be one of ['+', '-'], got '*'"
    assert out[8] == ToolCall("search", {"query": "y"})  # arguments sent as a JSON string
    assert out[9] == CallError("a <tool_call> was opened but not closed with </tool_call>")
    assert parse_tool_calls("no calls here", TOOLS) == []


def _rollout(tok, script, retriever_url, **env_kw):
    engine = ScriptedEngine(tok, script)
    mgr = GenerationManager(engine, tok, lambda: SearchEnv(retriever_url=retriever_url,
                                                           protocol="tools", topk=1, **env_kw),
                            RolloutConfig(max_turns=3, max_response_tokens=8192))
    try:
        return asyncio.run(mgr.play_one(ROW, uid="q0")), engine
    finally:
        mgr.close()


def test_two_calls_in_one_turn_get_both_results_with_exact_ids(tiny_tokenizer, retriever_url):
    tok = tiny_tokenizer
    turn1 = (f"<think>Two lookups.</think>\n{call('search', query='capital of australia')}\n"
             f"{call('search', query='canberra parliament house')}")
    traj, engine = _rollout(tok, [turn1 + " + eos", "<answer> Canberra </answer> + eos"],
                            retriever_url)
    assert_mask_exact(traj, engine, tok)
    assert [s.kind for s in traj.segments] == ["prompt", "generated", "filler", "observation",
                                               "generated"]
    assert traj.terminated and traj.reward == 1.0
    assert traj.metrics["tool_calls"] == 2 and traj.metrics["malformed_actions"] == 0
    obs = traj.segments[3]
    obs_text = tok.decode(traj.token_ids[obs.start:obs.end])
    assert obs_text.count("<|im_start|>tool\n") == 2 and obs_text.count("Doc 1(Title:") == 2
    # tiny's template does not render tools: the Hermes system message carries them
    prompt_text = tok.decode(traj.token_ids[:traj.segments[0].end])
    assert '"name": "search"' in prompt_text and "<tool_call></tool_call> XML tags" in prompt_text
    # token-in/token-out: the stream is the chat template's rendering of the conversation
    env = SearchEnv(retriever_url=retriever_url, protocol="tools", topk=1)
    first, _ = env.reset(seed=0, options={"row": ROW})
    results = env.step(turn1)[0]
    conversation = [fallback_system_message(env.tools), *first,
                    {"role": "assistant", "content": turn1}, *results,
                    {"role": "assistant", "content": "<answer> Canberra </answer>"}]
    rendered = tok.apply_chat_template(conversation, tokenize=False)
    assert tok.decode(traj.token_ids) + "\n" == rendered
    assert engine.prompts[1] == traj.token_ids[:traj.segments[4].start]


def test_malformed_calls_become_observations_that_say_what_was_wrong(tiny_tokenizer,
                                                                     retriever_url):
    tok = tiny_tokenizer
    bad = call("search", q="x") + "<tool_call>{oops</tool_call>" + call("lookup", query="x")
    traj, engine = _rollout(tok, [bad + " + eos", "Canberra + eos"], retriever_url)
    assert_mask_exact(traj, engine, tok)
    obs = traj.segments[3]
    obs_text = tok.decode(traj.token_ids[obs.start:obs.end])
    assert "Error: search: missing required argument(s) ['query']" in obs_text
    assert "Error: the tool call is not valid JSON" in obs_text
    assert "Error: unknown tool 'lookup'; available: search" in obs_text
    assert traj.metrics["malformed_actions"] == 3 and traj.metrics["tool_calls"] == 0
    # a turn without a call answers: plain text works, the EOS is not part of the answer
    assert traj.terminated and traj.info["answer"] == "Canberra" and traj.reward == 1.0


HERMES_TEMPLATE = (  # a compact template that renders tools, as Qwen2.5's does
    "{%- if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def test_a_template_that_renders_tools_gets_them(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = HERMES_TEMPLATE
    chat = ChatTokens(tok, image_processor=None)
    assert chat.renders_tools and not ChatTokens(tiny_tokenizer, image_processor=None).renders_tools
    text = tok.decode(chat.prompt_ids([{"role": "user", "content": "Q"}], TOOLS))
    assert text.startswith("<|im_start|>system\nTOOLS: search calc<|im_end|>")
    assert "<tools>" not in text  # not the fallback
    # the fallback merges with a system prompt already there
    messages, tools = ChatTokens(tiny_tokenizer, image_processor=None).with_tools(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q"}], TOOLS)
    assert tools is None and messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert len(messages) == 2


def test_search_protocol_is_checked():
    from agentgym.config import build_config
    from agentgym.core.overrides import parse_overrides
    with pytest.raises(ValueError, match="search.protocol='xml'; valid: tags, tools"):
        SearchEnv(retriever_url="http://127.0.0.1:9", protocol="xml")
    with pytest.raises(ValueError, match="search.protocol"):
        build_config(parse_overrides(["search.protocol=json"]))


def test_code_protocol_tools_runs_each_call_in_the_sandbox(tiny_tokenizer):
    from agentgym.envs.code import CodeEnv, code_row
    row = code_row("What is 6 times 7?", "42")
    env = CodeEnv(protocol="tools", max_turns=3)
    try:
        first, _ = env.reset(seed=0, options={"row": row})
        assert "python tool" in first[0]["content"] and "<code>" not in first[0]["content"]
        obs, _, done, _, info = env.step(call("python", code="print(6*7)") +
                                         call("python", code="print(1/0)") +
                                         call("python", script="x"))
        assert not done and [m["role"] for m in obs] == ["tool"] * 3
        assert obs[0]["content"].strip() == "42" and "ZeroDivisionError" in obs[1]["content"]
        assert obs[2]["content"].startswith("Error: python: missing required argument(s)")
        assert info["tool_calls"] == 2 and info["malformed_actions"] == 1
        assert info["code_errors"] == 1
        _, reward, done, _, info = env.step("<answer>\\boxed{42}</answer>")
        assert done and reward == 1.0 and info["em"] == 1.0
    finally:
        env.close()


def test_the_tools_variants_pass_the_contract_checker(retriever_url):
    from agentgym.envs import check_env
    from agentgym.envs.code import CodeEnv
    for env in (SearchEnv(retriever_url=retriever_url, protocol="tools"),
                CodeEnv(protocol="tools")):
        try:
            check_env(env)
        finally:
            env.close()
