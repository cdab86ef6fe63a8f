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


def shipped_corpus() -> Path:
    """The retrieval corpus the search env's local BM25 server indexes by default."""
    return data_dir() / "corpus" / "wiki_passages.jsonl.gz"


def file_digest(path: Path) -> str:
    """The SHA-256 of a file's bytes (hex), read in 1 MiB chunks."""
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
