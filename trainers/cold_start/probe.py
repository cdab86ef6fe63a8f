"""Greedy episodes that measure a model on the env's protocol: the probe on training
questions (format validity decides whether the cold start runs) and the held-out "before"
eval, both cached by their inputs."""

from __future__ import annotations

import copy
import time
from pathlib import Path

from agentgym.config import Config, is_mixed
from agentgym.data.rows import heldout_rows
from agentgym.models.zoo import load_tokenizer
from agentgym.rollout.manager import row_uid
from agentgym.rollout.runtime import engine_for
from agentgym.trainers.cold_start.records import digest, read, watched, write_atomic
from agentgym.trainers.hooks import Hooks
from agentgym.trainers.workers import LocalWorkers, eval_metrics


def play_inputs(inputs: dict) -> dict:
    """The part of the cold start's inputs that the base model's probe and "before" eval
    depend on: a mixed run's per-env values of the rollout only, so a change of the
    demonstrations' count or the SFT's rates plays neither again (the held-out rows
    themselves are in the eval's key)."""
    rollout = {k: v for k, v in inputs.get("per_env", {}).items() if k.startswith("rollout.")}
    return {k: v for k, v in inputs.items() if k != "per_env"} | (
        {"per_env": rollout} if rollout else {})


def probe_base(cfg: Config, base: Path, probe_rows: list[dict], probe_key: str,
                inputs: dict, store: Path, hooks: Hooks, probe_engine) -> tuple[dict, dict | None]:
    """The starting model's probe (cached by ``probe_key``), and its held-out "before"
    eval when that was played with it. Not cached, the eval plays in the probe's batch: one
    engine, one continuous batch (15-20 s less in the demo than two), at the cost of an
    eval that a run needing no cold start skips."""
    probe_file = store / f"probe-{probe_key}.json"
    before = None if probe_engine is not None else read(probe_file)
    if before is not None:
        hooks.announce(f"cold start: probe of {base.name} read from the cache ({probe_file})")
        return before, None
    held = _held_out(cfg, inputs, store) if probe_engine is None else None
    if held is not None and read(held[1]) is not None:
        held = None
    hooks.announce(f"cold start: probing {base.name} on {len(probe_rows)} training "
                   f"questions (greedy)" + (f", with its eval on {len(held[0])} held-out "
                                            f"questions ({cfg.trainer.eval_data})" if held else ""))
    with watched(hooks, "eval"):
        played = play(cfg, base, [probe_rows] + ([held[0]] if held else []), hooks,
                       probe_engine)
    if probe_engine is None:
        write_atomic(probe_file, played[0])
    if held:
        write_atomic(held[1], played[1])
    return played[0], (played[1] if held else None)


def lowest(probe: dict) -> float:
    """The lowest format validity of a probe: its own, or a mixed run's worst env's."""
    return min([probe["format_valid"], *(p["format_valid"] for p in probe.get("envs", {}).values())])


def show(probe: dict) -> str:
    """A probe's format validity in words (a mixed run's env by env)."""
    if not probe.get("envs"):
        return f"{probe['format_valid']:.2f}"
    return ", ".join(f"{e} {p['format_valid']:.2f}" for e, p in probe["envs"].items())


def probe(cfg: Config, model_path: Path, rows: list[dict], hooks: Hooks, engine) -> dict:
    """Greedy episodes of ``rows`` with the model at ``model_path`` (or ``engine``) in the
    in-process HF engine: format validity and EM, with the run's budgets and tools."""
    return play(cfg, model_path, [rows], hooks, engine)[0]


def play(cfg: Config, model_path: Path, row_sets: list[list[dict]], hooks: Hooks,
          engine) -> list[dict]:
    """:func:`probe` of each of ``row_sets``, played by one engine in one batch (in turn
    when two sets share a row id: the trajectories are told apart by it, as context
    management may split an episode in several)."""
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

    def play_rows(rows: list[dict]) -> list:
        return workers.generate(rows, 1, cfg.trainer.seed, hooks, greedy=True)

    try:
        if together:
            trajs = play_rows([r for rows in row_sets for r in rows])
            parts = [[tr for tr in trajs if tr.uid in ids] for ids in uids]
        else:
            parts = [play_rows(rows) for rows in row_sets]
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


def _held_out(cfg: Config, inputs: dict, store: Path) -> tuple[list[dict], Path] | None:
    """The held-out rows of the "before" eval and its cache file; None without one."""
    if not cfg.trainer.eval_limit:
        return None
    rows = heldout_rows(cfg).rows
    return rows, store / f"eval-{digest({**inputs, 'eval_rows': rows})}.json"


def eval_before(cfg: Config, base: Path, inputs: dict, store: Path, hooks: Hooks,
                 probe_engine) -> dict | None:
    """The starting model on the held-out rows RL evaluates on (``trainer.eval_data``, first
    ``trainer.eval_limit``), for the before / after-SFT / after-RL comparison; cached like
    the probe."""
    held = _held_out(cfg, inputs, store)
    if held is None:
        return None
    rows, path = held
    found = None if probe_engine is not None else read(path)
    if found is not None:
        hooks.announce(f"cold start: held-out eval of {base.name} read from the cache ({path})")
        return found
    hooks.announce(f"cold start: evaluating {base.name} on {len(rows)} held-out questions "
                   f"({cfg.trainer.eval_data}) for comparison")
    with watched(hooks, "eval"):
        found = probe(cfg, base, rows, hooks, probe_engine)
    if probe_engine is None:
        write_atomic(path, found)
    return found
