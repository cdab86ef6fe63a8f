"""Building, saving and loading retrieval indexes of either kind (``bm25`` or ``dense``).

An index directory always holds ``docs.jsonl`` and ``meta.json``; ``meta.json`` is written
last, so its presence marks a complete index. Directories saved before ``meta.json``
existed (BM25 only: ``docs.jsonl`` plus bm25s files) still load.

    index = build_index(read_corpus("corpus.jsonl"), method="dense")
    save_index(index, "/data/wiki_dense")         # atomic: temp dir, then rename
    index = load_index("/data/wiki_dense")        # BM25Index or DenseIndex
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Callable, Protocol

from agentgym.retriever_server.corpus import DOCS_FILE

logger = logging.getLogger(__name__)

METHODS = ("bm25", "dense")
META_FILE = "meta.json"


class SearchIndex(Protocol):
    """What the server needs from an index (``BM25Index`` and ``DenseIndex`` satisfy it)."""

    method: str

    def __len__(self) -> int: ...

    def search(self, queries: list[str], topk: int) -> list[list[tuple[dict, float]]]: ...

    def meta(self) -> dict: ...

    def save(self, directory: str | Path) -> None: ...


def build_index(docs: list[dict], method: str, progress: Callable[[int], None] | None = None,
                **dense_options) -> SearchIndex:
    """Index ``docs`` with ``method``; ``dense_options`` go to :meth:`DenseIndex.build`."""
    if method == "bm25":
        if dense_options:
            raise ValueError(f"options {sorted(dense_options)} apply to method=dense only")
        from agentgym.retriever_server.bm25 import BM25Index  # lazy: loads bm25s
        return BM25Index.build(docs, progress=progress)
    if method == "dense":
        from agentgym.retriever_server.dense import DenseIndex  # lazy: loads numpy
        return DenseIndex.build(docs, progress=progress, **dense_options)
    raise ValueError(f"unknown retrieval method {method!r}; valid: {', '.join(METHODS)}")


def is_index(directory: str | Path) -> bool:
    """True if ``directory`` holds a complete saved index."""
    d = Path(directory)
    return (d / META_FILE).is_file() or (d / DOCS_FILE).is_file()


def save_index(index: SearchIndex, directory: str | Path) -> None:
    """Save ``index`` into ``directory`` atomically.

    The index is written to a temporary sibling and renamed into place, so a reader never
    sees half an index. An existing index at ``directory`` is replaced; if another process
    saved one concurrently, the first rename wins and this copy is dropped.
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    index.save(tmp)
    (tmp / META_FILE).write_text(json.dumps(index.meta(), indent=2) + "\n")
    if directory.exists():
        old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
        directory.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    try:
        tmp.rename(directory)
    except OSError:
        logger.info("%s was saved concurrently by another process; keeping it", directory)
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("saved %s index (%d passages) to %s", index.method, len(index), directory)


def load_index(directory: str | Path, batch_size: int = 64) -> SearchIndex:
    """Load a saved index of either kind.

    Raises:
        FileNotFoundError: ``directory`` holds no complete index.
        ValueError: ``meta.json`` names an unknown method.
    """
    directory = Path(directory)
    if not is_index(directory):
        raise FileNotFoundError(f"{directory} holds no saved index (no {META_FILE}); build one "
                                f"with `agentgym index build --corpus FILE --method bm25|dense "
                                f"--out {directory}`")
    meta_path = directory / META_FILE
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {"method": "bm25"}
    method = meta.get("method")
    if method == "bm25":
        from agentgym.retriever_server.bm25 import BM25Index  # lazy: loads bm25s
        return BM25Index.load(directory)
    if method == "dense":
        from agentgym.retriever_server.dense import DenseIndex  # lazy: loads numpy
        return DenseIndex.load(directory, meta, batch_size=batch_size)
    raise ValueError(f"{meta_path}: unknown method {method!r}; valid: {', '.join(METHODS)}")
