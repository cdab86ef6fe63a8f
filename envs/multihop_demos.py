"""Demonstrations that search twice, for multi-hop rows (``data=multihop``): the search
env's builder (:func:`agentgym.envs.search_demos.search_demo`) hands such rows here.

* Bridge: search with the question; the first gold paragraph must be in the results; then
  "Doc k (its title) mentions B. I need to know more about B." and a search for the bridge
  phrase B (``extra_info.bridge``: a phrase the first paragraph holds and the question does
  not, usually the second paragraph's title); the second gold paragraph must be in those
  results; then the answer, citing it.
* Comparison: one search per entity (each gold paragraph's title without its
  disambiguation), each of whose results must hold that entity's paragraph; then the
  answer, citing both.

Played through a live env, so the observations are the env's own; "in the results" is the
env's own test (``info["gold_hits"]``, :func:`agentgym.envs.multihop.gold_hits`), on the
env's ``retriever.topk`` passages (3 by default). Kept only when every search found its
gold paragraph and the env rewards the answer 1.0. The reasoning is templated: it teaches
the protocol of a second search, not how to pick the bridge.
"""

from __future__ import annotations

import re

from agentgym.envs.multihop import gold_paragraphs, strip_title
from agentgym.envs.rewards import gold_answers

_DOC = re.compile(r"Doc (\d+)\(Title: (.*?)\) ")  # Search-R1's passage header (format_docs)


def _doc_number(information: str, title: str) -> int | None:
    """The number of the passage titled ``title`` in an ``<information>`` block."""
    return next((int(m.group(1)) for m in _DOC.finditer(information)
                 if m.group(2).strip('"') == title), None)


def _search(env, think: str, query: str, hop: int, title: str) -> tuple[str, dict] | None:
    """One search step; ``(action, observation info)`` when its results hold gold
    paragraph ``hop`` and name it, else None."""
    action = f"<think> {think} </think>\n<search> {query} </search>"
    obs, _, terminated, truncated, info = env.step(action)
    if terminated or truncated or hop not in info.get("gold_hits", ()):
        return None
    text = "".join(m["content"] for m in obs)
    num = _doc_number(text, title)
    return (action, {"obs": obs, "num": num}) if num is not None else None


def multihop_demo(row: dict, env, max_searches: int = 2) -> dict | None:
    """A two-search demonstration for multi-hop ``row`` (played through ``env``), or None
    (module docstring). ``max_searches`` below 2 builds none."""
    extra, golds = row.get("extra_info") or {}, gold_paragraphs(row)
    answers = gold_answers(row)
    if max_searches < 2 or len(golds) != 2 or not answers:
        return None
    question, kind = extra["question"].strip(), extra.get("type")
    first, second = golds[0]["title"], golds[1]["title"]
    if kind == "bridge":
        bridge = extra.get("bridge")
        if not bridge:
            return None
        plan = [(f"I need to find the answer to: {question}. Let me search for it.", question),
                (lambda n: f"Doc {n} ({first}) mentions {bridge}. I need to know more about "
                           f"{bridge} to answer. Let me search for it.", bridge)]
    elif kind == "comparison":
        a, b = strip_title(first), strip_title(second)
        plan = [(f"To answer: {question}, I need to look up {a} and {b}. Let me search for "
                 f"{a} first.", a),
                (lambda n: f"Doc {n} ({first}) is about {a}. Now let me search for {b}.", b)]
    else:
        return None
    prompt, _ = env.reset(seed=0, options={"row": row})
    actions, observations, cited = [], [], []
    for hop, (think, query) in enumerate(plan):
        think = think(cited[-1]) if callable(think) else think
        step = _search(env, think, query, hop, golds[hop]["title"])
        if step is None:
            return None
        actions.append(step[0])
        observations.append(step[1]["obs"])
        cited.append(step[1]["num"])
    alias = answers[0]
    if kind == "bridge":
        why = f"Doc {cited[1]} ({second}) says the answer is {alias}."
    else:
        why = (f"Doc {cited[0]} ({first}) in the first results and Doc {cited[1]} ({second}) "
               f"in the second give what I need: the answer is {alias}.")
    action = f"<think> {why} </think>\n<answer> {alias} </answer>"
    _, reward, terminated, _, _ = env.step(action)
    if not terminated or reward < 1.0:
        return None
    actions.append(action)
    return {"type": "demonstration", "env": "search", "builder": f"search-multihop-{kind}",
            "prompt": prompt, "actions": actions, "observations": observations,
            "reward": reward, "row": row}
