"""Dense index: passages encoded once by a sentence encoder, searched with faiss.

Inner-product search over L2-normalized vectors (cosine similarity), as Search-R1's e5
index does. Index types:

* ``flat`` (default): exact search; right for up to a few million passages on CPU.
* ``ivf``: inverted lists over k-means cells (``nlist`` cells, ``nprobe`` visited per
  query); approximate, for large corpora. Needs at least ``nlist`` passages to train.
* ``hnsw``: graph search (``hnsw_m`` links per node, ``ef_search`` candidates per query);
  approximate, fast queries, slower build, more memory.

On disk (``save``)::

    DIR/index.faiss   the faiss index
    DIR/docs.jsonl    the passages, row i = faiss id i
    DIR/meta.json     method, encoder spec (path, pooling, prefixes), faiss type and params

Example::

    index = DenseIndex.build(read_corpus("corpus.jsonl"), EncoderSpec())
    index.save("/tmp/wiki_dense")
    hits = DenseIndex.load("/tmp/wiki_dense").search(["who founded citibank"], topk=3)
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Callable

from agentgym.retriever_server.corpus import read_docs, write_docs
from agentgym.retriever_server.encoder import Encoder, EncoderSpec

logger = logging.getLogger(__name__)

FAISS_TYPES = ("flat", "ivf", "hnsw")
INDEX_FILE = "index.faiss"


def _faiss():
    import faiss  # imported lazily: a BM25-only server does not need it
    return faiss


def _make_faiss(kind: str, dim: int, n: int, nlist: int, hnsw_m: int):
    faiss = _faiss()
    ip = faiss.METRIC_INNER_PRODUCT
    if kind == "flat":
        return faiss.IndexFlatIP(dim)
    if kind == "hnsw":
        return faiss.IndexHNSWFlat(dim, hnsw_m, ip)
    if kind == "ivf":
        if n < nlist:
            raise ValueError(f"faiss ivf with nlist={nlist} needs at least {nlist} passages to "
                             f"train, the corpus has {n}; lower nlist or use flat")
        return faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, ip)
    raise ValueError(f"faiss index type {kind!r}; valid: {', '.join(FAISS_TYPES)}")


class DenseIndex:
    """A faiss index, its passages and the encoder that made the vectors.

    Args:
        index: a filled faiss index whose row ``i`` is ``docs[i]``.
        docs: ``[{"id", "contents"}]``.
        encoder: encodes queries the way the passages were encoded.
        params: faiss type and search parameters, recorded in ``meta.json``.
    """

    method = "dense"

    def __init__(self, index, docs: list[dict], encoder: Encoder, params: dict) -> None:
        if index.ntotal != len(docs):
            raise ValueError(f"faiss index has {index.ntotal} rows but {len(docs)} documents "
                             f"were given")
        self.index, self.docs, self.encoder, self.params = index, docs, encoder, dict(params)
        self._apply_search_params()

    def __len__(self) -> int:
        return len(self.docs)

    def _apply_search_params(self) -> None:
        if self.params["faiss"] == "ivf":
            self.index.nprobe = self.params["nprobe"]
        elif self.params["faiss"] == "hnsw":
            self.index.hnsw.efSearch = self.params["ef_search"]

    @classmethod
    def build(cls, docs: list[dict], spec: EncoderSpec | None = None, faiss_type: str = "flat",
              nlist: int = 0, nprobe: int = 16, hnsw_m: int = 32, ef_search: int = 64,
              batch_size: int = 64, progress: Callable[[int], None] | None = None) -> DenseIndex:
        """Encode ``docs`` and index them.

        Args:
            docs: ``[{"id", "contents"}]``.
            spec: the encoder (default all-MiniLM-L6-v2, mean pooling).
            faiss_type: ``flat`` | ``ivf`` | ``hnsw``.
            nlist: ivf cells (0 = about 4·sqrt(n)); nprobe: cells visited per query.
            hnsw_m: hnsw links per node; ef_search: hnsw candidates per query.
            batch_size: passages per encoder call.
            progress: called with the number of passages encoded after each batch.
        """
        if faiss_type not in FAISS_TYPES:
            raise ValueError(f"faiss index type {faiss_type!r}; valid: {', '.join(FAISS_TYPES)}")
        if not docs:
            raise ValueError("cannot build a dense index over an empty corpus")
        encoder = Encoder(spec, batch_size=batch_size)
        nlist = nlist or max(1, min(len(docs) // 39, int(4 * math.sqrt(len(docs)))))
        t0 = time.perf_counter()
        vectors = encoder.encode([d["contents"] for d in docs], kind="passage", progress=progress)
        t_enc = time.perf_counter() - t0
        index = _make_faiss(faiss_type, encoder.dim, len(docs), nlist, hnsw_m)
        if not index.is_trained:
            index.train(vectors)
        index.add(vectors)
        params = {"faiss": faiss_type, "nlist": nlist, "nprobe": nprobe, "hnsw_m": hnsw_m,
                  "ef_search": ef_search}
        logger.info("built dense %s index over %d passages (encode %.1f s, %.0f passages/s; "
                    "index %.1f s)", faiss_type, len(docs), t_enc, len(docs) / max(t_enc, 1e-9),
                    time.perf_counter() - t0 - t_enc)
        return cls(index, docs, encoder, params)

    def meta(self) -> dict:
        """What ``meta.json`` records about this index."""
        return {"method": self.method, "documents": len(self.docs), "dim": self.encoder.dim,
                "encoder": self.encoder.spec.to_dict(), **self.params}

    def save(self, directory: str | Path) -> None:
        """Write ``index.faiss`` and ``docs.jsonl`` into ``directory`` (``meta.json`` is the
        caller's: :func:`agentgym.retriever_server.index.save_index` writes it last)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        _faiss().write_index(self.index, str(directory / INDEX_FILE))
        write_docs(directory, self.docs)

    @classmethod
    def load(cls, directory: str | Path, meta: dict, batch_size: int = 64) -> DenseIndex:
        """Load an index written by :meth:`save`, with the encoder named in ``meta``."""
        directory = Path(directory)
        t0 = time.perf_counter()
        index = _faiss().read_index(str(directory / INDEX_FILE))
        encoder = Encoder(EncoderSpec.from_dict(meta["encoder"]), batch_size=batch_size)
        if encoder.dim != index.d:
            raise ValueError(f"{directory}: encoder {meta['encoder']['path']} gives {encoder.dim}-"
                             f"dim vectors but the index holds {index.d}-dim ones")
        params = {k: meta[k] for k in ("faiss", "nlist", "nprobe", "hnsw_m", "ef_search")}
        docs = read_docs(directory)
        logger.info("loaded dense %s index (%d passages) from %s in %.2f s", params["faiss"],
                    len(docs), directory, time.perf_counter() - t0)
        return cls(index, docs, encoder, params)

    def search(self, queries: list[str], topk: int) -> list[list[tuple[dict, float]]]:
        """Top passages for each query, best first: one encoder call for all ``queries``,
        one faiss search.

        Returns:
            ``result[i]`` is a list of ``(doc, score)`` for ``queries[i]``; ``score`` is the
            cosine similarity (inner product of normalized vectors).
        """
        if not queries:
            return []
        vectors = self.encoder.encode(list(queries), kind="query")
        scores, ids = self.index.search(vectors, min(topk, len(self.docs)))
        return [[(self.docs[int(i)], float(s)) for i, s in zip(row_i, row_s) if i >= 0]
                for row_i, row_s in zip(ids, scores)]
