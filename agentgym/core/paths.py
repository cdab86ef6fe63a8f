"""Where AgentGym keeps things on disk. Import-light: no torch, no transformers.

* ``cache_dir()``: built artifacts (converted models, the tiny model), ``$AGENTGYM_CACHE``
  or ``~/.cache/agentgym``.
* ``data_dir()``: the shipped datasets and corpus, ``$AGENTGYM_DATA`` or ``<repo>/data``.
* ``complete_checkpoints(run_dir)`` / ``latest_checkpoint(run_dir)``: a run folder's
  ``checkpoints/step_N`` folders, which ``model=`` and ``trainer.cold_start=`` also take
  a run folder for (:func:`model_folder`).
* ``write_jsonl(path, rows)``: rows as JSON lines, gzipped reproducibly for ``.gz``.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
from pathlib import Path

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")


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


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The complete ``checkpoints/step_N`` folders of a run folder, newest first.
    ``state.json`` is written last, so it marks a complete one; ``.tmp`` leftovers are
    ignored."""
    found = []
    for p in (Path(run_dir) / "checkpoints").glob("step_*"):
        m = _STEP_DIR.match(p.name)
        if m and (p / "state.json").exists():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found, reverse=True)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run folder (whether it loads is
    :func:`agentgym.trainers.checkpoints.resume`'s question)."""
    found = complete_checkpoints(run_dir)
    return found[0] if found else None


def is_model_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a Hugging Face model: a ``config.json`` naming its
    ``model_type`` (a run folder's ``config.json`` is the run's config, which names none)."""
    try:
        return "model_type" in json.loads((Path(folder) / "config.json").read_text("utf-8"))
    except (OSError, ValueError, TypeError):
        return False


def model_folder(folder: Path, key: str = "model") -> Path:
    """A Hugging Face model folder, given one or a run folder (``runs/sft``: its newest
    complete checkpoint, logged), so a command need not name ``step_N``.

    Raises:
        ValueError: neither (no ``config.json``, no complete checkpoint), naming ``key``
            and what it takes.
    """
    folder = Path(folder).expanduser()
    if is_model_folder(folder):
        return folder
    newest = latest_checkpoint(folder)
    if newest is not None and is_model_folder(newest):
        logger.info("%s=%s: a run folder; its newest checkpoint, %s", key, folder, newest)
        return newest
    raise ValueError(f"{key}={str(folder)!r} is neither a Hugging Face model folder (no "
                     f"config.json there) nor a run folder with a complete checkpoint (no "
                     f"checkpoints/step_N/state.json); valid: a model folder (config.json, "
                     f"weights, tokenizer files), a checkpoint (RUN_DIR/checkpoints/step_N) "
                     f"or a run folder (RUN_DIR: its newest checkpoint)")


def write_jsonl(path: str | Path, rows) -> None:
    """``rows`` as JSON lines at ``path``; gzipped when it ends ``.gz``, with no name and
    mtime 0 in the header (the same rows give the same bytes)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")
    if path.suffix == ".gz":
        with open(path, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb",
                                                    compresslevel=9, mtime=0) as gz:
            gz.write(text)
    else:
        path.write_bytes(text)
