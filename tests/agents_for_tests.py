"""Agent programs for tests/test_agents.py, written as users write them: plain code over an
OpenAI client (they know nothing of AgentGym)."""

from __future__ import annotations

import asyncio


def rewriting_agent(row, client) -> float:
    """Asks, then starts over with a summary of the first reply (a rewritten history)."""
    question = row["extra_info"]["question"]
    first = client.chat.completions.create(model="m", max_tokens=8, messages=[
        {"role": "user", "content": question}]).choices[0].message.content
    client.chat.completions.create(model="m", max_tokens=8, messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"Earlier you said {first!r}. {question}"}])
    return 0.5


def failing_agent(row, client) -> float:
    client.chat.completions.create(model="m", max_tokens=4,
                                   messages=[{"role": "user", "content": "hi"}])
    if row["extra_info"]["question"].startswith("fail"):
        raise RuntimeError("the agent's own bug")
    return 1.0


class Barrier:
    """Lets async episodes wait until ``n`` of them run at once."""
    n = 0
    running = 0
    event: asyncio.Event | None = None


async def concurrent_agent(row, client) -> float:
    """An async agent: two turns; each episode first waits until every episode is
    running, which only happens if they run concurrently."""
    Barrier.running += 1
    if Barrier.running >= Barrier.n:
        Barrier.event.set()
    await asyncio.wait_for(Barrier.event.wait(), timeout=120)
    messages = [{"role": "user", "content": row["extra_info"]["question"]}]
    out = await client.chat.completions.create(model="m", messages=messages, max_tokens=6)
    messages += [{"role": "assistant", "content": out.choices[0].message.content},
                 {"role": "user", "content": "And so?"}]
    await client.chat.completions.create(model="m", messages=messages, max_tokens=6)
    return float(len(row["extra_info"]["question"]) % 2)


def url_agent(row, base_url) -> float:
    """Takes the base URL instead of a client."""
    import openai
    with openai.OpenAI(base_url=base_url, api_key="ignored", max_retries=0) as client:
        client.chat.completions.create(model="m", max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}])
    return 0.25


def silent_agent(row, client):
    """Returns no reward: reward= scores its final reply."""
    client.chat.completions.create(model="m", max_tokens=4,
                                   messages=[{"role": "user", "content": "hi"}])


def reply_length(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """A reward function with verl's signature."""
    return float(len(solution_str) > 0) + (0.5 if data_source == "nq" else 0.0)


def chatty_agent(row, client) -> float:
    """Calls until refused: the episode's budget is rollout.max_turns calls."""
    import openai
    calls = 0
    while True:
        try:
            client.completions.create(model="m", prompt="Once upon", max_tokens=2)
        except openai.BadRequestError as e:
            assert e.body["code"] == "episode_budget"
            return float(calls)
        calls += 1
