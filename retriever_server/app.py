"""FastAPI app serving Search-R1's retrieval API over an index.

``POST /retrieve`` takes :class:`~retriever_server.schema.RetrieveRequest` and answers
:class:`~retriever_server.schema.RetrieveResponse`; ``GET /health`` reports readiness and
corpus size. Bad input (not JSON, missing or out-of-range fields, blank queries) is a 422
whose ``message`` names the offending field and value; a 500 means a server bug.

The search itself is blocking numpy work, so it runs in a worker thread and the event
loop keeps answering ``/health`` and other requests meanwhile. An ``X-Request-ID``
header sent by the client is logged and echoed back.

Run it with ``python -m retriever_server --corpus FILE.jsonl.gz`` (see ``__main__``).
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from retriever_server.schema import RetrieveRequest, RetrieveResponse

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-ID"


class SearchIndex(Protocol):
    """What the app needs from an index (``BM25Index`` satisfies it)."""

    def __len__(self) -> int: ...

    def search(self, queries: list[str], topk: int) -> list[list[tuple[dict, float]]]: ...


_EXAMPLE = 'a JSON object like {"queries": ["who wrote hamlet"], "topk": 3}'


def _describe(error: dict) -> str:
    """One validation error as ``'body.topk: Input should be ... (got 0)'``."""
    if error.get("type") == "json_invalid":
        reason = (error.get("ctx") or {}).get("error", "")
        return f"body: not valid JSON ({reason}); send {_EXAMPLE}"
    loc = ".".join(str(p) for p in error.get("loc", ()))
    text = f"{loc}: {error.get('msg', 'invalid')}"
    if "input" in error and error.get("type") != "missing":
        got = repr(error["input"])
        text += f" (got {got[:120] + '…' if len(got) > 120 else got})"
    if tuple(error.get("loc", ())) == ("body",):
        text += f"; send {_EXAMPLE} with Content-Type: application/json"
    return text


def create_app(index: SearchIndex, method: str = "bm25") -> FastAPI:
    """Build the app over a loaded index.

    Args:
        index: an object with ``search(queries, topk)`` and ``len()``, e.g. ``BM25Index``.
        method: retrieval method reported by ``/health``.
    """
    app = FastAPI(title="AgentGym retriever", summary="Search-R1-compatible /retrieve API")

    @app.middleware("http")
    async def _echo_request_id(request: Request, call_next):
        response = await call_next(request)
        rid = request.headers.get(REQUEST_ID_HEADER)
        if rid:
            response.headers[REQUEST_ID_HEADER] = rid
        return response

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        message = "; ".join(_describe(e) for e in errors) or "invalid request"
        logger.info("rejected %s %s [%s]: %s", request.method, request.url.path,
                    request.headers.get(REQUEST_ID_HEADER, "-"), message)
        # Keep FastAPI's usual "detail" list (machine-readable) next to a readable message.
        detail = [{k: e[k] for k in ("loc", "msg", "type") if k in e} for e in errors]
        return JSONResponse(status_code=422, content={"message": message, "detail": detail})

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "documents": len(index), "method": method}

    @app.post("/retrieve", response_model=RetrieveResponse)
    async def retrieve(req: RetrieveRequest, request: Request) -> dict:
        t0 = time.perf_counter()
        hits = await run_in_threadpool(index.search, req.queries, req.topk)
        result = [[{"document": {"id": doc["id"], "contents": doc["contents"]},
                    "score": score if req.return_scores else None}
                   for doc, score in per_query] for per_query in hits]
        logger.debug("retrieve [%s]: %d queries, topk=%d, %.1f ms",
                     request.headers.get(REQUEST_ID_HEADER, "-"), len(req.queries), req.topk,
                     1000 * (time.perf_counter() - t0))
        return {"result": result}

    return app
