"""Demonstration builders: episodes in an env's exact protocol, played through the env.

Every builder drives a real env instance (the same factory rollouts use: the retriever,
the sandbox), proposes each action, and records the observations the env itself
returned, so a demonstration replays exactly (:func:`agentgym.data.demos.replay_demo`). A
demonstration is kept only if the env rewards its final answer as correct.

* ``search``: search with the question, then (if no retrieved passage holds a gold
  answer) a second search: for a two-hop question a name the first passages mention (the
  bridge), else a keyword rewrite; when a passage holds a gold answer, answer with it,
  citing the passage. Reasoning is in ``<think>``, as Search-R1's prompt asks.
* ``code``: a GSM8K solution carries its arithmetic as ``<<48/2=24>>``; its lines become
  up to ``max_cells`` ``<code>`` cells (the line as a comment, each calculation printed),
  run in the sandbox; then ``\\boxed{}`` with the answer. A cell must run cleanly and
  print the annotated values, else the question is skipped.
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
from typing import Callable

from agentgym.envs.rewards import normalize_answer
from agentgym.envs.search import gold_answers

logger = logging.getLogger(__name__)

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
    Y's own passage; else (and for other questions) the question's keywords."""
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


_CALC = re.compile(r"<<([^<>=]+)=([^<>]*)>>")


def _chunks(items: list, k: int) -> list[list]:
    """``items`` in at most ``k`` contiguous, nearly equal chunks."""
    k = max(1, min(k, len(items)))
    size, extra = divmod(len(items), k)
    out, at = [], 0
    for i in range(k):
        n = size + (i < extra)
        out.append(items[at:at + n])
        at += n
    return out


def _numbers(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?", text)]


def code_demo(row: dict, env, max_cells: int = 3) -> dict | None:
    """One code-interpreter demonstration for a GSM8K ``row`` (played through ``env``)."""
    solution = (row.get("extra_info") or {}).get("solution", "")
    if "####" not in solution:
        return None
    body, final = solution.rsplit("####", 1)
    final = final.strip().replace(",", "")
    steps = []  # (line without annotations, [(expression, annotated result)])
    for line in body.strip().splitlines():
        calcs = [(m.group(1).strip(), m.group(2).strip()) for m in _CALC.finditer(line)]
        prose = _CALC.sub("", line).strip()
        if prose:
            steps.append((prose, calcs))
    if not any(c for _, c in steps):
        return None
    prompt, _ = env.reset(seed=0, options={"row": row})
    actions, observations = [], []
    cells = _chunks(steps, max_cells)
    for k, cell in enumerate(cells):
        lines, expected = [], []
        for prose, calcs in cell:
            lines.append(f"# {prose}")
            for expr, result in calcs:
                lines.append(f"print({expr})")
                expected.append(result)
        lead = "Let me compute this step by step with Python." if k == 0 else \
            "Next, I continue the calculation."
        code = "\n".join(lines)
        action = f"{lead}\n<code>\n```python\n{code}\n```\n</code>"
        obs, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            return None
        text = "".join(m["content"] for m in obs)
        if "Error" in text or "Traceback" in text:
            return None
        got = _numbers(text)
        for want in expected:  # every annotated value must be among the printed ones
            w = _numbers(want.replace(",", ""))
            if w and not any(abs(g - w[0]) <= 1e-6 * max(1.0, abs(w[0])) for g in got):
                return None
        actions.append(action)
        observations.append(obs)
    action = f"The final answer is {final}.\n<answer>\n\\boxed{{{final}}}\n</answer>"
    _, reward, terminated, _, _ = env.step(action)
    if not terminated or reward < 1.0:
        return None
    actions.append(action)
    return {"type": "demonstration", "env": "code", "builder": "gsm8k-annotations",
            "prompt": prompt, "actions": actions, "observations": observations,
            "reward": reward, "row": row}


#: env short name -> builder(row, env, **options) -> demonstration or None.
BUILDERS: dict[str, Callable[..., dict | None]] = {"search": search_demo, "code": code_demo}


def build_demos(env_name: str, rows: list[dict], make_env: Callable, workers: int = 4,
                on_done: Callable[[bool], None] | None = None, **options) -> list[dict]:
    """Run the env's builder over ``rows`` in ``workers`` threads (one env each per row).

    Returns the kept demonstrations in row order, each with a ``uid``.
    """
    from agentgym.rollout.manager import row_uid
    if env_name not in BUILDERS:
        raise ValueError(f"no demonstration builder for env {env_name!r}; valid: "
                         f"{', '.join(BUILDERS)} (or rejection-sample: agentgym rollout, "
                         f"then agentgym filter)")
    builder = BUILDERS[env_name]

    def one(i: int, row: dict) -> dict | None:
        env = make_env()
        try:
            demo = builder(row, env, **options)
        except Exception as e:  # noqa: BLE001 - one bad row must not stop the build
            logger.warning("row %d: builder failed (%s: %s)", i, type(e).__name__, e)
            demo = None
        finally:
            env.close()
        if demo is not None:
            demo["uid"] = row_uid(row, i)
        if on_done is not None:
            on_done(demo is not None)
        return demo

    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="demo") as pool:
        results = list(pool.map(one, range(len(rows)), rows))
    return [d for d in results if d is not None]
