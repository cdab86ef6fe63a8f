"""The search env's demonstrations for the cold start (:attr:`SearchEnv.demonstrate`):
search with the question, then (if no retrieved passage holds a gold answer) a second
search: for a two-hop question a name the first passages mention (the bridge), else a
keyword rewrite; when a passage holds a gold answer, answer with it, citing the passage.
Reasoning is in ``<think>``, as Search-R1's prompt asks. Played through a live env, so the
observations are the env's own; kept only if the env rewards the answer as correct.
Multi-hop rows (``data=multihop``) get two-search demonstrations
(:mod:`agentgym.envs.multihop_demos`)."""

from __future__ import annotations

import re

from agentgym.envs.rewards import gold_answers, normalize_answer
from agentgym.envs.multihop import is_multihop
from agentgym.envs.multihop_demos import multihop_demo

_WH = {"who", "what", "when", "where", "which", "why", "how", "whom", "whose"}
_STOP = _WH | {"is", "are", "was", "were", "be", "been", "do", "does", "did", "the", "a", "an",
               "of", "in", "on", "at", "to", "for", "by", "with", "from", "and", "or", "that",
               "this", "it", "its", "has", "have", "had", "many", "much", "name", "called"}
_DOC = re.compile(r"Doc (\d+)\(Title: (.*?)\) ")


def keyword_rewrite(question: str) -> str:
    """The question without question words and stopwords (a second, shorter query)."""
    words = re.findall(r"[\w'-]+", question)
    kept = [w for w in words if w.lower() not in _STOP]
    return " ".join(kept)


def _passages(information: str) -> list[tuple[int, str, str, str]]:
    """``(doc number, title, passage with its header, its text alone)`` of each passage
    in an ``<information>`` block."""
    starts = [(m.start(), m.end(), int(m.group(1)), m.group(2).strip('"'))
              for m in _DOC.finditer(information)]
    ends = [s[0] for s in starts[1:]] + [len(information)]
    return [(num, title, information[at:end], information[body:end])
            for (at, body, num, title), end in zip(starts, ends)]


def find_answer(information: str, golds: list[str]) -> tuple[int, str, str] | None:
    """``(doc number, title, gold alias)`` of the first passage that contains a gold
    answer as whole words (after SQuAD normalization), or None."""
    for num, title, whole, _ in _passages(information):
        passage = f" {normalize_answer(whole)} "
        for gold in golds:
            g = normalize_answer(gold)
            if g and f" {g} " in passage:
                return num, title, gold
    return None


_ENTITY = re.compile(r"[A-Z][\w'-]*(?: (?:(?:of|the|de|von|van) )*[A-Z][\w'-]*)*")


def bridge_entities(information: str, question: str,
                    limit: int = 6) -> list[tuple[int, str, str]]:
    """``(doc number, title, name)`` for the capitalized names of two words or more that
    the retrieved passages mention and the question does not (candidates for a two-hop
    question's second search), in passage order, at most ``limit``."""
    asked = f" {normalize_answer(question)} "
    out, seen = [], set()
    for num, title, _, text in _passages(information):
        for name in _ENTITY.findall(text):
            key = normalize_answer(name)
            if " " not in key or key in seen or f" {key} " in asked:
                continue
            seen.add(key)
            out.append((num, title, name.strip(".")))
            if len(out) >= limit:
                return out
    return out


def _search_episode(row: dict, env, steps: list[tuple[str, str]], golds: list[str],
                    builder: str, about: str = "") -> tuple[dict | None, str]:
    """Play ``steps`` (``(think, query)`` searches) from a fresh reset; when the last
    search's passages hold a gold answer (in a passage whose title names ``about``, when
    given), answer with it. Returns ``(the demonstration or None, the last search's
    passages)``."""
    prompt, _ = env.reset(seed=0, options={"row": row})
    actions, observations = [], []
    for think, query in steps:
        action = f"<think> {think} </think>\n<search> {query} </search>"
        obs, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            return None, ""
        actions.append(action)
        observations.append(obs)
    info = "".join(m["content"] for m in observations[-1])
    hit = find_answer(info, golds)
    if hit is None:
        return None, info
    num, title, alias = hit
    if about and normalize_answer(re.sub(r" \(.*\)$", "", title)) != normalize_answer(about):
        return None, info  # a two-hop answer must come from the bridge's own article
    action = (f"<think> Doc {num} ({title}) says the answer is {alias}. </think>\n"
              f"<answer> {alias} </answer>")
    _, reward, terminated, _, _ = env.step(action)
    if not terminated or reward < 1.0:
        return None, info
    actions.append(action)
    return {"type": "demonstration", "env": "search", "builder": builder, "prompt": prompt,
            "actions": actions, "observations": observations, "reward": reward,
            "row": row}, info


def search_demo(row: dict, env, max_searches: int = 2) -> dict | None:
    """One search demonstration for ``row`` (played through ``env``), or None.

    The first search is the question. When its passages lack the answer (and
    ``max_searches`` allows a second), the second search is, for a two-hop (HotpotQA)
    question, a name the first passages mention that the question does not (the bridge:
    "Doc 1 (X) mentions Y. I need to know more about Y."), kept only when the answer is in
    Y's own passage; else (and for other questions) the question's keywords.

    A multi-hop row (``data=multihop``: gold paragraphs in ``extra_info``) gets a
    demonstration that searches twice, each search finding its gold paragraph, or none
    (:func:`agentgym.envs.multihop_demos.multihop_demo`)."""
    if is_multihop(row):
        return multihop_demo(row, env, max_searches)
    question = row["extra_info"]["question"].strip()
    golds = gold_answers(row)
    first = (f"I need to find the answer to: {question}. Let me search for it.", question)
    demo, info = _search_episode(row, env, [first], golds, "search-retrieval")
    if demo is not None or max_searches < 2:
        return demo
    tries = [("search-retrieval", ("The results do not contain the answer. Let me search "
                                   "with other words.", keyword_rewrite(question)), "")]
    if row.get("data_source") == "hotpotqa" and info:
        tries[:0] = [("search-two-hop", (f"Doc {num} ({title}) mentions {name}. I need to know "
                                         f"more about {name} to answer. Let me search for it.",
                                         name), name)
                     for num, title, name in bridge_entities(info, question)]
    for builder, second, about in tries:
        if second[1] and second[1] != question:
            demo, _ = _search_episode(row, env, [first, second], golds, builder, about)
            if demo is not None:
                return demo
    return None
