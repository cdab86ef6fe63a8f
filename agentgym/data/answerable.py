"""Which search questions the retrieval corpus can answer at all.

A question is *answerable* when one of its gold answers occurs in some passage of the
corpus as whole words, after SQuAD normalization (the same test the search demonstration
builder applies to retrieved passages, :func:`agentgym.data.demo_builders.find_answer`). A
question the corpus cannot answer earns reward 0 from every rollout, so its GRPO group
has no reward variance and adds nothing to an update; ``data.answerable_only`` (default
true with the shipped corpus) leaves such questions out of training.

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

from envs.rewards import normalize_answer
from envs.search import gold_answers

logger = logging.getLogger(__name__)


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
        opener = gzip.open if str(path).endswith(".gz") else open
        texts = []
        with opener(path, "rt", encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    doc = json.loads(line)
                    texts.append(doc.get("contents") or
                                 f"{doc.get('title', '')}\n{doc.get('text', '')}")
        return cls(texts)

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
