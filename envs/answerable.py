"""Which search questions the retrieval corpus can answer at all.

A question is *answerable* when one of its gold answers occurs in some passage of the
corpus as whole words, after SQuAD normalization (the same test the search demonstration
builder applies to retrieved passages, :func:`agentgym.envs.search_demos.find_answer`). A
question the corpus cannot answer earns reward 0 from every rollout, so its GRPO group
has no reward variance and adds nothing to an update; ``data.answerable_only`` (default
true with the shipped corpus) leaves such questions out of training.

With ``data.curriculum=solve_rate``, :func:`difficulty_levels` orders the search questions
for the curriculum: a single-hop question whose answer BM25 puts in the top passage
first, then in the top 3, then elsewhere in the corpus, and multi-hop (HotpotQA) last.

Matching uses an inverted index (normalized word -> passages that hold it): a gold
answer is looked up only in the passages holding all of its words, so 3,000 questions
against the shipped 21k passages take seconds, not a scan of the corpus per answer.
"""

from __future__ import annotations

import functools
import gzip
import json
import logging
from pathlib import Path

from agentgym.envs.rewards import normalize_answer
from agentgym.envs.rewards import gold_answers

logger = logging.getLogger(__name__)


def passage_texts(path: str | Path) -> list[str]:
    """Each passage's text of a Search-R1 JSONL(.gz) corpus: ``contents``, else title and
    text (what the local retriever indexes)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    texts = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                doc = json.loads(line)
                texts.append(doc.get("contents") or f"{doc.get('title', '')}\n{doc.get('text', '')}")
    return texts


class CorpusIndex:
    """Normalized passages of a Search-R1 JSONL(.gz) corpus (``contents`` or
    ``title``/``text``) and a word -> passage-ids index over them."""

    def __init__(self, passages: list[str]) -> None:
        self.passages = [f" {normalize_answer(p)} " for p in passages]
        self.postings: dict[str, set[int]] = {}
        for i, p in enumerate(self.passages):
            for word in set(p.split()):
                self.postings.setdefault(word, set()).add(i)

    @classmethod
    def from_file(cls, path: str | Path) -> "CorpusIndex":
        return cls(passage_texts(path))

    def contains(self, answer: str) -> bool:
        """True when ``answer`` (normalized) occurs as whole words in some passage."""
        gold = normalize_answer(answer)
        words = gold.split()
        if not words:
            return False
        lists = sorted((self.postings.get(w, set()) for w in set(words)), key=len)
        if not lists[0]:
            return False
        candidates = set.intersection(*lists)
        needle = f" {gold} "
        return any(needle in self.passages[i] for i in candidates)


@functools.lru_cache(maxsize=2)
def corpus_index(path: str) -> CorpusIndex:
    """The index of the corpus at ``path``, built once per process."""
    index = CorpusIndex.from_file(path)
    logger.info("indexed %d passages of %s for answerability", len(index.passages), path)
    return index


def answerable(rows: list[dict], corpus: str | Path) -> list[bool]:
    """Per row: does the corpus hold one of its gold answers?"""
    index = corpus_index(str(corpus))
    return [any(index.contains(g) for g in gold_answers(row)) for row in rows]


#: search difficulty levels (``extra_info.level``) for the curriculum
TOP1, TOP3, IN_CORPUS, MULTI_HOP = 1, 2, 3, 4


@functools.lru_cache(maxsize=1)
def _bm25(path: str):
    """bm25s over the corpus's ``contents`` as the local retriever indexes it (regex
    tokens, lowercased, English stopwords, no stemming) and the normalized passages."""
    import bm25s
    logging.getLogger("bm25s").setLevel(logging.WARNING)  # it sets itself to DEBUG on import
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(passage_texts(path), lower=True, stopwords="en",
                                   show_progress=False), show_progress=False)
    return retriever, corpus_index(path)


def difficulty_levels(rows: list[dict], corpus: str | Path) -> list[int]:
    """Per search row, its difficulty level: :data:`TOP1` (single-hop, a gold answer in the
    passage BM25 ranks first for the question), :data:`TOP3` (in the top 3, the env's
    default ``retriever.topk``), :data:`IN_CORPUS` (elsewhere in the corpus, or nowhere),
    :data:`MULTI_HOP` (HotpotQA: its answer needs a second search)."""
    import bm25s
    retriever, index = _bm25(str(corpus))
    single = [i for i, row in enumerate(rows) if row.get("data_source") != "hotpotqa"]
    levels = [MULTI_HOP] * len(rows)
    if not single:
        return levels
    queries = bm25s.tokenize([rows[i]["extra_info"]["question"] for i in single], lower=True,
                             stopwords="en", show_progress=False)
    top, _ = retriever.retrieve(queries, k=3, show_progress=False, n_threads=1)
    for i, ranked in zip(single, top):
        golds = [f" {g} " for g in map(normalize_answer, gold_answers(rows[i])) if g]
        hits = [any(g in index.passages[int(d)] for g in golds) for d in ranked]
        levels[i] = TOP1 if hits[0] else TOP3 if any(hits) else IN_CORPUS
    return levels