"""Dynamic batching: the queries of concurrent requests go to the index in one call.

A dense search is dominated by the encoder's forward pass, whose cost per query falls
steeply with batch size; BM25 gains less but still saves per-call overhead. The batcher
runs one search at a time on its own worker thread. While a search runs, new requests
queue; when it finishes, everything queued (up to ``max_batch_queries``) becomes the
next batch, so batches grow with load by themselves. ``max_wait_s`` (default 0) lets the
first request at an idle worker wait that long for company. Measured on 2 CPU cores
(``bench/retriever_bench.py``, dense): with a 2 ms wait the batched server was 0.88x the
per-request baseline at concurrency 1 and 2.28x at 32; with none, 1.06x and 2.17x. So the
default is 0.

Requests with different ``topk`` share a batch: the index is searched with the largest
``topk`` and each request gets its own prefix (both indexes return hits best first).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

logger = logging.getLogger(__name__)

Hits = list[list[tuple[dict, float]]]


class ShuttingDown(RuntimeError):
    """The batcher stopped before this request was searched."""


@dataclass
class _Pending:
    queries: list[str]
    topk: int
    future: asyncio.Future = field(repr=False)


@dataclass
class BatchStats:
    """Counters since start (reported by ``GET /health``)."""

    requests: int = 0
    queries: int = 0
    batches: int = 0
    largest_batch: int = 0
    search_s: float = 0.0

    def to_dict(self) -> dict:
        return {"requests": self.requests, "queries": self.queries, "batches": self.batches,
                "largest_batch": self.largest_batch, "search_s": round(self.search_s, 3)}


class QueryBatcher:
    """Gathers concurrent ``search`` calls into batched calls of ``search_fn``.

    Args:
        search_fn: ``(queries, topk) -> hits``, e.g. ``index.search``; runs on the
            batcher's one worker thread.
        max_batch_queries: most queries per call (a request is never split; a single
            larger request runs alone).
        max_wait_s: longest an idle batcher waits for more requests before searching.

    ``start()`` and ``stop()`` must be called on the event loop that serves requests.
    """

    def __init__(self, search_fn: Callable[[list[str], int], Hits],
                 max_batch_queries: int = 256, max_wait_s: float = 0.0) -> None:
        if max_batch_queries < 1 or max_wait_s < 0:
            raise ValueError(f"need max_batch_queries >= 1 and max_wait_s >= 0, got "
                             f"{max_batch_queries} and {max_wait_s}")
        self.search_fn = search_fn
        self.max_batch_queries, self.max_wait_s = max_batch_queries, max_wait_s
        self.stats = BatchStats()
        self._queue: asyncio.Queue[_Pending] | None = None
        self._task: asyncio.Task | None = None
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="search")

    def start(self) -> None:
        self._queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="batcher")

    async def stop(self) -> None:
        """Stop the loop, fail queued requests with :class:`ShuttingDown`, join the worker."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        while self._queue is not None and not self._queue.empty():
            p = self._queue.get_nowait()
            if not p.future.done():
                p.future.set_exception(ShuttingDown("the retrieval server is shutting down"))
        self._worker.shutdown(wait=True)

    async def search(self, queries: list[str], topk: int) -> Hits:
        """Hits for ``queries`` (best first, ``topk`` each), searched with other requests."""
        if self._task is None or self._queue is None:
            raise ShuttingDown("the batcher is not running")
        future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Pending(list(queries), topk, future))
        return await future

    async def _gather(self) -> list[_Pending]:
        """The next batch: one request, then whatever else arrives within the bounds."""
        queue = self._queue
        batch = [await queue.get()]
        size = len(batch[0].queries)
        deadline = time.monotonic() + self.max_wait_s
        while size < self.max_batch_queries:
            if queue.empty():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    nxt = await asyncio.wait_for(queue.get(), left)
                except asyncio.TimeoutError:
                    break
            else:
                nxt = queue.get_nowait()
            if size + len(nxt.queries) > self.max_batch_queries:
                queue.put_nowait(nxt)  # goes to the back; runs in the next batch
                break
            batch.append(nxt)
            size += len(nxt.queries)
        return batch

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [p for p in await self._gather() if not p.future.done()]  # drop cancelled
            if not batch:
                continue
            queries = [q for p in batch for q in p.queries]
            topk = max(p.topk for p in batch)
            t0 = time.perf_counter()
            try:
                hits = await loop.run_in_executor(self._worker, self.search_fn, queries, topk)
            except asyncio.CancelledError:  # stop() during a search: nobody will answer these
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(ShuttingDown("the retrieval server is shutting "
                                                            "down"))
                raise
            except Exception as e:  # noqa: BLE001 - delivered to every waiting request
                logger.exception("search of a batch of %d queries failed", len(queries))
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(e)
                continue
            self._record(batch, len(queries), time.perf_counter() - t0)
            at = 0
            for p in batch:
                mine = hits[at:at + len(p.queries)]
                at += len(p.queries)
                if not p.future.done():
                    p.future.set_result([h[:p.topk] for h in mine])

    def _record(self, batch: list[_Pending], n_queries: int, seconds: float) -> None:
        s = self.stats
        s.requests += len(batch)
        s.queries += n_queries
        s.batches += 1
        s.largest_batch = max(s.largest_batch, n_queries)
        s.search_s += seconds
