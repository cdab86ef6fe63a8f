"""FastAPI app serving Search-R1's retrieval API over an index (BM25 or dense).

``POST /retrieve`` takes the body described in :mod:`agentgym.retriever_server.schema` and answers
``{"result": [[{"document": {"id", "contents"}, "score"}]]}``; ``GET /health`` reports
readiness, corpus size, method, limits and batching counters.

Bad input is a 4xx whose JSON ``message`` names the offending field, value or limit: 422
for a body that is not JSON or breaks the schema or a limit, 413 for a body over
``max_body_bytes``. 503 means the server is shutting down; a 500 means a server bug.

Concurrent requests are searched together (:class:`~agentgym.retriever_server.batcher.QueryBatcher`,
``batching=True``; ``python -m agentgym.retriever_server`` turns it on for dense indexes).
``batching=False`` searches each request on its own in
a thread pool, the way Search-R1's server does; ``bench/retriever_bench.py`` compares the
two. Either way the event loop never blocks on a search, so ``/health`` stays responsive.
An ``X-Request-ID`` header sent by the client is logged and echoed back.

Run it with ``python -m agentgym.retriever_server --index DIR`` (see ``__main__``).
"""

# No `from __future__ import annotations`: FastAPI must see the per-server request model
# (a local class) as a real annotation, not a string it cannot resolve.
import contextlib
import logging
import time

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import HTTPException, RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentgym.retriever_server.batcher import QueryBatcher, ShuttingDown
from agentgym.retriever_server.index import SearchIndex
from agentgym.retriever_server.schema import ErrorResponse, Limits, RetrieveResponse, request_model

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-ID"
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


def _error(status: int, message: str, detail=None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"message": message, "detail": detail})


class _BodyLimit:
    """413 for a body over ``max_bytes``: at once from ``Content-Length``, or while the
    body streams in (chunked uploads), before it is all buffered."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_bytes:
            response = _error(413, f"request body of {int(length)} bytes exceeds the limit of "
                                   f"{self.max_bytes} bytes")
            await response(scope, receive, send)
            return
        seen = 0

        async def counting_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:  # FastAPI re-raises HTTPException from body parsing
                raise HTTPException(413, f"request body exceeds the limit of {self.max_bytes} "
                                         f"bytes")
            return message

        await self.app(scope, counting_receive, send)


def _install_error_handlers(app: FastAPI) -> None:
    """Every error answer is ``{"message", "detail"}`` with a readable message."""

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        message = "; ".join(_describe(e) for e in errors) or "invalid request"
        logger.info("rejected %s %s [%s]: %s", request.method, request.url.path,
                    request.headers.get(REQUEST_ID_HEADER, "-"), message)
        # Keep FastAPI's usual "detail" list (machine-readable) next to a readable message.
        detail = [{k: e[k] for k in ("loc", "msg", "type") if k in e} for e in errors]
        return _error(422, message, detail)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        elif exc.status_code == 404:
            message = f"no such endpoint {request.url.path}; there are POST /retrieve, GET /health"
        return _error(exc.status_code, message, exc.detail)


def create_app(index: SearchIndex, limits: Limits = Limits(), batching: bool = True,
               max_batch_queries: int = 256, max_wait_s: float = 0.0) -> FastAPI:
    """Build the app over a loaded index.

    Args:
        index: ``BM25Index`` or ``DenseIndex`` (anything with ``search``, ``len``, ``method``).
        limits: request bounds, enforced with 4xx answers that state them.
        batching: search concurrent requests together (see the module docstring).
        max_batch_queries: most queries per batched search.
        max_wait_s: longest an idle batcher waits for more requests.
    """
    batcher = QueryBatcher(index.search, max_batch_queries, max_wait_s) if batching else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if batcher is not None:
            batcher.start()
        logger.info("serving %s index of %d passages (batching %s)", index.method, len(index),
                    "on" if batcher else "off")
        yield
        if batcher is not None:
            await batcher.stop()
        logger.info("retrieval server stopped")

    app = FastAPI(title="AgentGym retriever", summary="Search-R1-compatible /retrieve API",
                  lifespan=lifespan)
    app.add_middleware(_BodyLimit, max_bytes=limits.max_body_bytes)
    Body = request_model(limits)

    @app.middleware("http")
    async def _echo_request_id(request: Request, call_next):
        response = await call_next(request)
        rid = request.headers.get(REQUEST_ID_HEADER)
        if rid:
            response.headers[REQUEST_ID_HEADER] = rid
        return response

    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "documents": len(index), "method": index.method,
                "batching": batcher.stats.to_dict() if batcher else None,
                "limits": {"max_queries": limits.max_queries, "max_topk": limits.max_topk,
                           "max_query_chars": limits.max_query_chars,
                           "max_body_bytes": limits.max_body_bytes}}

    @app.post("/retrieve", response_model=RetrieveResponse,
              responses={413: {"model": ErrorResponse, "description": "body too large"},
                         422: {"model": ErrorResponse, "description": "invalid request"},
                         503: {"model": ErrorResponse, "description": "shutting down"}})
    async def retrieve(req: Body, request: Request):  # type: ignore[valid-type]
        t0 = time.perf_counter()
        queries = req.query_list()
        try:
            if batcher is not None:
                hits = await batcher.search(queries, req.topk)
            else:
                hits = await run_in_threadpool(index.search, queries, req.topk)
        except ShuttingDown as e:
            return _error(503, str(e))
        result = [[{"document": {"id": doc["id"], "contents": doc["contents"]},
                    "score": score if req.return_scores else None}
                   for doc, score in per_query] for per_query in hits]
        logger.debug("retrieve [%s]: %d queries, topk=%d, %.1f ms",
                     request.headers.get(REQUEST_ID_HEADER, "-"), len(queries), req.topk,
                     1000 * (time.perf_counter() - t0))
        return {"result": result}

    return app
