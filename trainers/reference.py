"""Frozen models that only score: the KL reference (``algo.kl_coef > 0``) where it lives
(in a sharded backend's ranks, on the policy's device, or in host memory with
``algo.ref_offload``), and the frozen-model loader a distillation teacher shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from agentgym.config import Config
from agentgym.core.device import HOST
from agentgym.models.plan import AUTO_HOST_TOKENS, micro_batch_tokens
from agentgym.models.zoo import load_model
from agentgym.trainers.backends.base import batched_logprobs


@dataclass
class Reference:
    """The frozen KL reference: a model in this process (``model``), or the one the
    sharded backend's ranks hold (``backend``), sharded as the policy is."""

    model: Any = None
    backend: Any = None
    micro_batch_tokens: int = 4096
    chunk: int = 0
    packing: bool = True  # trainer.packing

    def logprobs(self, batch, temperature: float) -> torch.Tensor:
        if self.backend is not None:
            return self.backend.reference_logprobs(batch, temperature)
        return batched_logprobs(self.model, batch, temperature, self.micro_batch_tokens,
                                chunk=self.chunk, packing=self.packing)[0]


def reference(cfg: Config, path, backend) -> Reference:
    """Where the reference lives: with a sharded backend (fsdp, deepspeed), in its ranks
    beside the policy; with the single backend, on the policy's device; in host memory
    with ``algo.ref_offload`` (either backend)."""
    t = cfg.trainer
    if t.backend != "single" and not cfg.algo.ref_offload:
        return Reference(backend=backend)
    model, tokens = frozen_model(cfg, path, cfg.algo.ref_offload)
    return Reference(model=model, micro_batch_tokens=tokens,
                     chunk=t.logprob_chunk, packing=t.packing)


def frozen_model(cfg: Config, path, offload: bool):
    """``(model, micro-batch tokens)``: a frozen model that only scores (the KL reference,
    a distillation teacher) at ``model.dtype``, on the policy's device or, with ``offload``,
    in host memory, and the token budget of its passes there."""
    t = cfg.trainer
    model = load_model(path, dtype=cfg.model.dtype, device=HOST if offload else t.device).eval()
    model.requires_grad_(False)
    tokens = (t.micro_batch_tokens or AUTO_HOST_TOKENS) if offload else micro_batch_tokens(cfg)
    return model, tokens
