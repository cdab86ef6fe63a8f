"""An agent as one writes it against the OpenAI SDK, trained unchanged by AgentGym:

    agentgym train env=agent agent=examples.search_agent:run data=nq_questions.jsonl

It offers the model a ``search`` function, runs the searches the model calls against a
Search-R1 retriever (``SEARCH_URL``, default: the one ``agentgym serve-retriever`` starts
on port 8000), feeds the results back as ``tool`` messages, and scores the final answer
by exact match. Nothing in it knows about AgentGym: point the client anywhere else and it
runs the same way.
"""

from __future__ import annotations

import json
import os
import re
import string

import httpx

SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search Wikipedia; returns the top passages.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                   "required": ["query"]}}}
SYSTEM = ("Answer the question. Call the search function when you need facts; when you know "
          "the answer, reply with it alone.")


def search(query: str, url: str) -> str:
    r = httpx.post(f"{url}/retrieve", json={"queries": [query], "topk": 3,
                                           "return_scores": False}, timeout=30)
    r.raise_for_status()
    return "\n".join(d["document"]["contents"] for d in r.json()["result"][0])


def normalize(text: str) -> str:
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def run(row: dict, client, turns: int = 3) -> float:
    """One episode: the row's question, up to ``turns`` model calls; 1.0 if the final
    reply matches a gold answer."""
    url = os.environ.get("SEARCH_URL", "http://127.0.0.1:8000")
    question = (row.get("extra_info") or {}).get("question") or row["prompt"][-1]["content"]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    reply = ""
    for _ in range(turns):
        out = client.chat.completions.create(model="policy", messages=messages,
                                             tools=[SEARCH], max_tokens=64)
        message = out.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        reply = message.content or ""
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            query = json.loads(call.function.arguments).get("query", "")
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": search(query, url)})
    gold = row["reward_model"]["ground_truth"]
    golds = gold["target"] if isinstance(gold, dict) else gold
    golds = [golds] if isinstance(golds, str) else golds
    answer = re.sub(r"</?answer>", "", reply)
    return float(any(normalize(answer) == normalize(g) for g in golds))
