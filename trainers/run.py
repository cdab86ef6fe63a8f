"""What every training recipe (GRPO, PPO, SFT) shares: the run directory, atomic
checkpoints and resume, the training backend (single, FSDP2, DeepSpeed, Ray ranks) and the
frozen KL reference. Rollouts in this process, the progress hooks and the greedy eval are
in :mod:`trainers.local_rollout`."""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentgym._compat import deprecated_attributes
from agentgym.config import Config, to_dict

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")
# moved to trainers.local_rollout; the old path works for one release
__getattr__ = deprecated_attributes(__name__, "trainers.local_rollout", (
    "Hooks", "LocalRollout", "evaluate", "eval_metrics", "split_by_env", "rollouts"))


def resolve_run_dir(cfg: Config) -> Path:
    if cfg.run_dir:
        return Path(cfg.run_dir)
    model = Path(cfg.model.path or cfg.model.name).name
    from agentgym.config import env_names
    env = "+".join(env_names(cfg.env)).replace(":", "-").replace("/", "-")
    return Path("runs") / f"{env}-{model}-{time.strftime('%Y%m%d-%H%M%S')}"


def start_run(cfg: Config) -> Path:
    """Create the run directory, write the resolved config, seed ``random`` and torch."""
    run_dir = resolve_run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2) + "\n")
    logger.info("run dir %s; config %s", run_dir, json.dumps(to_dict(cfg)))
    random.seed(cfg.trainer.seed)
    torch.manual_seed(cfg.trainer.seed)
    return run_dir


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete ``checkpoints/step_N`` (``.tmp`` leftovers are ignored)."""
    found = []
    for p in (run_dir / "checkpoints").glob("step_*"):
        m = _STEP_DIR.match(p.name)
        if m and (p / "state.json").exists():
            found.append((int(m.group(1)), p))
    return max(found)[1] if found else None


def resume(policy: str, run_dir: Path, backend, critic=None) -> dict[str, Any]:
    """Load the checkpoint ``trainer.resume`` names (auto: the latest in ``run_dir``;
    never; or a path) into ``backend`` (and ``critic``'s backend from its ``critic/``
    folder); return its ``state.json`` (``{"step": 0}`` when there is none)."""
    ckpt = latest_checkpoint(run_dir) if policy == "auto" else (
        None if policy == "never" else Path(policy))
    if ckpt is None:
        return {"step": 0}
    backend.load(ckpt)
    if critic is not None:
        if not (ckpt / "critic").is_dir():
            raise ValueError(f"checkpoint {ckpt} has no critic/ folder, so a critic-based "
                             f"algorithm cannot resume from it; start a new run_dir or set "
                             f"trainer.resume=never")
        critic.load(ckpt / "critic")
    state = json.loads((ckpt / "state.json").read_text())
    if (ckpt / "rng.pt").exists():
        set_rng_state(torch.load(ckpt / "rng.pt", weights_only=False))
    logger.info("resumed from %s at step %d", ckpt, state["step"])
    return state


def rng_state() -> dict[str, Any]:
    """This process's random generators: Python's, NumPy's and torch's."""
    import numpy as np
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(run_dir: Path, step: int, backend, tokenizer,
                    state: dict[str, Any] | None = None, critic=None) -> Path:
    """``run_dir/checkpoints/step_N``: HF weights + tokenizer + the backend's optimizer
    and scheduler state (sharded for fsdp/deepspeed) + the driver's RNG states
    (``rng.pt``) + ``state.json`` (step, data position, policy version), and the
    critic's in ``critic/`` when there is one.

    Written to ``step_N.tmp`` and renamed into place, so a kill mid-save leaves nothing
    that ``trainer.resume=auto`` would pick up (it only reads ``step_<digits>`` folders).
    """
    final = run_dir / "checkpoints" / f"step_{step}"
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)  # a leftover of a killed save
    backend.save(tmp, tokenizer=tokenizer)
    source = Path(getattr(tokenizer, "name_or_path", "") or ".")
    if (source / "preprocessor_config.json").is_file():  # a VL model's image processor
        shutil.copy2(source / "preprocessor_config.json", tmp / "preprocessor_config.json")
    if critic is not None:
        critic.save(tmp / "critic")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({**(state or {}), "step": step}) + "\n")
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


def make_backend(cfg: Config, spec, lr: float, cluster=None, total_steps: int | None = None,
                 warmup_steps: int | None = None):
    """The training backend (``trainer.backend``: single, or fsdp/deepspeed over
    ``trainer.nprocs`` rank processes, or rank actors of a Ray ``cluster``) for the model
    ``spec`` (a :class:`~trainers.backends.base.ModelSpec`) describes. The LR schedule
    counts optimizer steps: by default ``trainer.total_steps`` / ``trainer.warmup_steps``
    times the optimizer steps per training step (``ppo_epochs x mini_batches``)."""
    from agentgym.core.device import mixed_precision, resolve_device
    from trainers.backends.single import SingleBackend
    t = cfg.trainer
    k = t.ppo_epochs * t.mini_batches
    precision = mixed_precision(t.mixed_precision, resolve_device(t.device))
    total = total_steps if total_steps is not None else t.total_steps * k
    warmup = warmup_steps if warmup_steps is not None else t.warmup_steps * k
    if t.backend == "single":
        return SingleBackend(spec.load(), lr=lr, weight_decay=t.weight_decay,
                             warmup_steps=warmup, total_steps=total,
                             schedule=t.lr_schedule, max_grad_norm=t.max_grad_norm,
                             micro_batch_tokens=t.micro_batch_tokens,
                             mixed_precision=precision, logprob_chunk=t.logprob_chunk)
    from trainers.backends.distributed import DistributedBackend
    from trainers.backends.ranks import OptimSpec
    optim = OptimSpec(lr=lr, weight_decay=t.weight_decay, warmup_steps=warmup,
                      total_steps=total, schedule=t.lr_schedule,
                      max_grad_norm=t.max_grad_norm, mixed_precision=precision,
                      zero_stage=t.zero_stage, offload=t.offload)
    ranks = None
    if cluster is not None:
        from trainers.ray_cluster import RayRanks
        ranks = RayRanks(cluster, t.nprocs, t.backend, spec, optim,
                         "critic" if spec.kind == "value" else "policy")
    return DistributedBackend(t.backend, spec, optim, t.nprocs, t.micro_batch_tokens, ranks,
                              logprob_chunk=t.logprob_chunk)


def policy_spec(cfg: Config, path):
    """The policy as the backends load it: ``model.dtype``, and LoRA adapters when
    ``model.lora.rank`` > 0 (their init seeded with ``trainer.seed``)."""
    from trainers.backends.base import ModelSpec
    from trainers.lora import LoraSpec
    lo = cfg.model.lora
    return ModelSpec(str(path), cfg.model.dtype, lora=LoraSpec(
        lo.rank, lo.alpha, lo.dropout, lo.target_modules, cfg.trainer.seed) if lo.rank else None,
        device=cfg.trainer.device, gradient_checkpointing=cfg.model.gradient_checkpointing)


@dataclass
class Reference:
    """The frozen KL reference: a model in this process (``model``), or the one the
    sharded backend's ranks hold (``backend``), sharded as the policy is."""

    model: Any = None
    backend: Any = None
    micro_batch_tokens: int = 4096
    chunk: int = 0

    def logprobs(self, batch, temperature: float) -> torch.Tensor:
        if self.backend is not None:
            return self.backend.reference_logprobs(batch, temperature)
        from trainers.backends.base import batched_logprobs
        return batched_logprobs(self.model, batch, temperature, self.micro_batch_tokens,
                                chunk=self.chunk)[0]


def reference(cfg: Config, path, backend) -> Reference:
    """Where the reference lives: with a sharded backend (fsdp, deepspeed), in its ranks
    beside the policy; with the single backend, on the policy's device; in host memory
    with ``algo.ref_offload`` (either backend)."""
    from agentgym.core.device import HOST
    from agentgym.models.zoo import load_model
    t = cfg.trainer
    if t.backend != "single" and not cfg.algo.ref_offload:
        return Reference(backend=backend)
    model = load_model(path, dtype=cfg.model.dtype,
                       device=HOST if cfg.algo.ref_offload else t.device).eval()
    model.requires_grad_(False)
    return Reference(model=model, micro_batch_tokens=t.micro_batch_tokens,
                     chunk=t.logprob_chunk)
