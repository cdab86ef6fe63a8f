"""Request/response schema of the retrieval API (Search-R1's ``POST /retrieve``).

This module is the one piece that ``retriever_server`` shares with ``tools``; it imports
pydantic only, so clients can validate against it without pulling in FastAPI or bm25s.

Request::

    {"queries": ["who wrote hamlet", ...], "topk": 3, "return_scores": true}

Response (always this shape)::

    {"result": [[{"document": {"id": "17", "contents": "\\"Hamlet\\"\\ntext"},
                  "score": 12.3}, ...], ...]}

One inner list per query, in query order, best passage first.

Decision: Search-R1's own server returns ``[[{"document": …, "score": …}]]`` with
``return_scores=true`` but bare ``[[document]]`` without it. A response whose *shape*
changes with a flag forces every client to branch on what it asked for, so this API
always returns ``{"document", "score"}`` items and ``return_scores=false`` only sets
``score`` to ``null``. Search-R1's clients ask for scores and read
``item["document"]["contents"]``, so they work unchanged.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_QUERIES = 256
MAX_QUERY_CHARS = 2048
MAX_TOPK = 50


class RetrieveRequest(BaseModel):
    """Body of ``POST /retrieve``.

    Attributes:
        queries: 1 to 256 queries; each non-empty after stripping, at most 2048 chars.
        topk: passages per query, 1 to 50.
        return_scores: when false, every ``score`` in the response is null (the shape
            does not change).
    """

    model_config = ConfigDict(extra="forbid")

    queries: list[str] = Field(min_length=1, max_length=MAX_QUERIES)
    topk: int = Field(default=3, ge=1, le=MAX_TOPK)
    return_scores: bool = True

    @field_validator("queries")
    @classmethod
    def _queries_not_blank(cls, queries: list[str]) -> list[str]:
        for i, q in enumerate(queries):
            if not q.strip():
                raise ValueError(f"queries[{i}] is empty or whitespace: {q!r}")
            if len(q) > MAX_QUERY_CHARS:
                raise ValueError(f"queries[{i}] has {len(q)} characters; "
                                 f"the limit is {MAX_QUERY_CHARS}")
        return queries


class Document(BaseModel):
    """A passage: ``contents`` is ``'"title"\\ntext'`` (wiki-18 convention)."""

    id: str
    contents: str


class ScoredDocument(BaseModel):
    """One hit. ``score`` is the retriever's raw score (BM25), or null if not requested."""

    document: Document
    score: float | None


class RetrieveResponse(BaseModel):
    """Body of the ``POST /retrieve`` answer: ``result[i]`` are the hits of ``queries[i]``."""

    result: list[list[ScoredDocument]]
