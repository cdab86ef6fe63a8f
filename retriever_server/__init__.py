"""Retrieval service (its own process): Search-R1's ``POST /retrieve`` API over BM25.

``schema`` (pydantic only) is the one module clients may import; ``bm25`` builds and
loads indices; ``app`` is the FastAPI app; ``python -m agentgym.retriever_server`` runs it.
"""
