"""GRPO for multi-turn tool-using agents, top to bottom.

    agentgym train env=search                                   # smollm2-135m, shipped data
    agentgym train env=search model=tiny trainer.total_steps=2  # seconds, for a smoke test
    agentgym train env=search run_dir=runs/a trainer.resume=auto  # continue a killed run

Each step:
  1. roll out ``trainer.prompts_per_step`` prompts ``rollout.n`` times each (the
     GenerationManager; engine logprobs and the policy version land on every trajectory);
  2. recompute old logprobs with the trainer (and reference logprobs when ``algo.kl_coef``
     > 0); report the engine/trainer logprob drift on sampled tokens;
  3. group-normalized advantages per prompt;
  4. ``trainer.ppo_epochs`` x ``trainer.mini_batches`` optimizer steps of the clipped
     surrogate, micro-batched under ``trainer.micro_batch_tokens`` with gradient
     accumulation, aggregated by ``algo.loss_agg_mode`` over the whole mini-batch;
  5. sync the new weights into the rollout engine (policy version + 1);
  6. log metrics (JSONL, TensorBoard, reward PNG) and save HF checkpoints.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import logging
import random
import re
import shutil
import time
from pathlib import Path

import torch

from agentgym.config import Config, to_dict
from agentgym.data import load_rows
from agentgym.manager import GenerationManager, summarize
from agentgym.metrics import MetricsLogger
from agentgym.models import load_model, load_tokenizer, resolve_model
from agentgym.runtime import build_engine, env_factory
from trainers.algos import (ADVANTAGES, POLICY_LOSSES, aggregate, broadcast_to_tokens,
                            kl_estimate, masked_mean)
from trainers.backends.base import batched_logprobs, sequence_logprobs
from trainers.backends.single import SingleBackend
from trainers.batch import Batch, collate

logger = logging.getLogger(__name__)


class Hooks:
    """Progress callbacks; the CLI draws bars and prints from them (library code logs)."""

    def phase(self, name: str, total: int) -> None: ...
    def advance(self, k: int = 1) -> None: ...
    def step_end(self, step: int, metrics: dict) -> None: ...


def resolve_run_dir(cfg: Config) -> Path:
    if cfg.run_dir:
        return Path(cfg.run_dir)
    model = Path(cfg.model.path or cfg.model.name).name
    return Path("runs") / f"{cfg.env}-{model}-{time.strftime('%Y%m%d-%H%M%S')}"


_STEP_DIR = re.compile(r"^step_(\d+)$")


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete ``checkpoints/step_N`` (``.tmp`` leftovers are ignored)."""
    found = []
    for p in (run_dir / "checkpoints").glob("step_*"):
        m = _STEP_DIR.match(p.name)
        if m and (p / "state.json").exists():
            found.append((int(m.group(1)), p))
    return max(found)[1] if found else None


def make_loss_fn(cfg: Config, temperature: float, num_tokens: float, num_seqs: int,
                 norm_len: int):
    """The micro-batch loss; totals are the mini-batch's so accumulation is exact.

    Metrics are returned as additive contributions (token-weighted shares for means), so
    summing them over micro-batches gives the mini-batch value whatever the split.
    """
    algo = cfg.algo
    policy_loss = POLICY_LOSSES.get(algo.policy_loss)
    agg = dict(mode=algo.loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
               norm_len=norm_len)

    def loss_fn(model, mb: Batch):
        dev = next(model.parameters()).device
        ids, attn, mask = (mb.input_ids.to(dev), mb.attention_mask.to(dev),
                           mb.loss_mask.to(dev))
        share = float(mask.sum()) / num_tokens
        logp, entropy = sequence_logprobs(model, ids, attn, temperature,
                                          with_entropy=algo.entropy_coef > 0)
        pg, stats = policy_loss(logp, mb.extra["old_logp"].to(dev), mb.extra["adv"].to(dev),
                                mask, clip_low=algo.clip_low, clip_high=algo.clip_high)
        loss = aggregate(pg, mask, **agg)
        metrics = {k: v * share for k, v in stats.items()}
        metrics["pg_loss"] = float(loss.detach())
        if algo.kl_coef > 0 and algo.kl_mode == "loss":
            kl = aggregate(kl_estimate(logp, mb.extra["ref_logp"].to(dev), algo.kl_estimator),
                           mask, **agg)
            loss = loss + algo.kl_coef * kl
            metrics["kl_loss"] = float(kl.detach())
        if entropy is not None:
            loss = loss - algo.entropy_coef * aggregate(entropy, mask, **agg)
        return loss, metrics
    return loss_fn


def update_policy(cfg: Config, backend: SingleBackend, batch: Batch, temperature: float,
                  step: int, hooks: Hooks) -> dict[str, float]:
    """``ppo_epochs`` x ``mini_batches`` optimizer steps over this step's batch."""
    gen = torch.Generator().manual_seed(cfg.trainer.seed * 1_000_003 + step)
    results: list[dict] = []
    n_mini = max(1, min(cfg.trainer.mini_batches, len(batch)))
    hooks.phase("update", cfg.trainer.ppo_epochs * n_mini)
    for _ in range(cfg.trainer.ppo_epochs):
        order = torch.randperm(len(batch), generator=gen).tolist()
        for k in range(n_mini):
            mini = batch.select(sorted(order[k::n_mini]))
            loss_fn = make_loss_fn(cfg, temperature, float(mini.loss_mask.sum().clamp(min=1)),
                                   len(mini), cfg.rollout.max_response_tokens)
            results.append(backend.train_step(backend.split(mini), loss_fn))
            hooks.advance()
    return {f"train/{k}": sum(r[k] for r in results) / len(results) for k in results[0]}


async def _rollouts(manager: GenerationManager, rows: list[dict], n: int, hooks: Hooks):
    hooks.phase("rollout", len(rows) * n)
    return await manager.run(rows, n=n, on_done=lambda _t: hooks.advance())


def evaluate(cfg: Config, engine, tokenizer, rows: list[dict], hooks: Hooks) -> dict:
    """Greedy single-sample accuracy on ``rows`` (the same env, budgets and tools)."""
    ecfg = copy.deepcopy(cfg)
    ecfg.rollout = dataclasses.replace(cfg.rollout, temperature=0.0, n=1)
    manager = GenerationManager(engine, tokenizer, env_factory(ecfg), ecfg.rollout,
                                seed=cfg.trainer.seed)
    try:
        trajs = asyncio.run(_rollouts(manager, rows, 1, hooks))
    finally:
        manager.close()
    s = summarize(trajs)
    return {"eval/em": s["em"], "eval/f1": s["f1"], "eval/format_valid": s["format_valid"],
            "eval/count": s["count"]}


def sync_weights(engine, backend: SingleBackend, version: int) -> None:
    """Trainer → engine: the full state dict, with generation paused around the swap."""
    async def swap():
        await engine.pause()
        try:
            engine.update_weights(backend.state_dict(), version)
        finally:
            engine.resume()
    asyncio.run(swap())


def setup(cfg: Config, run_dir: Path):
    """Load policy (trained), rollout engine (its own copy) and optional frozen reference;
    resume from the latest checkpoint if asked. Returns ``(tokenizer, backend, engine,
    ref_model, start_step)``."""
    t = cfg.trainer
    POLICY_LOSSES.get(cfg.algo.policy_loss)  # unknown names fail before any model loads
    ADVANTAGES.get(cfg.algo.advantage)
    path = resolve_model(cfg.model.path or cfg.model.name)
    tokenizer = load_tokenizer(path)
    k = t.ppo_epochs * t.mini_batches  # optimizer steps per training step
    backend = SingleBackend(load_model(path, dtype=cfg.model.dtype), lr=t.lr,
                            weight_decay=t.weight_decay, warmup_steps=t.warmup_steps * k,
                            total_steps=t.total_steps * k, schedule=t.lr_schedule,
                            max_grad_norm=t.max_grad_norm, micro_batch_tokens=t.micro_batch_tokens,
                            mixed_precision=t.mixed_precision)
    engine = build_engine(cfg, load_model(path, dtype=cfg.engine.dtype or cfg.model.dtype),
                          tokenizer)
    ref = load_model(path, dtype=cfg.model.dtype).eval() if cfg.algo.kl_coef > 0 else None
    if ref is not None:
        ref.requires_grad_(False)
    start = resume(t.resume, run_dir, backend)
    if start:
        sync_weights(engine, backend, start)
    return tokenizer, backend, engine, ref, start


def start_run(cfg: Config) -> Path:
    """Create the run directory, write the resolved config, seed ``random`` and torch."""
    run_dir = resolve_run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2) + "\n")
    logger.info("run dir %s; config %s", run_dir, json.dumps(to_dict(cfg)))
    random.seed(cfg.trainer.seed)
    torch.manual_seed(cfg.trainer.seed)
    return run_dir


def resume(policy: str, run_dir: Path, backend: SingleBackend) -> int:
    """Load the checkpoint ``trainer.resume`` names (auto: the latest in ``run_dir``;
    never; or a path) into ``backend``; return its step (0 when none)."""
    ckpt = latest_checkpoint(run_dir) if policy == "auto" else (
        None if policy == "never" else Path(policy))
    if ckpt is None:
        return 0
    backend.load(ckpt)
    step = json.loads((ckpt / "state.json").read_text())["step"]
    logger.info("resumed from %s at step %d", ckpt, step)
    return step


def train(cfg: Config, hooks: Hooks | None = None) -> Path:
    """Run GRPO as configured; return the run directory."""
    hooks = hooks or Hooks()
    t = cfg.trainer
    run_dir = start_run(cfg)
    rows = load_rows(cfg.env, cfg.data, cfg.limit)
    random.Random(t.seed).shuffle(rows)
    eval_rows = load_rows(cfg.env, t.eval_data, t.eval_limit) if t.eval_limit else []
    tokenizer, backend, engine, ref, start = setup(cfg, run_dir)
    metrics_log = MetricsLogger(run_dir, resume_step=start)
    manager = GenerationManager(engine, tokenizer, env_factory(cfg), cfg.rollout, seed=t.seed)
    temperature = cfg.rollout.temperature or 1.0
    try:
        if eval_rows and start == 0:
            metrics_log.log(0, evaluate(cfg, engine, tokenizer, eval_rows, hooks))
        for step in range(start, t.total_steps):
            t0 = time.perf_counter()
            # 1. rollouts
            lo = step * t.prompts_per_step
            step_rows = [rows[(lo + i) % len(rows)] for i in range(t.prompts_per_step)]
            manager.seed = t.seed * 1_000_003 + step
            trajs = asyncio.run(_rollouts(manager, step_rows, cfg.rollout.n, hooks))
            t1 = time.perf_counter()
            # 2. old / reference logprobs, drift between engine and trainer
            batch = collate(trajs, tokenizer.pad_token_id)
            old_logp, entropy = backend.logprobs(batch, temperature, with_entropy=True)
            mask = batch.loss_mask
            drift = (old_logp - batch.rollout_logp).abs() * mask
            m = {"rollout/drift_mean": float(drift.sum() / mask.sum().clamp(min=1)),
                 "rollout/drift_max": float(drift.max()),
                 "train/entropy": float(masked_mean(entropy, mask))}
            batch.extra["old_logp"] = old_logp
            rewards = batch.rewards.clone()
            if ref is not None:
                ref_logp, _ = batched_logprobs(ref, batch, temperature, t.micro_batch_tokens)
                batch.extra["ref_logp"] = ref_logp
                kl_tok = kl_estimate(old_logp, ref_logp, cfg.algo.kl_estimator) * mask
                m["train/kl"] = float(kl_tok.sum() / mask.sum().clamp(min=1))
                if cfg.algo.kl_mode == "reward":
                    rewards = rewards - cfg.algo.kl_coef * kl_tok.sum(-1)
            # 3. advantages
            adv = ADVANTAGES.get(cfg.algo.advantage)(rewards, batch.uids,
                                                     norm_by_std=cfg.algo.norm_adv_by_std)
            batch.extra["adv"] = broadcast_to_tokens(adv, mask)
            # 4. policy update
            m.update(update_policy(cfg, backend, batch, temperature, step, hooks))
            t2 = time.perf_counter()
            # 5. weight sync
            sync_weights(engine, backend, step + 1)
            t3 = time.perf_counter()
            # 6. metrics and checkpoints
            s = summarize(trajs)
            m.update({f"rollout/{k}": v for k, v in s.items()})
            m.update({"rollout/adv_abs": float(adv.abs().mean()),
                      "rollout/policy_version": float(trajs[0].policy_version),
                      "time/rollout_s": t1 - t0, "time/train_s": t2 - t1, "time/sync_s": t3 - t2,
                      "time/generate_s": s["generate_s"], "time/env_s": s["env_s"],
                      "time/step_s": time.perf_counter() - t0})
            done = step + 1
            if eval_rows and t.eval_every and done % t.eval_every == 0 and done < t.total_steps:
                m.update(evaluate(cfg, engine, tokenizer, eval_rows, hooks))
            metrics_log.log(done, m)
            if done % t.save_every == 0 or done == t.total_steps:
                save_checkpoint(run_dir, done, backend, tokenizer)
            hooks.step_end(done, m)
        if eval_rows and start < t.total_steps:
            final = evaluate(cfg, engine, tokenizer, eval_rows, hooks)
            metrics_log.log(t.total_steps, final)
            hooks.step_end(t.total_steps, final)
    finally:
        manager.close()
        engine.close()
        metrics_log.close()
    return run_dir


def save_checkpoint(run_dir: Path, step: int, backend: SingleBackend, tokenizer) -> Path:
    """``run_dir/checkpoints/step_N``: HF weights + tokenizer + optimizer + ``state.json``.

    Written to ``step_N.tmp`` and renamed into place, so a kill mid-save leaves nothing
    that ``trainer.resume=auto`` would pick up (it only reads ``step_<digits>`` folders).
    """
    final = run_dir / "checkpoints" / f"step_{step}"
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)  # a leftover of a killed save
    backend.save(tmp, tokenizer=tokenizer)
    (tmp / "state.json").write_text(json.dumps({"step": step}) + "\n")
    if final.exists():  # re-saving a step (after a resume): move the old one aside first
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    logger.info("saved checkpoint %s", final)
    return final
