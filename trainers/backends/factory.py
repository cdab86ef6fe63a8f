"""The training backend a run's config names (``trainer.backend``): single, or fsdp /
deepspeed over ``trainer.nprocs`` rank processes or a Ray cluster's rank actors, and the
:class:`~agentgym.trainers.backends.base.ModelSpec` of the policy they load."""

from __future__ import annotations

from agentgym.config import Config
from agentgym.core.device import mixed_precision, run_device
from agentgym.models.plan import micro_batch_tokens
from agentgym.trainers.backends.base import Backend, ModelSpec
from agentgym.trainers.backends.distributed import DistributedBackend
from agentgym.trainers.backends.ranks import OptimSpec
from agentgym.trainers.backends.single import SingleBackend
from agentgym.trainers.lora import LoraSpec


def make_backend(cfg: Config, spec, lr: float, cluster=None, total_steps: int | None = None,
                 warmup_steps: int | None = None) -> Backend:
    """The training backend (``trainer.backend``: single, or fsdp/deepspeed over
    ``trainer.nprocs`` rank processes, or rank actors of a Ray ``cluster``) for the model
    ``spec`` (a :class:`~agentgym.trainers.backends.base.ModelSpec`) describes. The LR schedule
    counts optimizer steps: by default ``trainer.total_steps`` / ``trainer.warmup_steps``
    times the optimizer steps per training step (``ppo_epochs x mini_batches``)."""
    t = cfg.trainer
    tokens = micro_batch_tokens(cfg)
    k = t.ppo_epochs * t.mini_batches
    precision = mixed_precision(t.mixed_precision, run_device(cfg))
    total = total_steps if total_steps is not None else t.total_steps * k
    warmup = warmup_steps if warmup_steps is not None else t.warmup_steps * k
    if t.backend == "single":
        return SingleBackend(spec.load(), lr=lr, weight_decay=t.weight_decay,
                             warmup_steps=warmup, total_steps=total,
                             schedule=t.lr_schedule, max_grad_norm=t.max_grad_norm,
                             micro_batch_tokens=tokens,
                             mixed_precision=precision, logprob_chunk=t.logprob_chunk,
                             packing=t.packing)
    optim = OptimSpec(lr=lr, weight_decay=t.weight_decay, warmup_steps=warmup,
                      total_steps=total, schedule=t.lr_schedule,
                      max_grad_norm=t.max_grad_norm, mixed_precision=precision,
                      zero_stage=t.zero_stage, offload=t.offload)
    ranks = None
    if cluster is not None:
        from agentgym.trainers.ray_cluster import RayRanks  # optional: the ray extra
        ranks = RayRanks(cluster, t.nprocs, t.backend, spec, optim,
                         "critic" if spec.kind == "value" else "policy")
    return DistributedBackend(t.backend, spec, optim, t.nprocs, tokens, ranks,
                              logprob_chunk=t.logprob_chunk, packing=t.packing)


def policy_spec(cfg: Config, path):
    """The policy as the backends load it: ``model.dtype``, and LoRA adapters when
    ``model.lora.rank`` > 0 (their init seeded with ``trainer.seed``)."""
    lo = cfg.model.lora
    return ModelSpec(str(path), cfg.model.dtype, lora=LoraSpec(
        lo.rank, lo.alpha, lo.dropout, lo.target_modules, cfg.trainer.seed) if lo.rank else None,
        device=cfg.trainer.device, gradient_checkpointing=cfg.model.gradient_checkpointing)
