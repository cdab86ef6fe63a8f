"""The cold start's stage: what ``trainer.cold_start`` asks (off, a PATH, auto), the cache
key of its inputs, the decision against the threshold, and the order of its parts
(demonstrations, SFT, the probe after it)."""

from __future__ import annotations

import copy
import shutil
import time
from pathlib import Path
from typing import Any

from agentgym import envs
from agentgym.config import Config, env_names, to_dict
from agentgym.core.device import engine_dtype, run_device
from agentgym.core.paths import cache_dir, file_digest, model_folder
from agentgym.supervision.watchdog import Watchdog, closed_with_end_state
from agentgym.data.demo_builders import builders
from agentgym.data.rows import training_rows, write_jsonl
from agentgym.models.zoo import resolve_model
from agentgym.rollout.runtime import sub_config
from agentgym.trainers.checkpoints import resolve_run_dir
from agentgym.trainers.cold_start.demos import builder, demo_counts, demos_within_budgets, sources
from agentgym.trainers.cold_start.probe import (eval_before, lowest, play_inputs, probe,
                                                probe_base, show)
from agentgym.trainers.cold_start.records import (CURVE, RECORD, complete, digest,
                                                  folder_digest, publish_model, read, watched,
                                                  write_record)
from agentgym.trainers.cold_start.sft_stage import run_sft, sft_settings
from agentgym.trainers.hooks import Hooks, WatchedHooks


def prepare(cfg: Config, hooks: Hooks | None = None, probe_engine=None) -> Config:
    """Apply ``trainer.cold_start``; return the config RL runs with (``model.path`` set to
    the SFT model when a cold start ran, was reused or was given as PATH; ``run_dir``
    fixed, so both stages share it). ``probe_engine``: an engine to probe with instead of
    the model's own (tests script the model's output with it; its results are not
    cached)."""
    hooks = hooks or Hooks()
    mode = cfg.trainer.cold_start
    if mode == "off":
        return cfg
    cfg = copy.deepcopy(cfg)
    cfg.run_dir = str(resolve_run_dir(cfg))
    if mode != "auto":
        return _from_path(cfg, Path(mode), hooks)
    names = env_names(cfg.env)
    parts: dict[str, Config] = {}  # env -> its config (a mixed run: sub_config)
    for name in names:
        sub = sub_config(cfg, name) if len(names) > 1 else cfg
        env = envs.short_name(envs.resolve_env_id(name))
        refusal = envs.env_manifest(name).demo_refusal(sub)
        if refusal is not None:
            hooks.announce(f"cold start: env {name}: {refusal} (builders: "
                           f"{', '.join(builders())}); RL starts from the model as it is "
                           f"(or give trainer.cold_start=PATH)")
            return cfg
        parts[env] = sub
    watch = Watchdog(Path(cfg.run_dir), cfg.deadlines, role="cold start")
    with closed_with_end_state(watch.close):
        cfg = _auto(cfg, parts, Path(cfg.run_dir) / "cold_start", WatchedHooks(hooks, watch),
                    probe_engine)
    return cfg


def _from_path(cfg: Config, path: Path, hooks: Hooks) -> Config:
    try:
        path = model_folder(path, "trainer.cold_start")
    except ValueError as e:
        raise ValueError(f"{e}; or auto, or off") from None
    hooks.announce(f"cold start: RL starts from {path} (trainer.cold_start=PATH)")
    return _start_from(cfg, str(path))


def _start_from(cfg: Config, model: str | None) -> Config:
    if model:
        cfg.model.path = model
    return cfg


def _auto(cfg: Config, parts: dict[str, Config], stage_dir: Path, hooks: Hooks,
          probe_engine) -> Config:
    """The cold start of ``parts`` (env -> its config: one, or each env of a mixed run,
    whose demonstrations are pooled into one SFT; it runs when any env's probe is below
    the threshold)."""
    t = cfg.trainer
    base = resolve_model(cfg.model.path or cfg.model.name)
    found = training_rows(cfg)
    rows = {e: (found.parts[n].rows if found.parts else found.rows)
            for e, n in zip(parts, env_names(cfg.env))}
    single = len(parts) == 1
    env = next(iter(parts))
    inputs = {"model": folder_digest(base),
              "env": env if single else list(parts),
              "tools": (sources(cfg, env) if single else
                        {e: sources(sub, e) for e, sub in parts.items()}),
              "budgets": to_dict(cfg.rollout) | {"temperature": 0.0, "n": 1},
              **({"per_env": cfg.per_env} if cfg.per_env else {}),
              "engine_dtype": engine_dtype(cfg.engine.dtype, cfg.model.dtype,
                                           run_device(cfg))}
    probe_rows = [r for e in parts for r in rows[e][:t.cold_start_probe]]
    played = play_inputs(inputs)
    probe_key = digest({**played, "rows": probe_rows})
    key = digest({**inputs, "rows": rows[env] if single else rows,
                   "demos": t.cold_start_demos,
                   "builder": (builder(cfg, env) if single else
                               {e: builder(cfg, e) for e in parts}),
                   "sft": sft_settings(cfg), "probe": probe_key,
                   "threshold": t.cold_start_threshold})
    earlier = read(stage_dir / RECORD)
    if (earlier and earlier.get("key") == key and probe_engine is None
            and (not earlier.get("model") or Path(earlier["model"]).is_dir())):
        hooks.announce(f"cold start: this run decided before ({earlier['decision']}; "
                       f"{stage_dir / RECORD}); starting RL from "
                       f"{earlier.get('model') or base}")
        return _start_from(cfg, earlier.get("model"))
    store = cache_dir() / "cold_start"
    before, played_before = probe_base(cfg, base, probe_rows, probe_key, played, store,
                                        hooks, probe_engine)
    record: dict[str, Any] = {"key": key, "probe_before": before,
                              "threshold": t.cold_start_threshold, "base_model": str(base),
                              "training_rows": sum(len(r) for r in rows.values())}
    worst = lowest(before)
    if worst >= t.cold_start_threshold:
        hooks.announce(f"cold start: not needed: format-valid {show(before)} on "
                       f"{before['count']} training questions >= trainer.cold_start_threshold="
                       f"{t.cold_start_threshold}")
        write_record(stage_dir, {**record, "decision": "skipped", "model": None})
        return cfg
    record["eval_before"] = played_before or eval_before(cfg, base, played, store, hooks,
                                                          probe_engine)
    cached = store / key
    if complete(cached):
        done = read(cached / RECORD)
        after = (f"format-valid after it: {show(done['probe_after'])}"
                 if done.get("probe_after") else "RL's step-0 eval measures it")
        hooks.announce(f"cold start: format-valid {show(before)} < "
                       f"{t.cold_start_threshold}; reusing the cached SFT model {cached / 'model'} "
                       f"({after})")
        write_record(stage_dir, {**done, **record, "decision": "reused", "cache": str(cached),
                                  "model": str(cached / "model")})
        if (cached / CURVE).is_file():  # the curve of the SFT that made the cached model
            shutil.copy2(cached / CURVE, stage_dir / CURVE)
        return _start_from(cfg, str(cached / "model"))
    hooks.announce(f"cold start: format-valid {show(before)} on {before['count']} "
                   f"training questions < trainer.cold_start_threshold={t.cold_start_threshold}; "
                   f"building {demo_counts(cfg)} demonstrations"
                   f"{'' if single else ' per env'}, then SFT")
    model_dir = _run_stage(cfg, parts, rows, probe_rows, base, stage_dir, cached, record, hooks)
    return _start_from(cfg, str(model_dir))


def _step0_eval(cfg: Config) -> bool:
    """Will RL evaluate its starting model (the SFT result) on held-out questions before
    its first step? Then that eval is the cold start's check, and the probe after SFT
    (the same measure on fewer, training questions) is not run."""
    t = cfg.trainer
    return bool(t.eval_limit) and t.total_steps > 0


def _run_stage(cfg: Config, parts: dict[str, Config], rows: dict[str, list[dict]],
               probe_rows: list[dict], base: Path, stage_dir: Path, cached: Path, record: dict,
               hooks: Hooks) -> Path:
    """Demonstrations (each env's), SFT, the probe of its result; the model published to
    ``cached`` and the record written. Returns the published model's folder."""
    before = record["probe_before"]
    t0 = time.perf_counter()
    demos, looked_at, over = [], 0, 0
    for env, sub in parts.items():
        with watched(hooks, "rollout"):
            got, at, too_long = demos_within_budgets(sub, env, rows[env], base,
                                                      sub.trainer.cold_start_demos, hooks)
        if not got:
            raise ValueError(f"cold start: no {env} demonstration could be built from {at} "
                             f"training rows of {sub.data.name}; train from an SFT "
                             f"checkpoint (trainer.cold_start=PATH) or set "
                             f"trainer.cold_start=off")
        demos, looked_at, over = demos + got, looked_at + at, over + too_long
    stage_dir.mkdir(parents=True, exist_ok=True)
    demos_file = stage_dir / "demos.jsonl"
    write_jsonl(demos_file, demos)
    t1 = time.perf_counter()
    hooks.announce(f"cold start: {len(demos)} demonstrations from {looked_at} training rows "
                   f"({over} over the rollout budgets) in {t1 - t0:.0f}s; SFT in {stage_dir}")
    with watched(hooks, "update"):
        sft_model, sft_summary = run_sft(cfg, base, demos_file, stage_dir, hooks)
    t2 = time.perf_counter()
    loss = (f"SFT loss {sft_summary['loss_first']:.3f} -> {sft_summary['loss_last']:.3f}, "
            f"{sft_summary['steps']} steps, {t2 - t1:.0f}s")
    if _step0_eval(cfg):  # RL's step-0 eval measures the SFT model on held-out questions
        after = None
        hooks.announce(f"cold start: {loss}; RL's step-0 eval measures the result")
    else:
        with watched(hooks, "eval"):
            after = probe(cfg, sft_model, probe_rows, hooks, None)
        hooks.announce(f"cold start: format-valid {show(before)} -> "
                       f"{show(after)} on the {after['count']} probe questions ({loss})")
    t3 = time.perf_counter()
    done = {**record, "probe_after": after, "demos": len(demos), "rows_looked_at": looked_at,
            "demos_over_budget": over, "demos_sha256": file_digest(demos_file),
            "sft": {**sft_summary, **sft_settings(cfg)},
            "seconds": {"demos": t1 - t0, "sft": t2 - t1, "probe_after": t3 - t2}}
    model_dir = publish_model(sft_model, cached, done, stage_dir / CURVE)
    write_record(stage_dir, {**done, "decision": "ran", "cache": str(cached),
                              "model": str(model_dir)})
    shutil.rmtree(stage_dir / "checkpoints", ignore_errors=True)  # the model is in the cache
    return model_dir
