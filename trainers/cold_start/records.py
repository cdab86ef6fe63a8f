"""What the cold start keeps: the digests its cache keys are made of, its record
(``cold_start.json``), atomic writes, the SFT model published whole into the cache, and the
deadline each of its stages runs under."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from agentgym.supervision.watchdog import NO_WATCH
from agentgym.trainers.hooks import Hooks

logger = logging.getLogger(__name__)

RECORD = "cold_start.json"
CURVE = "loss_curve.png"  # the SFT's, written by agentgym.trainers.sft


def watched(hooks: Hooks, name: str):
    """A stage of the cold start under its deadline (``deadlines.<name>_s``, counted from
    the last episode or SFT step): its probes and evals are ``eval``, its demonstrations
    ``rollout``, its SFT ``update``."""
    return getattr(hooks, "watch", NO_WATCH).stage(name, 0)


def folder_digest(folder: Path) -> str:
    """sha256 over a model folder's files (names and bytes), the build record excepted."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        rel = f.relative_to(folder).as_posix()
        if rel.startswith(".") or rel in ("agentgym_build.json",):
            continue
        h.update(rel.encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:24]


def read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_atomic(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{time.time_ns()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    tmp.replace(path)


def write_record(stage_dir: Path, record: dict) -> None:
    write_atomic(stage_dir / RECORD, record)


def complete(cached: Path) -> bool:
    return read(cached / RECORD) is not None and (cached / "model" / "config.json").is_file()


def publish_model(checkpoint: Path, cached: Path, record: dict, curve: Path) -> Path:
    """Copy the checkpoint's HF files to ``cached/model`` (whole or not at all) with the
    record and the SFT's loss curve beside it; return the model folder."""
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cached.name}.tmp-", dir=cached.parent))
    tmp.chmod(0o755)
    try:
        (tmp / "model").mkdir()
        for f in checkpoint.iterdir():
            if f.is_file() and f.suffix != ".pt" and f.name != "state.json":
                shutil.copy2(f, tmp / "model" / f.name)
        (tmp / RECORD).write_text(json.dumps(record, indent=2, default=str) + "\n")
        if curve.is_file():
            shutil.copy2(curve, tmp / CURVE)
        if complete(cached):  # another run published the same inputs meanwhile: use it
            logger.info("cold start: %s was published by another run; using it", cached)
        else:
            if cached.exists():  # an incomplete earlier attempt
                shutil.rmtree(cached)
            tmp.rename(cached)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return cached / "model"
