"""Run the retrieval server.

Examples::

    # build a BM25 index over the shipped corpus, cache it, and serve on 127.0.0.1:8000
    python -m retriever_server --corpus data/corpus/wiki_passages.jsonl.gz --index /tmp/wiki_bm25
    # later starts load the saved index (a fraction of a second)
    python -m retriever_server --index /tmp/wiki_bm25 --port 8001

    curl -s localhost:8000/retrieve -H 'content-type: application/json' \\
         -d '{"queries": ["who founded citibank"], "topk": 3}'

It binds 127.0.0.1 unless ``--host`` says otherwise: the API has no authentication, so
exposing it on other interfaces must be a deliberate choice.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
from pathlib import Path

import uvicorn

from retriever_server.app import create_app
from retriever_server.bm25 import DOCS_FILE, BM25Index

logger = logging.getLogger("retriever_server")  # __name__ is "__main__" here


def load_or_build(corpus: Path | None, index_dir: Path | None) -> BM25Index:
    """Load ``index_dir`` if it holds a saved index, else build from ``corpus`` (and save).

    A new index is written to a temporary sibling directory and renamed into place, so a
    concurrent reader never sees a half-written index; if another process won the race,
    its copy is kept. An index that fails to load is rebuilt in place when ``corpus`` is
    given.
    """
    if index_dir is not None and (index_dir / DOCS_FILE).exists():
        try:
            return BM25Index.load(index_dir)
        except Exception as e:  # e.g. saved by an incompatible bm25s version
            if corpus is None:
                raise
            logger.warning("cannot load index %s (%s: %s); rebuilding it from %s",
                           index_dir, type(e).__name__, e, corpus)
    if corpus is None:
        raise SystemExit(f"error: no saved index in {index_dir} and no --corpus to build one")
    if not corpus.exists():
        raise SystemExit(f"error: corpus file {corpus} does not exist")
    index = BM25Index.from_corpus(corpus)
    if index_dir is not None:
        if index_dir.exists():  # an incomplete earlier save: overwrite in place
            index.save(index_dir)
        else:
            tmp = index_dir.with_name(f".{index_dir.name}.tmp-{os.getpid()}")
            index.save(tmp)
            try:
                tmp.rename(index_dir)
            except OSError:
                logger.info("%s was saved concurrently by another process; keeping it", index_dir)
                shutil.rmtree(tmp, ignore_errors=True)
    return index


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m retriever_server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, help="passages, JSONL or JSONL.gz with id and contents")
    p.add_argument("--index", type=Path, help="saved index directory: loaded if present, "
                                              "else built from --corpus and saved here")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    args = p.parse_args(argv)
    if args.corpus is None and args.index is None:
        p.error("give --corpus FILE, --index DIR, or both")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    index = load_or_build(args.corpus, args.index)
    uvicorn.run(create_app(index), host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
