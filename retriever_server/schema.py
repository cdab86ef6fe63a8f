"""Request/response schema of the retrieval API (Search-R1's ``POST /retrieve``).

This module is the one piece that ``retriever_server`` shares with ``tools``; it imports
pydantic only, so clients can validate against it without pulling in FastAPI or faiss.

Request (Search-R1's batch shape)::

    {"queries": ["who wrote hamlet", ...], "topk": 3, "return_scores": true}

or a single query (SkyRL-style)::

    {"query": "who wrote hamlet", "topk": 3}

Response (always this shape, one inner list per query, in query order, best first)::

    {"result": [[{"document": {"id": "17", "contents": "\\"Hamlet\\"\\ntext"},
                  "score": 12.3}, ...], ...]}

Decisions:

* Search-R1's own server returns ``[[{"document": …, "score": …}]]`` with
  ``return_scores=true`` but bare ``[[document]]`` without it. A response whose *shape*
  changes with a flag forces every client to branch on what it asked for, so this API
  always returns ``{"document", "score"}`` items and ``return_scores=false`` only sets
  ``score`` to ``null``. Search-R1's clients ask for scores and read
  ``item["document"]["contents"]``, so they work unchanged.
* A single ``{"query": …}`` is answered in the same shape, as a batch of one
  (``result[0]`` holds its hits), so one client parser serves both request shapes.
* Limits (number of queries, topk, characters per query) are per server
  (:class:`Limits`, set by ``python -m agentgym.retriever_server`` flags); each is part of the
  OpenAPI schema and enforced with a 422 whose message states the limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


@dataclass(frozen=True)
class Limits:
    """Per-server bounds on a request (defaults are ``python -m agentgym.retriever_server``'s).

    Attributes:
        max_queries: queries per request.
        max_topk: passages per query.
        max_query_chars: characters per query.
        max_body_bytes: bytes of the request body (a larger one is a 413).
    """

    max_queries: int = 256
    max_topk: int = 50
    max_query_chars: int = 2048
    max_body_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for name in ("max_queries", "max_topk", "max_query_chars", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"limit {name} must be >= 1, got {getattr(self, name)}")


def _check_query(q: str, where: str, limits: Limits) -> str:
    if not q.strip():
        raise ValueError(f"{where} is empty or whitespace: {q!r}")
    if len(q) > limits.max_query_chars:
        raise ValueError(f"{where} has {len(q)} characters; the limit is "
                         f"{limits.max_query_chars}")
    return q


def request_model(limits: Limits = Limits()) -> type[BaseModel]:
    """The ``POST /retrieve`` body model under ``limits`` (one class per server)."""

    class RetrieveRequest(BaseModel):
        """Body of ``POST /retrieve``: ``queries`` (a batch) or ``query`` (one), not both.

        Attributes:
            queries: 1 to ``max_queries`` queries, each non-blank, at most
                ``max_query_chars`` characters.
            query: a single query (same rules); answered as a batch of one.
            topk: passages per query, 1 to ``max_topk``.
            return_scores: when false, every ``score`` in the response is null (the shape
                does not change).
        """

        model_config = ConfigDict(extra="forbid")

        queries: list[str] | None = Field(default=None, min_length=1,
                                          max_length=limits.max_queries)
        query: str | None = Field(default=None, min_length=1,
                                  max_length=limits.max_query_chars)
        topk: int = Field(default=3, ge=1, le=limits.max_topk)
        return_scores: bool = True

        @field_validator("queries")
        @classmethod
        def _queries_ok(cls, queries: list[str] | None) -> list[str] | None:
            for i, q in enumerate(queries or ()):
                _check_query(q, f"queries[{i}]", limits)
            return queries

        @field_validator("query")
        @classmethod
        def _query_ok(cls, query: str | None) -> str | None:
            return query if query is None else _check_query(query, "query", limits)

        @model_validator(mode="after")
        def _one_shape(self):
            if (self.queries is None) == (self.query is None):
                raise ValueError("give either 'queries' (a list) or 'query' (a string), "
                                 "exactly one of them")
            return self

        def query_list(self) -> list[str]:
            return self.queries if self.queries is not None else [self.query]

    return RetrieveRequest


class Document(BaseModel):
    """A passage: ``contents`` is ``'"title"\\ntext'`` (wiki-18 convention)."""

    id: str
    contents: str


class ScoredDocument(BaseModel):
    """One hit. ``score`` is the retriever's raw score (BM25, or cosine similarity for a
    dense index), or null if not requested."""

    document: Document
    score: float | None


class RetrieveResponse(BaseModel):
    """Body of the ``POST /retrieve`` answer: ``result[i]`` are the hits of ``queries[i]``."""

    result: list[list[ScoredDocument]]


class ErrorResponse(BaseModel):
    """Body of every 4xx/5xx answer: a readable ``message`` (naming the bad field, value or
    limit) and, for validation errors, FastAPI's machine-readable ``detail`` list."""

    message: str
    detail: list[dict] | str | None = None
