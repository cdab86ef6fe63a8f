"""The backend protocol every trainer recipe talks to (single, FSDP2, DeepSpeed).

A backend owns the policy's trainable weights and optimizer:

* ``logprobs(batch, temperature)`` → ``(B, T)`` per-token logprobs (no grad), plus the
  per-token entropy when asked;
* ``train_step(batches, loss_fn)`` → one optimizer step over the micro-batches
  (gradients accumulated; ``loss_fn(model, micro_batch)`` returns ``(loss, metrics)``
  with the loss already scaled so the micro-batch losses sum to the mini-batch loss);
* ``state_dict()`` → the full, unsharded weights on CPU (for weight sync and HF saves);
* ``save(dir)`` / ``load(dir)`` → HF weights plus optimizer and scheduler state.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from trainers.batch import Batch

LossFn = Callable[[Any, Batch], "tuple[torch.Tensor, dict[str, float]]"]


class Backend(Protocol):
    model: Any

    def logprobs(self, batch: Batch, temperature: float,
                 with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def train_step(self, batches: list[Batch], loss_fn: LossFn) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def save(self, path: str) -> None: ...

    def load(self, path: str) -> None: ...


def sequence_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      temperature: float = 1.0, with_entropy: bool = False):
    """Per-token logprobs aligned with ``input_ids`` (``[:, 0]`` is 0), shape ``(B, T)``.

    Right-padded input; logits are divided by ``temperature`` (as the rollout engine's
    logprobs are), in fp32.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    logits = logits[:, :-1].float() / (temperature or 1.0)
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    logp[:, 1:] = logp_all.gather(-1, input_ids[:, 1:, None])[..., 0]
    entropy = None
    if with_entropy:  # differentiable when grad is enabled (entropy bonus)
        entropy = torch.zeros_like(logp)
        entropy[:, 1:] = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
