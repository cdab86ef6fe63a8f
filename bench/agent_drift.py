"""What re-tokenising an agent's conversation would change: the tokens ``env=agent``
records against the chat template's rendering of the same messages.

    python bench/agent_drift.py --model smollm2-135m --episodes 64

A three-turn chat agent (a question from NQ, then two follow-ups, the replies sampled at
temperature 1) plays ``--episodes`` episodes through :class:`agentgym.serving.agents.
AgentManager`. Each follow-up's prompt is built from the recorded ids (what AgentGym trains
on); the baseline is what a recorder of text would train on, the template's rendering of
the same messages: the script counts the follow-up calls whose two prompts differ and by
how many tokens (those after the first difference), and writes the section "Agent token
drift" of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import machine, write_section  # noqa: E402

FOLLOW_UPS = ["Are you sure? Say it again in other words.", "Now in one short sentence."]


def chat_agent(row, client) -> float:
    """Three turns of plain chat; the reward is irrelevant here."""
    messages = [{"role": "user", "content": row["extra_info"]["question"]}]
    for follow in [None, *FOLLOW_UPS]:
        if follow:
            messages.append({"role": "user", "content": follow})
        out = client.chat.completions.create(model="policy", messages=messages,
                                             max_tokens=48)
        messages.append({"role": "assistant", "content": out.choices[0].message.content})
    return 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()

    from agentgym.config import build_config
    from agentgym.data.rows import load_rows
    from agentgym.models.zoo import load_model, load_tokenizer, resolve_model
    from agentgym.rollout.engines.hf import HFEngine
    from agentgym.serving.agents import AgentManager

    path = resolve_model(args.model)
    tok = load_tokenizer(path)
    engine = HFEngine(load_model(path), tok)
    cfg = build_config({"env": "agent", "agent": "bench.agent_drift:chat_agent",
                        "model": args.model, "rollout.temperature": 1.0,
                        "rollout.max_tokens_per_turn": 48})
    rows = load_rows("search", "nq", args.episodes)
    manager = AgentManager(engine, tok, cfg)
    t0 = time.perf_counter()
    try:
        trajs = asyncio.run(manager.run(rows, n=1))
    finally:
        manager.close()
        engine.close()
    s = manager.stats
    calls = s["extended_calls"]
    print(f"{s['episodes']} episodes, {len(trajs)} trajectories, {calls} follow-up calls: "
          f"{s['drifted_calls']} differ from the re-rendered prompt, "
          f"{s['drift_tokens']} tokens after the first difference; "
          f"{time.perf_counter() - t0:.0f} s")
    if args.no_write:
        return
    body = (f"Machine: {machine()}. Command: `python bench/agent_drift.py --model {args.model} "
            f"--episodes {args.episodes}`. A three-turn chat agent over the OpenAI SDK (an "
            f"NQ question, then two follow-ups; replies sampled at temperature 1, at most 48 "
            f"tokens) through `env=agent`'s endpoints. Each follow-up's prompt is built from "
            f"the recorded ids (what AgentGym trains on); the baseline is the chat template's "
            f"rendering of the same messages (what re-tokenising text would train on).\n\n"
            f"| episodes | trajectories | follow-up calls | calls whose prompts differ | "
            f"share | tokens after the first difference, per call |\n"
            f"|---|---|---|---|---|---|\n"
            f"| {s['episodes']} | {len(trajs)} | {calls} | {s['drifted_calls']} | "
            f"{s['drifted_calls'] / max(calls, 1):.3f} | "
            f"{s['drift_tokens'] / max(calls, 1):.1f} |\n")
    write_section(f"Agent token drift ({args.model})", body)


if __name__ == "__main__":
    main()
