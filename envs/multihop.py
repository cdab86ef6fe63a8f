"""Multi-hop questions (HotpotQA bridge and comparison, ``data=multihop``): their gold
paragraphs, the order of the hops, and which retrieved passages are gold.

A multi-hop row carries, in ``extra_info``::

    "type": "bridge" | "comparison",  "hops": 2,
    "gold_paragraphs": [{"id": "hp-00012", "title": "Kiss and Tell (1945 film)"},
                        {"id": "hp-00007", "title": "Shirley Temple"}],      # in hop order
    "bridge": "Shirley Temple"          # bridge rows: the phrase the second search asks for

A retrieved passage is gold paragraph ``k`` when its ``id`` is ``k``'s, or its title (the
first line of ``contents``, quotes stripped) is ``k``'s title: ids name the passage in the
shipped corpus; titles let another retriever (a full Wikipedia index) be scored too, where
the article's passage with that title holds what the hop needs.

Hop order (:func:`hop_order`): for a bridge question the second hop is the paragraph whose
title (without its parenthesised disambiguation) the other gold paragraph mentions and the
question does not (HotpotQA's bridge entity is usually that title); for a comparison
question, HotpotQA's order (its ``supporting_facts``): one search per entity.
"""

from __future__ import annotations

import re

from agentgym.envs.rewards import normalize_answer
from agentgym.core.paths import data_dir

_PAREN = re.compile(r"\s*\([^()]*\)$")


def strip_title(title: str) -> str:
    """A Wikipedia title without its trailing disambiguation: ``"Ed Wood (film)"`` ->
    ``"Ed Wood"``."""
    return _PAREN.sub("", title).strip()


def doc_title(contents: str) -> str:
    """The title of a Search-R1 passage (``contents`` = ``'"Title"\\ntext'``)."""
    first = contents.split("\n", 1)[0].strip()
    return first[1:-1] if len(first) >= 2 and first[0] == first[-1] == '"' else first


def mentions(text: str, phrase: str) -> bool:
    """Whether ``phrase`` occurs in ``text`` as whole words (both SQuAD-normalized)."""
    p = normalize_answer(phrase)
    return bool(p) and f" {p} " in f" {normalize_answer(text)} "


def gold_paragraphs(row: dict | None) -> list[dict]:
    """The row's gold paragraphs (``extra_info.gold_paragraphs``, hop order), [] for a
    one-hop row. A malformed entry is a ValueError naming the row's id."""
    extra = (row or {}).get("extra_info") or {}
    golds = extra.get("gold_paragraphs") or []
    for g in golds:
        if not isinstance(g, dict) or not (g.get("id") or g.get("title")):
            raise ValueError(f"row {extra.get('id')!r}: extra_info.gold_paragraphs entries "
                             f"need an 'id' or a 'title', got {g!r}")
    return [{"id": str(g.get("id") or ""), "title": str(g.get("title") or "")} for g in golds]


def gold_hits(docs: list[dict], golds: list[dict]) -> list[int]:
    """Indices (into ``golds``) of the gold paragraphs among retrieved ``docs``
    (``{"id", "contents"}``), by id or by title (module docstring), in ``golds`` order."""
    ids = {str(d.get("id")) for d in docs}
    titles = {doc_title(d.get("contents", "")) for d in docs}
    return [k for k, g in enumerate(golds)
            if (g["id"] and g["id"] in ids) or (g["title"] and g["title"] in titles)]


def hop_order(question: str, kind: str,
              golds: list[tuple[str, str]]) -> tuple[list[int], str | None]:
    """``(order, bridge)``: the indices of the two gold paragraphs ``golds`` (``(title,
    text)``, HotpotQA's order) in hop order, and for a bridge question the phrase its
    second search asks for (None when no gold title fits: no bridge demonstration).

    Bridge: paragraph ``j`` is the second hop when the other one mentions ``j``'s title
    (disambiguation stripped) and the question does not; if both qualify, the one the
    question names goes first. Comparison: HotpotQA's order, no bridge phrase."""
    if len(golds) != 2:
        raise ValueError(f"a two-hop question needs 2 gold paragraphs, got {len(golds)}: "
                         f"{[t for t, _ in golds]}")
    if kind != "bridge":
        return [0, 1], None
    fits = [j for j in (1, 0) if mentions(golds[1 - j][1], strip_title(golds[j][0]))
            and not mentions(question, strip_title(golds[j][0]))]
    if not fits:
        named = [j for j in (0, 1) if mentions(question, strip_title(golds[j][0]))]
        return ([named[0], 1 - named[0]] if len(named) == 1 else [0, 1]), None
    if len(fits) == 2:  # each names the other: start from the one the question names
        first = next((j for j in (0, 1) if mentions(question, strip_title(golds[j][0]))), 0)
        second = 1 - first
    else:
        second = fits[0]
    return [1 - second, second], strip_title(golds[second][0])


def is_multihop(row: dict) -> bool:
    """Whether ``row`` is a multi-hop row with gold paragraphs (``data=multihop``)."""
    return bool(((row.get("extra_info") or {}).get("gold_paragraphs")))


#: the search env's datasets whose second hops are in ``retriever.corpus=multihop`` only
MULTIHOP_DATASETS = ("multihop", "multihop_test", "multihop_curriculum")


def multihop_rows() -> list[dict]:
    """``data=multihop_curriculum``: the NQ questions of ``data=train`` (the one-hop
    levels) and the multi-hop training questions (``data=multihop``, the multi-hop level),
    for ``data.curriculum=solve_rate``, which starts at the lowest level and moves up as
    each is solved (:func:`agentgym.envs.answerable.difficulty_levels`). The two kinds
    alternate (then the rest of the NQ rows), so the cold start, which takes the rows in
    order, demonstrates one search and two."""
    import gzip
    import json

    parts = []
    for name in ("search/train.jsonl", "multihop/train.jsonl.gz"):
        path = data_dir() / name
        opener = gzip.open if name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            parts.append([json.loads(line) for line in f if line.strip()])
    one = [r for r in parts[0] if r.get("data_source") == "nq"]
    two = [r for r in parts[1] if is_multihop(r)]
    mixed = [r for pair in zip(one, two) for r in pair]
    return mixed + one[len(two):] + two[len(one):]
