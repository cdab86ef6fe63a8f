"""Datasets in verl's row format: shipped under ``data/`` (see data/README.md), or files as
verl's ``examples/data_preprocess`` scripts write them.

A row: ``data_source``, ``prompt`` (chat messages), ``ability``,
``reward_model.ground_truth``, ``extra_info``, and optionally ``env`` (which environment;
verl's rows have none: the command's ``env=`` decides, and a row's ``env``, when present,
must agree). ``data=`` takes a shipped dataset's name, or a path (:func:`read_rows`): a
``.parquet`` file (verl's), ``.jsonl`` / ``.jsonl.gz``, a directory or glob of such shards,
or a folder written by ``datasets``' ``save_to_disk``.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from agentgym.core.paths import data_dir, write_jsonl  # noqa: F401 - rows' writer, re-exported
from agentgym.core.registry import did_you_mean

REQUIRED = ("data_source", "prompt", "reward_model")
#: what ``data=`` accepts as a path (the error for an unreadable one names them)
ACCEPTED = ("a .parquet file (as verl writes it), a .jsonl or .jsonl.gz file, a directory "
            "or glob of such shards, or a folder written by datasets' save_to_disk")
_SHARDS = (".parquet", ".jsonl", ".jsonl.gz")


logger = logging.getLogger(__name__)


def datasets(env: str) -> dict:
    """Env ``env``'s datasets (its manifest's ``datasets``): name -> a file under the data
    folder or a function making the rows; {} for a name no env has."""
    from agentgym import envs  # lazy: loads gymnasium
    try:
        return dict(envs.env_manifest(env).datasets)
    except KeyError:
        return {}


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a ``.jsonl`` file, or of a gzipped ``.jsonl.gz`` one."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a dataset on disk, whatever of :data:`ACCEPTED` it is: parquet is known by
    its magic bytes, gzip likewise, anything else is read as JSONL; a file that is none of
    them is a ValueError naming it and what is accepted."""
    spec = os.path.expanduser(str(path))  # a quoted '~/data/*.parquet' too
    path = Path(spec)
    if any(c in spec for c in "*?["):
        files = sorted(f for f in glob.glob(spec, recursive=True) if Path(f).is_file())
        if not files:
            raise FileNotFoundError(f"data={spec}: the pattern matches no file; accepted: "
                                    f"{ACCEPTED}")
        return [row for f in files for row in read_rows(f)]
    path = Path(path)
    if path.is_dir():
        return _read_folder(path)
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"PAR1":
        import pyarrow.parquet as pq
        return pq.read_table(path).to_pylist()
    opener = gzip.open if head[:2] == b"\x1f\x8b" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (UnicodeDecodeError, ValueError, OSError) as e:
        raise ValueError(f"data={path}: cannot read it ({type(e).__name__}: {e}); "
                         f"accepted: {ACCEPTED}") from None
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
    if bad is not None:
        raise ValueError(f"data={path}: line {bad + 1} is JSON but not an object (a row); "
                         f"accepted: {ACCEPTED}")
    return rows


def _read_folder(path: Path) -> list[dict]:
    """A ``save_to_disk`` folder (its Arrow files, in order), or a folder of shards."""
    if (path / "dataset_dict.json").exists():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise ValueError(f"data={path} is a DatasetDict saved by save_to_disk; pass one "
                         f"split's folder, e.g. data={path / (splits or ['train'])[0]}")
    if (path / "state.json").exists():
        import pyarrow as pa
        state = json.loads((path / "state.json").read_text())
        rows: list[dict] = []
        for part in state.get("_data_files", []):
            with pa.memory_map(str(path / part["filename"])) as source:
                rows += pa.ipc.open_stream(source).read_all().to_pylist()
        return rows
    files = sorted(f for f in path.iterdir() if f.name.endswith(_SHARDS))
    if not files:
        raise ValueError(f"data={path}: the directory holds no .parquet or .jsonl(.gz) shards "
                         f"and no save_to_disk state.json; accepted: {ACCEPTED}")
    return [row for f in files for row in read_rows(f)]


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
    """Resolve a dataset name of ``env``, or a path (a file, a directory, a glob; ``~``
    is the home folder, also where the shell did not expand it: a quoted glob)."""
    name = os.path.expanduser(name)
    if name.endswith(_SHARDS) or "/" in name or any(c in name for c in "*?[") \
            or Path(name).exists():
        path = Path(name)
        if not path.exists() and not any(c in name for c in "*?["):
            raise FileNotFoundError(f"dataset file {name!r} does not exist")
        return path
    names = datasets(env)
    if not isinstance(names.get(name), str):
        raise KeyError(f"unknown dataset {name!r} for env {env!r}{did_you_mean(name, list(names))}"
                       f"; valid: {', '.join(names) or '(none)'}, or {ACCEPTED}")
    return data_dir() / names[name]


def load_rows(env: str, name: str, limit: int = 0, cfg=None) -> list[dict]:
    """Rows of a dataset, validated; the first ``limit`` (0 = all). A dataset the env
    makes gets the config sections it names from ``cfg`` (None: their defaults)."""
    made = datasets(env).get(name)
    made = made if callable(made) else None
    path = f"data={name}" if made else dataset_path(env, name)
    rows = made_rows(env, made, cfg) if made else read_rows(path)
    if limit:
        rows = rows[:limit]
    from agentgym import envs  # lazy: loads gymnasium
    names = envs.env_aliases(env)  # its id and short names (a plugin: its class spec too)
    manifest = envs.env_manifest(env)
    any_rows = manifest.plays_any_rows  # env=agent plays any env's rows
    if manifest.adapt_row is not None:  # rows in the format the env's tasks come in
        rows = [manifest.adapt_row(row, f"{path}:{i + 1}") for i, row in enumerate(rows)]
    for i, row in enumerate(rows):
        validate_row(row, f"{path}:{i + 1}")
        if row.get("env") is None:  # verl's rows: the command's env decides
            row["env"] = env
        elif row["env"] not in names and not any_rows:
            raise ValueError(f"{path}:{i + 1}: row is for env {row['env']!r}, not {env!r} "
                             f"(valid: {', '.join(sorted(names))})")
    verl_fields(rows, env, str(path))
    return rows


def made_rows(env: str, make, cfg=None) -> list[dict]:
    """The rows dataset function ``make`` of env ``env`` makes: its parameters are the
    env's config sections or keys it reads (:meth:`EnvManifest.call`), from ``cfg``, or
    at their defaults without one."""
    from agentgym import envs  # lazy: loads gymnasium
    if cfg is None:
        from agentgym.config import build_config  # lazy: imports the config
        cfg = build_config({"env": env})
    return envs.env_manifest(env).call(make, cfg)


def verl_fields(rows: list[dict], env: str, where: str) -> None:
    """verl's per-row fields that steer its own rollout: ``agent_name`` (which agent loop
    plays the row) and ``extra_info.tools_kwargs`` (each tool's ``create_kwargs``). Here
    the env plays every row and its tools take the row itself (its ``reward_model``), so
    both are named in one warning each, with what happens instead."""
    agents = sorted({str(r["agent_name"]) for r in rows if r.get("agent_name")})
    if agents:
        logger.warning("%s: rows name verl's agent_name %s; env=%s plays every row with its "
                       "own loop (multi-turn, its tools), so agent_name is not used", where,
                       agents, env)
    tools = sorted({t for r in rows for t in ((r.get("extra_info") or {}).get("tools_kwargs")
                                              or {})})
    if tools:
        logger.warning("%s: rows carry verl's extra_info.tools_kwargs for %s; env=%s's tools "
                       "read the row itself (reward_model.ground_truth, extra_info), so "
                       "tools_kwargs is not used", where, tools, env)


@dataclass
class TrainingRows:
    """What :func:`training_rows` kept, and how many it looked at."""

    rows: list[dict]
    total: int  # rows of the dataset
    answerable: int | None = None  # of them, kept by the env's row filter (None: unfiltered)
    parts: dict | None = None  # a mixed run: env -> its TrainingRows
    source: str = ""  # the dataset's name
    kept_by: str = ""  # what the filter keeps, in words (EnvManifest.row_filter)

    def describe(self, name: str, what: str = "training") -> str:
        if self.parts:
            counts = collections.Counter(r["env"] for r in self.rows)
            return f"{len(self.rows)} {what} rows, mixed: " + "; ".join(
                f"{e}: {counts.get(e, 0)} ({p.describe(p.source or name, what)})"
                for e, p in self.parts.items())
        if self.answerable is None:
            return f"{len(self.rows)} {what} rows from {name}"
        return (f"{len(self.rows)} {what} rows from {name}: {self.answerable} of "
                f"{self.total} questions {self.kept_by}")


def training_rows(cfg) -> TrainingRows:
    """The rows a training run draws from: ``data.name``, filtered by the env's row filter
    where it applies (:func:`row_filter_applies`), then the first ``limit``. A mixed run
    (``env=[search,code]``): each env's rows, mixed by ``data.mix``
    (:func:`mix_rows`)."""
    from agentgym.config import env_names  # lazy: imports the config
    from agentgym.rollout.runtime import sub_config  # lazy: loads httpx
    names = env_names(cfg.env)
    if len(names) == 1:
        return question_rows(cfg, cfg.data.name, cfg.limit)
    subs = {e: sub_config(cfg, e) for e in names}
    parts = {e: question_rows(sub, sub.data.name, cfg.limit) for e, sub in subs.items()}
    return mixed(parts, mix_rows({e: p.rows for e, p in parts.items()}, cfg.data.mix,
                                 cfg.trainer.seed))


def heldout_rows(cfg) -> TrainingRows:
    """The held-out rows a training run evaluates on: the first ``trainer.eval_limit`` of
    ``trainer.eval_data``, filtered like the training rows (a question whose answer is
    nowhere in the corpus measures the corpus, not the policy). A mixed run: that many (or
    its own ``trainer.eval_limit``) of each env's own held-out set (its preset's
    ``trainer.eval_data``, or its own)."""
    if not cfg.trainer.eval_limit:
        return TrainingRows([], 0)
    from agentgym.config import env_names  # lazy: imports the config
    from agentgym.rollout.runtime import sub_config  # lazy: loads httpx
    names = env_names(cfg.env)
    if len(names) == 1:
        return question_rows(cfg, cfg.trainer.eval_data, cfg.trainer.eval_limit)
    parts = {}
    for e in names:
        sub = sub_config(cfg, e)
        parts[e] = (question_rows(sub, sub.trainer.eval_data, sub.trainer.eval_limit)
                    if sub.trainer.eval_limit else TrainingRows([], 0))  # 0: none of this env
    return mixed(parts, [r for p in parts.values() for r in p.rows])


def mix_rows(rows: dict[str, list[dict]], weights: list[float], seed: int) -> list[dict]:
    """One list of rows holding env ``k``'s rows in the share ``weights[k]`` (empty: equal
    shares): as many rows as all envs have together, each env's cycled (repeated) or cut
    to its share, shuffled with ``seed``. A row stays whole, so a GRPO group (``n``
    samples of one row) never mixes envs."""
    import random
    names = list(rows)
    if weights and len(weights) != len(names):
        raise ValueError(f"data.mix={weights} has {len(weights)} weights for "
                         f"{len(names)} envs ({', '.join(names)})")
    w = weights or [1.0] * len(names)
    total = sum(len(r) for r in rows.values())
    out = []
    for name, weight in zip(names, w):
        if not rows[name]:
            raise ValueError(f"env {name} has no training rows to mix")
        count = max(1, round(total * weight / sum(w)))
        out += [rows[name][i % len(rows[name])] for i in range(count)]
    random.Random(seed).shuffle(out)
    return out


def mixed(parts: dict[str, "TrainingRows"], rows: list[dict]) -> "TrainingRows":
    """A mixed run's :class:`TrainingRows`, described env by env."""
    out = TrainingRows(rows, sum(p.total for p in parts.values()))
    out.parts = parts
    return out


def row_filter_applies(cfg) -> bool:
    """Whether the env filters its rows under ``cfg`` (``EnvManifest.row_filter``: the search
    env's answerable filter with the shipped corpus); a mixed run decides env by env."""
    from agentgym import envs  # lazy: loads gymnasium

    from agentgym.config import env_names  # lazy: imports the config
    if len(env_names(cfg.env)) > 1:  # a mixed run: decided env by env (sub_config)
        return False
    return envs.env_manifest(cfg.env).row_filter_for(cfg) is not None


def question_rows(cfg, name: str, limit: int = 0) -> TrainingRows:
    """The rows of dataset ``name``, those the env's row filter keeps when it applies
    (:func:`row_filter_applies`; ``EnvManifest.filter_rows``), then the first ``limit`` (0:
    all)."""
    from agentgym import envs  # lazy: loads gymnasium
    rows = load_rows(cfg.env, name, cfg=cfg)
    total = len(rows)
    if not row_filter_applies(cfg):
        return TrainingRows(rows[:limit] if limit else rows, total, source=name)
    manifest = envs.env_manifest(cfg.env)
    try:
        kept, found = manifest.filter_rows_for(cfg, rows, limit)
    except ValueError as e:
        raise ValueError(f"data={name}: {e}") from e
    return TrainingRows(kept, total, found, source=name, kept_by=manifest.row_filter_for(cfg))
