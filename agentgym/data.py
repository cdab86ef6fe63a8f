"""Datasets in verl's row format, shipped under ``data/`` (see data/README.md).

A row: ``data_source``, ``prompt`` (chat messages), ``ability``,
``reward_model.ground_truth``, ``extra_info``, plus ``env`` (which environment).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from agentgym.paths import data_dir
from agentgym.registry import did_you_mean

#: env -> dataset name -> file under data/.
DATASETS: dict[str, dict[str, str]] = {
    "search": {"train": "search/train.jsonl", "nq": "search/nq_eval.jsonl"},
    "code": {"train": "math/gsm8k_train.jsonl.gz", "gsm8k": "math/gsm8k_test.jsonl",
             "math500": "math/math500.jsonl", "aime24": "math/aime24.jsonl"},
    "geometry": {"train": "geometry/train.jsonl.gz", "val": "geometry/val.jsonl",
                 "test": "geometry/test.jsonl"},
}
REQUIRED = ("data_source", "prompt", "reward_model", "env")


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a ``.jsonl`` file, or of a gzipped ``.jsonl.gz`` one."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: str | Path, rows) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def validate_row(row: dict, where: str) -> None:
    """Raise ValueError naming the row and the missing/bad field."""
    missing = [k for k in REQUIRED if k not in row]
    if missing:
        raise ValueError(f"{where}: row lacks {missing}; verl rows need {list(REQUIRED)}")
    prompt = row["prompt"]
    if not isinstance(prompt, list) or not prompt or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        raise ValueError(f"{where}: 'prompt' must be a non-empty list of {{role, content}} "
                         f"messages, got {str(prompt)[:80]!r}")
    if "ground_truth" not in row["reward_model"]:
        raise ValueError(f"{where}: reward_model lacks 'ground_truth'")


def dataset_path(env: str, name: str) -> Path:
    """Resolve a dataset name of ``env`` (or a path to a .jsonl file)."""
    if name.endswith((".jsonl", ".jsonl.gz")) or "/" in name:
        path = Path(name)
        if not path.exists():
            raise FileNotFoundError(f"dataset file {name!r} does not exist")
        return path
    names = DATASETS.get(env, {})
    if name not in names:
        raise KeyError(f"unknown dataset {name!r} for env {env!r}{did_you_mean(name, list(names))}"
                       f"; valid: {', '.join(names) or '(none)'} or a path to a .jsonl(.gz) file")
    return data_dir() / names[name]


def load_rows(env: str, name: str, limit: int = 0) -> list[dict]:
    """Rows of a dataset, validated; the first ``limit`` (0 = all)."""
    path = dataset_path(env, name)
    rows = read_jsonl(path)
    if limit:
        rows = rows[:limit]
    for i, row in enumerate(rows):
        validate_row(row, f"{path}:{i + 1}")
        if row["env"] != env:
            raise ValueError(f"{path}:{i + 1}: row is for env {row['env']!r}, not {env!r}")
    return rows
