"""BM25 index over a passage corpus, built with bm25s.

Corpus format (JSONL, optionally gzipped), one passage per line::

    {"id": "0", "title": "Citibank", "text": "...", "contents": "\\"Citibank\\"\\n..."}

Only ``id`` and ``contents`` are kept (what the API returns); ``contents`` is what is
indexed, so the title counts as part of the passage, as in Search-R1's wiki-18 BM25.
Tokenization: bm25s's regex tokenizer, lowercased, English stopwords removed, no stemming.

Example::

    index = BM25Index.from_corpus("data/corpus/wiki_passages.jsonl.gz")
    index.save("/tmp/wiki_bm25")
    hits = BM25Index.load("/tmp/wiki_bm25").search(["who founded citibank"], topk=3)
    doc, score = hits[0][0]
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

import bm25s

from agentgym.retriever_server.corpus import DOCS_FILE, read_corpus, read_docs, write_docs

logger = logging.getLogger(__name__)

_STOPWORDS = "en"
_CHUNK = 2000  # passages tokenized between progress reports


def _tokenize(texts: list[str]) -> list[list[str]]:
    return bm25s.tokenize(texts, lower=True, stopwords=_STOPWORDS, return_ids=False,
                          show_progress=False)


class BM25Index:
    """A bm25s retriever plus the passages it indexes (row ``i`` of the index is ``docs[i]``).

    Read-only after construction, so ``search`` may be called from several threads.

    Args:
        retriever: an indexed ``bm25s.BM25``.
        docs: ``[{"id", "contents"}]`` aligned with the index rows.
    """

    def __init__(self, retriever: bm25s.BM25, docs: list[dict]) -> None:
        n = retriever.scores["num_docs"]
        if n != len(docs):
            raise ValueError(f"index has {n} rows but {len(docs)} documents were given")
        self.retriever, self.docs = retriever, docs

    method = "bm25"

    def __len__(self) -> int:
        return len(self.docs)

    @classmethod
    def from_corpus(cls, path: str | Path) -> BM25Index:
        """Build an index over the corpus file at ``path`` (JSONL or JSONL.gz)."""
        return cls.build(read_corpus(path))

    @classmethod
    def build(cls, docs: list[dict], progress: Callable[[int], None] | None = None) -> BM25Index:
        """Index ``docs`` (``[{"id", "contents"}]``); ``progress(k)`` after each chunk."""
        t0 = time.perf_counter()
        tokens: list[list[str]] = []
        for start in range(0, len(docs), _CHUNK):
            chunk = docs[start:start + _CHUNK]
            tokens.extend(_tokenize([d["contents"] for d in chunk]))
            if progress is not None:
                progress(len(chunk))
        retriever = bm25s.BM25()
        retriever.index(tokens, show_progress=False)
        logger.info("built BM25 index over %d passages in %.1f s", len(docs),
                    time.perf_counter() - t0)
        return cls(retriever, docs)

    def meta(self) -> dict:
        """What ``meta.json`` records about this index."""
        return {"method": self.method, "documents": len(self.docs)}

    def save(self, directory: str | Path) -> None:
        """Write the bm25s index files and ``docs.jsonl`` into ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.retriever.save(str(directory), show_progress=False)
        write_docs(directory, self.docs)  # docs.jsonl last: its presence marks a full save
        logger.info("saved BM25 index (%d passages) to %s", len(self.docs), directory)

    @classmethod
    def load(cls, directory: str | Path) -> BM25Index:
        """Load an index written by :meth:`save`.

        Raises:
            FileNotFoundError: ``directory`` holds no complete saved index.
        """
        directory = Path(directory)
        if not (directory / DOCS_FILE).exists():
            raise FileNotFoundError(f"{directory} holds no saved BM25 index ({DOCS_FILE} missing)")
        t0 = time.perf_counter()
        retriever = bm25s.BM25.load(str(directory), show_progress=False)
        docs = read_docs(directory)
        logger.info("loaded BM25 index (%d passages) from %s in %.2f s",
                    len(docs), directory, time.perf_counter() - t0)
        return cls(retriever, docs)

    def search(self, queries: list[str], topk: int) -> list[list[tuple[dict, float]]]:
        """Top passages for each query, best first, in one bm25s call.

        Args:
            queries: query strings (a query with no indexed term scores 0 everywhere and
                returns arbitrary passages with score 0.0).
            topk: passages per query; capped at the corpus size.

        Returns:
            ``result[i]`` is a list of ``(doc, score)`` for ``queries[i]``; ``doc`` is
            ``{"id", "contents"}`` (shared, do not mutate), ``score`` the BM25 score.
        """
        if not queries:
            return []
        k = min(topk, len(self.docs))
        indices, scores = self.retriever.retrieve(_tokenize(queries), k=k, show_progress=False)
        return [[(self.docs[int(i)], float(s)) for i, s in zip(row_i, row_s)]
                for row_i, row_s in zip(indices, scores)]
