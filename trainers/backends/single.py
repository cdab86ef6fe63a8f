"""Single-process backend: plain torch, one device. The laptop default."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

from agentgym.core.choices import LR_SCHEDULES
from agentgym.trainers import lora
from agentgym.trainers.backends.base import (LogprobFn, LossFn, add_metrics, as_floats,
                                             batched_apply, make_adamw, scale_this_step)
from agentgym.trainers.balancing import split
from agentgym.trainers.batch import Batch

logger = logging.getLogger(__name__)


def lr_lambda(warmup_steps: int, total_steps: int, schedule: str):
    """Linear warmup, then ``constant`` or ``cosine`` decay (to 10% of the peak)."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr schedule {schedule!r}; valid: {', '.join(LR_SCHEDULES)}")

    def f(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


class SingleBackend:
    """Trains ``model`` in this process.

    Args:
        model: the policy (a transformers causal LM), trained in place.
        lr, weight_decay, betas: AdamW settings.
        warmup_steps, total_steps, schedule: the learning-rate schedule.
        max_grad_norm: gradient clipping (0 disables).
        micro_batch_tokens: token budget of one forward/backward (packed tokens with
            ``packing``, else padded ones).
        mixed_precision: ``""`` (fp32) or ``bf16`` autocast.
        logprob_chunk: positions projected to the vocabulary at once in :meth:`logprobs`
            (0: all; :func:`~agentgym.trainers.backends.base.sequence_logprobs`).
        packing: ``trainer.packing`` (:mod:`agentgym.trainers.packing`).
    """

    def __init__(self, model, lr: float = 1e-6, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), warmup_steps: int = 0,
                 total_steps: int = 1, schedule: str = "constant", max_grad_norm: float = 1.0,
                 micro_batch_tokens: int = 8192, mixed_precision: str = "",
                 logprob_chunk: int = 0, packing: bool = True) -> None:
        if mixed_precision not in ("", "bf16"):
            raise ValueError(f"mixed_precision={mixed_precision!r}; valid: '' (off), bf16")
        self.model = model
        self.mixed_precision = mixed_precision
        self.device = next(model.parameters()).device
        self.max_grad_norm = max_grad_norm
        self.micro_batch_tokens = micro_batch_tokens
        self.logprob_chunk = logprob_chunk
        self.packing = packing
        self.optimizer = make_adamw([p for p in model.parameters() if p.requires_grad],
                                    lr=lr, betas=betas, weight_decay=weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(warmup_steps, total_steps, schedule))

    def split(self, batch: Batch) -> list[Batch]:
        return [batch.select(ix) for ix in split(batch, self.micro_batch_tokens, self.packing)]

    def autocast(self):
        """bf16 compute over fp32 master weights when ``mixed_precision='bf16'``."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16,
                              enabled=self.mixed_precision == "bf16")

    def apply(self, fn, batch: Batch) -> list[torch.Tensor]:
        """``fn(model, micro_batch, device)`` over the batch's micro-batches, no grad."""
        with self.autocast():
            return batched_apply(self.model, batch, self.micro_batch_tokens, fn, self.packing)

    def logprobs(self, batch: Batch, temperature: float, with_entropy: bool = False):
        out = self.apply(LogprobFn(temperature, with_entropy, self.logprob_chunk, self.packing),
                         batch)
        return out[0], (out[1] if with_entropy else None)

    def close(self) -> None:
        """Nothing to release (distributed backends stop their rank processes)."""

    def train_step(self, batches: list[Batch], loss_fn: LossFn,
                   lr_scale: float = 1.0) -> dict[str, float]:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict = {}
        for mb in batches:  # metrics are additive contributions to the mini-batch value
            with self.autocast():
                loss, metrics = loss_fn(self.model, mb)
            loss.backward()
            add_metrics(totals, {**metrics, "loss": loss.detach()})
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(
            params, self.max_grad_norm if self.max_grad_norm > 0 else float("inf"))
        lr = self.scheduler.get_last_lr()[0] * lr_scale
        scale_this_step(self.optimizer, self.scheduler, lr_scale)
        self.optimizer.step()
        self.scheduler.step()
        return as_floats({**totals, "grad_norm": grad_norm, "lr": lr})  # one host sync

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights on CPU; with LoRA, the base architecture's, adapters merged."""
        sd = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        if lora.is_lora(self.model):
            sd = lora.merge_state_dict(sd, lora.scaling_of(self.model))
        return sd

    def save(self, path: str | os.PathLike, tokenizer=None) -> None:
        """HF weights (loadable with ``from_pretrained``; merged with LoRA, whose adapters
        also go to ``adapter/``) plus ``trainer_state.pt``."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if lora.is_lora(self.model):
            self.model.get_base_model().save_pretrained(path, state_dict=self.state_dict(),
                                                        safe_serialization=True)
            lora.save_adapter(self.model, path / "adapter")
        else:
            self.model.save_pretrained(path, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        torch.save({"optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict()}, path / "trainer_state.pt")

    def load(self, path: str | os.PathLike) -> None:
        from safetensors.torch import load_file
        path = Path(path)
        if lora.is_lora(self.model):
            lora.load_adapter(self.model, path / "adapter")
            self._load_trainer_state(path)
            return
        files = sorted(path.glob("*.safetensors"))
        state = {}
        for f in files:
            state.update(_read(f, load_file))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        real_missing = [k for k in missing if not k.endswith("lm_head.weight")]
        if real_missing or unexpected:
            raise ValueError(f"checkpoint {path} does not match the model: missing "
                             f"{real_missing[:5]}, unexpected {unexpected[:5]}")
        if getattr(self.model.config, "tie_word_embeddings", False):
            self.model.tie_weights()
        self._load_trainer_state(path)

    def _load_trainer_state(self, path: Path) -> None:
        st = _read(path / "trainer_state.pt", lambda f: torch.load(f, weights_only=False))
        self.optimizer.load_state_dict(st["optimizer"])
        self.scheduler.load_state_dict(st["scheduler"])


def _read(path: Path, read):
    """``read(path)``; bad bytes raise an ``OSError`` that names the file (safetensors'
    and torch's own errors do not), which ``trainer.resume=auto`` reports as it falls back
    to an older checkpoint (:func:`agentgym.trainers.checkpoints.resume`)."""
    try:
        return read(path)
    except Exception as e:  # noqa: BLE001 - bad bytes raise each format's own errors
        raise OSError(f"cannot read {path}: {type(e).__name__}: {e}") from e
