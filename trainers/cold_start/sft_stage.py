"""The cold start's SFT: :func:`agentgym.trainers.sft.sft` on the demonstrations in the
stage's folder (its own metrics, curve and checkpoints, so a killed cold start resumes),
and the settings that enter the cache key."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

from agentgym.config import Config, env_names, to_dict
from agentgym.core.device import mixed_precision, run_device
from agentgym.models.plan import micro_batch_tokens
from agentgym.trainers.checkpoints import latest_checkpoint
from agentgym.trainers.hooks import Hooks
from agentgym.trainers.sft import sft


def run_sft(cfg: Config, base: Path, demos_file: Path, stage_dir: Path,
         hooks: Hooks) -> tuple[Path, dict]:
    """SFT of ``base`` on the demonstrations in ``stage_dir``; the final checkpoint and a
    summary of the loss curve."""
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


def sft_settings(cfg: Config) -> dict:
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
