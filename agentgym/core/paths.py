"""Where AgentGym keeps things on disk. Import-light: no torch, no transformers.

* ``cache_dir()``: built artifacts (converted models, the tiny model), ``$AGENTGYM_CACHE``
  or ``~/.cache/agentgym``.
* ``data_dir()``: the shipped datasets and corpus, ``$AGENTGYM_DATA`` or ``<repo>/data``.
"""

from __future__ import annotations

import os
from pathlib import Path


def repo_root() -> Path:
    """The folder that holds the ``agentgym`` package (the repository root in a checkout)."""
    return Path(__file__).resolve().parents[2]  # agentgym/core/paths.py


def cache_dir() -> Path:
    """``$AGENTGYM_CACHE`` if set, else ``~/.cache/agentgym``. Not created here."""
    env = os.environ.get("AGENTGYM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "agentgym"


def data_dir() -> Path:
    """``$AGENTGYM_DATA`` if set, else ``repo_root() / "data"``."""
    env = os.environ.get("AGENTGYM_DATA")
    return Path(env).expanduser() if env else repo_root() / "data"


#: the shipped corpora a local retriever can serve (``retriever.corpus``)
CORPORA = ("wiki", "multihop")


def shipped_corpus(name: str = "wiki") -> Path:
    """A shipped retrieval corpus the search env's local BM25 server indexes: ``wiki`` (the
    default, ``data/corpus/wiki_passages.jsonl.gz``) or ``multihop`` (those passages and
    HotpotQA's paragraphs, ``data/multihop/corpus.jsonl.gz``, joined into one file under
    the cache: :func:`joined_corpus`)."""
    wiki = data_dir() / "corpus" / "wiki_passages.jsonl.gz"
    if name == "wiki":
        return wiki
    if name == "multihop":
        return joined_corpus([wiki, data_dir() / "multihop" / "corpus.jsonl.gz"], "multihop")
    raise ValueError(f"retriever.corpus={name!r}; valid: {', '.join(CORPORA)}")


def joined_corpus(parts: list[Path], name: str) -> Path:
    """One gzipped JSONL corpus holding the passages of gzipped ``parts``, in order: their
    bytes one after another (a multi-member gzip file, which gzip readers read whole), at
    ``cache_dir()/corpus/NAME-<sha256 of the parts>.jsonl.gz``, written on first use."""
    import hashlib
    for part in parts:
        if not part.is_file():
            raise FileNotFoundError(f"corpus part {part} does not exist (the shipped data is "
                                    f"built by scripts/build_*_data.py)")
    key = hashlib.sha256("".join(file_digest(p) for p in parts).encode()).hexdigest()[:16]
    out = cache_dir() / "corpus" / f"{name}-{key}.jsonl.gz"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part.read_bytes())
        tmp.replace(out)
    return out


def file_digest(path: Path) -> str:
    """The SHA-256 of a file's bytes (hex), read in 1 MiB chunks."""
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
