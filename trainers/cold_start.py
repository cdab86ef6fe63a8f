"""The cold start inside ``agentgym train``: SFT on demonstrations when the starting model
does not follow the env's protocol, then RL from the result.

    agentgym train env=search                              # trainer.cold_start=auto (default)
    agentgym train env=search trainer.cold_start=off       # RL from the model as it is
    agentgym train env=search trainer.cold_start=runs/sft   # a ready SFT run (its newest checkpoint)

GRPO learns from reward differences within a group. A model that never produces a
well-formed answer (the base smollm2-135m on Search-R1's protocol: format-valid 0.01)
earns 0 on every sample, every advantage is 0, and RL has nothing to learn from. With
``trainer.cold_start=auto`` the run first plays ``trainer.cold_start_probe`` training
questions greedily; if the share of format-valid episodes (ended with an answer, no
malformed action) is below ``trainer.cold_start_threshold``, it

1. builds demonstrations with the env's builder (:mod:`agentgym.data.demo_builders`) from the
   training rows until it has ``trainer.cold_start_demos`` that fit the rollout budgets;
2. runs SFT on them (:func:`agentgym.trainers.sft.sft`: ``sft.epochs``, ``sft.batch_size``, lr
   ``trainer.cold_start_lr`` with cosine decay) in ``RUN_DIR/cold_start/`` (its own
   ``metrics.jsonl``, ``loss_curve.png``, TensorBoard events, checkpoints, so a killed
   cold start resumes);
3. probes the SFT result on the same questions (unless RL's step-0 eval measures it on
   the held-out questions: ``trainer.eval_limit`` > 0 and steps to take), and starts RL
   from it.

A mixed run (``env=[search,code]``) probes each env on its own training rows and runs the
cold start when any env is below the threshold: ``trainer.cold_start_demos``
demonstrations per env, from each env's builder, and one SFT over all of them.

The probe's result and the SFT model are cached by content under
``$AGENTGYM_CACHE/cold_start/`` (default ``~/.cache/agentgym``): the key hashes the
starting model's files, the env, the training rows, the corpus or tools the
demonstrations come from, the budgets and the SFT settings, so a second run with the same
inputs reuses them, and any change of input builds anew. ``RUN_DIR/cold_start/
cold_start.json`` records what happened (probe figures, demonstrations, SFT loss, timings,
the model RL started from); a resumed run reads it back.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from agentgym.config import Config, env_names, to_dict
from agentgym.data.rows import training_rows, write_jsonl
from agentgym.core.device import engine_dtype, mixed_precision, run_device
from agentgym.core.paths import cache_dir, file_digest, model_folder
from agentgym.models.plan import micro_batch_tokens
from agentgym.core.watchdog import NO_WATCH, Watchdog, closed_with_end_state
from agentgym.trainers.hooks import Hooks, WatchedHooks
from agentgym.trainers.checkpoints import latest_checkpoint, resolve_run_dir

logger = logging.getLogger(__name__)

_RECORD = "cold_start.json"
_CURVE = "loss_curve.png"  # the SFT's, written by agentgym.trainers.sft


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
    from agentgym import envs
    from agentgym.data.demo_builders import builders
    from agentgym.rollout.runtime import sub_config
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


def _stage(hooks: Hooks, name: str):
    """A stage of the cold start under its deadline (``deadlines.<name>_s``, counted from
    the last episode or SFT step): its probes and evals are ``eval``, its demonstrations
    ``rollout``, its SFT ``update``."""
    return getattr(hooks, "watch", NO_WATCH).stage(name, 0)


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
    from agentgym.models.zoo import resolve_model
    t = cfg.trainer
    base = resolve_model(cfg.model.path or cfg.model.name)
    found = training_rows(cfg)
    rows = {e: (found.parts[n].rows if found.parts else found.rows)
            for e, n in zip(parts, env_names(cfg.env))}
    single = len(parts) == 1
    env = next(iter(parts))
    inputs = {"model": folder_digest(base),
              "env": env if single else list(parts),
              "tools": (_sources(cfg, env) if single else
                        {e: _sources(sub, e) for e, sub in parts.items()}),
              "budgets": to_dict(cfg.rollout) | {"temperature": 0.0, "n": 1},
              **({"per_env": cfg.per_env} if cfg.per_env else {}),
              "engine_dtype": engine_dtype(cfg.engine.dtype, cfg.model.dtype,
                                           run_device(cfg))}
    probe_rows = [r for e in parts for r in rows[e][:t.cold_start_probe]]
    played = _play_inputs(inputs)
    probe_key = _digest({**played, "rows": probe_rows})
    key = _digest({**inputs, "rows": rows[env] if single else rows,
                   "demos": t.cold_start_demos,
                   "builder": (_builder(cfg, env) if single else
                               {e: _builder(cfg, e) for e in parts}),
                   "sft": _sft_settings(cfg), "probe": probe_key,
                   "threshold": t.cold_start_threshold})
    earlier = _read(stage_dir / _RECORD)
    if (earlier and earlier.get("key") == key and probe_engine is None
            and (not earlier.get("model") or Path(earlier["model"]).is_dir())):
        hooks.announce(f"cold start: this run decided before ({earlier['decision']}; "
                       f"{stage_dir / _RECORD}); starting RL from "
                       f"{earlier.get('model') or base}")
        return _start_from(cfg, earlier.get("model"))
    store = cache_dir() / "cold_start"
    before, played_before = _probe_base(cfg, base, probe_rows, probe_key, played, store,
                                        hooks, probe_engine)
    record: dict[str, Any] = {"key": key, "probe_before": before,
                              "threshold": t.cold_start_threshold, "base_model": str(base),
                              "training_rows": sum(len(r) for r in rows.values())}
    lowest = _lowest(before)
    if lowest >= t.cold_start_threshold:
        hooks.announce(f"cold start: not needed: format-valid {_show(before)} on "
                       f"{before['count']} training questions >= trainer.cold_start_threshold="
                       f"{t.cold_start_threshold}")
        _write_record(stage_dir, {**record, "decision": "skipped", "model": None})
        return cfg
    record["eval_before"] = played_before or _eval_before(cfg, base, played, store, hooks,
                                                          probe_engine)
    cached = store / key
    if _complete(cached):
        done = _read(cached / _RECORD)
        after = (f"format-valid after it: {_show(done['probe_after'])}"
                 if done.get("probe_after") else "RL's step-0 eval measures it")
        hooks.announce(f"cold start: format-valid {_show(before)} < "
                       f"{t.cold_start_threshold}; reusing the cached SFT model {cached / 'model'} "
                       f"({after})")
        _write_record(stage_dir, {**done, **record, "decision": "reused", "cache": str(cached),
                                  "model": str(cached / "model")})
        if (cached / _CURVE).is_file():  # the curve of the SFT that made the cached model
            shutil.copy2(cached / _CURVE, stage_dir / _CURVE)
        return _start_from(cfg, str(cached / "model"))
    hooks.announce(f"cold start: format-valid {_show(before)} on {before['count']} "
                   f"training questions < trainer.cold_start_threshold={t.cold_start_threshold}; "
                   f"building {_demo_counts(cfg)} demonstrations"
                   f"{'' if single else ' per env'}, then SFT")
    model_dir = _run_stage(cfg, parts, rows, probe_rows, base, stage_dir, cached, record, hooks)
    return _start_from(cfg, str(model_dir))


def _play_inputs(inputs: dict) -> dict:
    """The part of the cold start's inputs that the base model's probe and "before" eval
    depend on: a mixed run's per-env values of the rollout only, so a change of the
    demonstrations' count or the SFT's rates plays neither again (the held-out rows
    themselves are in the eval's key)."""
    rollout = {k: v for k, v in inputs.get("per_env", {}).items() if k.startswith("rollout.")}
    return {k: v for k, v in inputs.items() if k != "per_env"} | (
        {"per_env": rollout} if rollout else {})


def _probe_base(cfg: Config, base: Path, probe_rows: list[dict], probe_key: str,
                inputs: dict, store: Path, hooks: Hooks, probe_engine) -> tuple[dict, dict | None]:
    """The starting model's probe (cached by ``probe_key``), and its held-out "before"
    eval when that was played with it. Not cached, the eval plays in the probe's batch: one
    engine, one continuous batch (15-20 s less in the demo than two), at the cost of an
    eval that a run needing no cold start skips."""
    probe_file = store / f"probe-{probe_key}.json"
    before = None if probe_engine is not None else _read(probe_file)
    if before is not None:
        hooks.announce(f"cold start: probe of {base.name} read from the cache ({probe_file})")
        return before, None
    held = _before_eval(cfg, inputs, store) if probe_engine is None else None
    if held is not None and _read(held[1]) is not None:
        held = None
    hooks.announce(f"cold start: probing {base.name} on {len(probe_rows)} training "
                   f"questions (greedy)" + (f", with its eval on {len(held[0])} held-out "
                                            f"questions ({cfg.trainer.eval_data})" if held else ""))
    with _stage(hooks, "eval"):
        played = _play(cfg, base, [probe_rows] + ([held[0]] if held else []), hooks,
                       probe_engine)
    if probe_engine is None:
        _write_atomic(probe_file, played[0])
    if held:
        _write_atomic(held[1], played[1])
    return played[0], (played[1] if held else None)


def _step0_eval(cfg: Config) -> bool:
    """Will RL evaluate its starting model (the SFT result) on held-out questions before
    its first step? Then that eval is the cold start's check, and the probe after SFT
    (the same measure on fewer, training questions) is not run."""
    t = cfg.trainer
    return bool(t.eval_limit) and t.total_steps > 0


def _demo_counts(cfg: Config) -> str:
    """``trainer.cold_start_demos`` as given: one count, or one per env (``8/32``)."""
    counts = cfg.per_env.get("trainer.cold_start_demos", [cfg.trainer.cold_start_demos])
    return "/".join(map(str, counts))


def _lowest(probe: dict) -> float:
    """The lowest format validity of a probe: its own, or a mixed run's worst env's."""
    return min([probe["format_valid"], *(p["format_valid"] for p in probe.get("envs", {}).values())])


def _show(probe: dict) -> str:
    """A probe's format validity in words (a mixed run's env by env)."""
    if not probe.get("envs"):
        return f"{probe['format_valid']:.2f}"
    return ", ".join(f"{e} {p['format_valid']:.2f}" for e, p in probe["envs"].items())


def _run_stage(cfg: Config, parts: dict[str, Config], rows: dict[str, list[dict]],
               probe_rows: list[dict], base: Path, stage_dir: Path, cached: Path, record: dict,
               hooks: Hooks) -> Path:
    """Demonstrations (each env's), SFT, the probe of its result; the model published to
    ``cached`` and the record written. Returns the published model's folder."""
    before = record["probe_before"]
    t0 = time.perf_counter()
    demos, looked_at, over = [], 0, 0
    for env, sub in parts.items():
        with _stage(hooks, "rollout"):
            got, at, too_long = _demos_within_budgets(sub, env, rows[env], base,
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
    with _stage(hooks, "update"):
        sft_model, sft_summary = _sft(cfg, base, demos_file, stage_dir, hooks)
    t2 = time.perf_counter()
    loss = (f"SFT loss {sft_summary['loss_first']:.3f} -> {sft_summary['loss_last']:.3f}, "
            f"{sft_summary['steps']} steps, {t2 - t1:.0f}s")
    if _step0_eval(cfg):  # RL's step-0 eval measures the SFT model on held-out questions
        after = None
        hooks.announce(f"cold start: {loss}; RL's step-0 eval measures the result")
    else:
        with _stage(hooks, "eval"):
            after = _probe(cfg, sft_model, probe_rows, hooks, None)
        hooks.announce(f"cold start: format-valid {_show(before)} -> "
                       f"{_show(after)} on the {after['count']} probe questions ({loss})")
    t3 = time.perf_counter()
    done = {**record, "probe_after": after, "demos": len(demos), "rows_looked_at": looked_at,
            "demos_over_budget": over, "demos_sha256": file_digest(demos_file),
            "sft": {**sft_summary, **_sft_settings(cfg)},
            "seconds": {"demos": t1 - t0, "sft": t2 - t1, "probe_after": t3 - t2}}
    model_dir = _publish_model(sft_model, cached, done, stage_dir / _CURVE)
    _write_record(stage_dir, {**done, "decision": "ran", "cache": str(cached),
                              "model": str(model_dir)})
    shutil.rmtree(stage_dir / "checkpoints", ignore_errors=True)  # the model is in the cache
    return model_dir


# --- the stages ------------------------------------------------------------------------
def _probe(cfg: Config, model_path: Path, rows: list[dict], hooks: Hooks, engine) -> dict:
    """Greedy episodes of ``rows`` with the model at ``model_path`` (or ``engine``) in the
    in-process HF engine: format validity and EM, with the run's budgets and tools."""
    return _play(cfg, model_path, [rows], hooks, engine)[0]


def _play(cfg: Config, model_path: Path, row_sets: list[list[dict]], hooks: Hooks,
          engine) -> list[dict]:
    """:func:`_probe` of each of ``row_sets``, played by one engine in one batch (in turn
    when two sets share a row id: the trajectories are told apart by it, as context
    management may split an episode in several)."""
    from agentgym.config import is_mixed
    from agentgym.models.zoo import load_tokenizer
    from agentgym.rollout.manager import row_uid
    from agentgym.rollout.runtime import engine_for
    from agentgym.trainers.workers import LocalWorkers, eval_metrics
    tokenizer = load_tokenizer(model_path)
    own = engine is None
    if own:  # in this process, whatever engine RL uses: servers would hold other weights
        local = copy.deepcopy(cfg)
        local.engine.name = "hf"
        engine = engine_for(local, model_path, tokenizer)
    offsets = [sum(len(r) for r in row_sets[:k]) for k in range(len(row_sets))]
    uids = [{row_uid(row, at + i) for i, row in enumerate(rows)}
            for rows, at in zip(row_sets, offsets)]
    together = sum(map(len, uids)) == len(set().union(*uids))
    t0 = time.perf_counter()
    workers = LocalWorkers(cfg, engine, tokenizer)

    def play(rows: list[dict]) -> list:
        return workers.generate(rows, 1, cfg.trainer.seed, hooks, greedy=True)

    try:
        if together:
            trajs = play([r for rows in row_sets for r in rows])
            parts = [[tr for tr in trajs if tr.uid in ids] for ids in uids]
        else:
            parts = [play(rows) for rows in row_sets]
    finally:
        workers.close(engine_too=False)
        if own:
            engine.close()
    seconds = time.perf_counter() - t0
    out = []
    for part in parts:
        m = eval_metrics(part, per_env=is_mixed(cfg))
        one = {"format_valid": m["eval/format_valid"], "em": m["eval/em"],
               "count": int(m["eval/count"]), "tool_calls": m["eval/tool_calls"],
               "seconds": seconds}
        envs = sorted({k.split("/", 1)[0] for k in m if k.endswith("/eval/count")})
        if envs:  # a mixed run: env by env too
            one["envs"] = {e: {"format_valid": m[f"{e}/eval/format_valid"],
                               "em": m[f"{e}/eval/em"], "count": int(m[f"{e}/eval/count"]),
                               "tool_calls": m[f"{e}/eval/tool_calls"]} for e in envs}
        out.append(one)
    return out


def _before_eval(cfg: Config, inputs: dict, store: Path) -> tuple[list[dict], Path] | None:
    """The held-out rows of the "before" eval and its cache file; None without one."""
    from agentgym.data.rows import heldout_rows
    if not cfg.trainer.eval_limit:
        return None
    rows = heldout_rows(cfg).rows
    return rows, store / f"eval-{_digest({**inputs, 'eval_rows': rows})}.json"


def _eval_before(cfg: Config, base: Path, inputs: dict, store: Path, hooks: Hooks,
                 probe_engine) -> dict | None:
    """The starting model on the held-out rows RL evaluates on (``trainer.eval_data``, first
    ``trainer.eval_limit``), for the before / after-SFT / after-RL comparison; cached like
    the probe."""
    held = _before_eval(cfg, inputs, store)
    if held is None:
        return None
    rows, path = held
    found = None if probe_engine is not None else _read(path)
    if found is not None:
        hooks.announce(f"cold start: held-out eval of {base.name} read from the cache ({path})")
        return found
    hooks.announce(f"cold start: evaluating {base.name} on {len(rows)} held-out questions "
                   f"({cfg.trainer.eval_data}) for comparison")
    with _stage(hooks, "eval"):
        found = _probe(cfg, base, rows, hooks, probe_engine)
    if probe_engine is None:
        _write_atomic(path, found)
    return found


def _demos_within_budgets(cfg: Config, env: str, rows: list[dict], model_path, want: int,
                          hooks: Hooks) -> tuple[list[dict], int, int]:
    """Demonstrations built from ``rows`` in order (the env's builder:
    :func:`agentgym.data.demo_builders.build_demos`) until ``want`` fit the rollout budgets in
    this model's tokens (:func:`agentgym.data.demos.within_budgets`). Returns ``(demos, rows
    looked at, demos over the budgets)``."""
    from agentgym.data.demo_builders import build_demos
    from agentgym.data.demos import within_budgets
    from agentgym.models.zoo import load_tokenizer
    from agentgym.rollout.chat import ChatTokens
    from agentgym.rollout.runtime import env_factory
    chat = ChatTokens(load_tokenizer(model_path))
    make_env = env_factory(cfg)
    kept: list[dict] = []
    at = over = 0
    why = None
    hooks.phase("demos", want)
    while len(kept) < want and at < len(rows):
        # about a quarter of the rows yield one on the shipped search data; ask for more
        chunk = rows[at:at + max(16, 4 * (want - len(kept)))]
        built = build_demos(env, chunk, make_env, workers=cfg.rollout.env_workers,
                            **_demo_options(cfg, env))
        fit, too_long, reason = within_budgets(built, chat, env, cfg.rollout, want - len(kept))
        kept, over, why = kept + fit, over + too_long, why or reason
        if fit:
            hooks.advance(len(fit))
        at += len(chunk)
        if not kept and over >= 16:
            raise ValueError(f"cold start: the first {over} demonstrations are all over the "
                             f"rollout budgets ({why}); raise that budget or train from an "
                             f"SFT checkpoint (trainer.cold_start=PATH)")
    return kept, at, over


def _sft(cfg: Config, base: Path, demos_file: Path, stage_dir: Path,
         hooks: Hooks) -> tuple[Path, dict]:
    """SFT of ``base`` on the demonstrations in ``stage_dir``; the final checkpoint and a
    summary of the loss curve."""
    from agentgym.trainers.sft import sft
    scfg = copy.deepcopy(cfg)
    scfg.model.path = str(base)
    scfg.data.name = str(demos_file)
    scfg.limit = 0
    scfg.run_dir = str(stage_dir)
    steps = scfg.sft.max_steps or scfg.sft.epochs * math.ceil(
        sum(1 for _ in demos_file.open()) / scfg.sft.batch_size)
    scfg.trainer.lr = cfg.trainer.cold_start_lr
    scfg.trainer.lr_schedule = "cosine"
    scfg.trainer.warmup_steps = min(2, max(0, steps - 1))
    scfg.trainer.resume = "auto"  # a killed cold start continues from its SFT checkpoint
    scfg.trainer.save_every = max(1, cfg.trainer.save_every)
    scfg.sft.eval_limit = 0
    rates = cfg.per_env.get("trainer.cold_start_lr")
    sft(scfg, _SFTStageHooks(hooks),
        lr_by_env=dict(zip(env_names(cfg.env), rates)) if rates else None)
    final = latest_checkpoint(stage_dir)
    if final is None:
        raise RuntimeError(f"cold start: SFT in {stage_dir} left no checkpoint")
    losses = [r["train/loss"] for r in _metrics(stage_dir) if "train/loss" in r]
    return final, {"steps": len(losses), "loss_first": losses[0] if losses else math.nan,
                   "loss_last": losses[-1] if losses else math.nan}


class _SFTStageHooks(Hooks):
    """The run's hooks for the SFT stage: its progress bar and messages; its per-step
    metrics go to the stage's own metrics.jsonl, not the RL step lines."""

    def __init__(self, outer: Hooks) -> None:
        self.outer = outer

    def phase(self, name: str, total: int) -> None:
        self.outer.phase("sft", total)

    def advance(self, k: int = 1) -> None:
        self.outer.advance(k)

    def announce(self, text: str) -> None:
        self.outer.announce(text)


# --- keys and files --------------------------------------------------------------------
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


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _sources(cfg: Config, env: str) -> Any:
    """What the env's observations come from (``EnvManifest.sources``): the cache key's part."""
    from agentgym import envs
    return envs.env_manifest(env).sources_for(cfg)


def _demo_options(cfg: Config, env: str) -> dict:
    from agentgym import envs
    return envs.env_manifest(env).demo_options_for(cfg)


def _builder(cfg: Config, env: str) -> dict:
    """The cache key's part for the demonstrations: the builder's options and the digest of
    its module's source, so that a change to how the env demonstrates makes new
    demonstrations (and a new SFT) rather than reusing the cached ones."""
    import inspect
    from agentgym import envs
    build = envs.env_manifest(env).demonstrate
    source = inspect.getsourcefile(build) if build else None
    return {**_demo_options(cfg, env),
            **({"builder_source": file_digest(Path(source))} if source else {})}


def _sft_settings(cfg: Config) -> dict:
    s, t = cfg.sft, cfg.trainer
    return {"epochs": s.epochs, "batch_size": s.batch_size, "max_steps": s.max_steps,
            "max_length": s.max_length, "lr": t.cold_start_lr, "seed": t.seed,
            "group_by_length": s.group_by_length, "weight_decay": t.weight_decay,
            "max_grad_norm": t.max_grad_norm,
            # as resolved: "" (fp32 on the CPU) stays "", so CPU cache keys are unchanged
            "mixed_precision": mixed_precision(t.mixed_precision,
                                               run_device(cfg)),
            "model_dtype": cfg.model.dtype, "lora": to_dict(cfg.model.lora),
            "micro_batch_tokens": micro_batch_tokens(cfg), "backend": t.backend,
            "zero_stage": t.zero_stage, "nprocs": t.nprocs,
            # per env only when given, so the keys of one rate are unchanged
            **({"lr_by_env": cfg.per_env["trainer.cold_start_lr"]}
               if "trainer.cold_start_lr" in cfg.per_env else {})}


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_atomic(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{time.time_ns()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    tmp.replace(path)


def _write_record(stage_dir: Path, record: dict) -> None:
    _write_atomic(stage_dir / _RECORD, record)


def _complete(cached: Path) -> bool:
    return _read(cached / _RECORD) is not None and (cached / "model" / "config.json").is_file()


def _publish_model(checkpoint: Path, cached: Path, record: dict, curve: Path) -> Path:
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
        (tmp / _RECORD).write_text(json.dumps(record, indent=2, default=str) + "\n")
        if curve.is_file():
            shutil.copy2(curve, tmp / _CURVE)
        if _complete(cached):  # another run published the same inputs meanwhile: use it
            logger.info("cold start: %s was published by another run; using it", cached)
        else:
            if cached.exists():  # an incomplete earlier attempt
                shutil.rmtree(cached)
            tmp.rename(cached)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return cached / "model"
