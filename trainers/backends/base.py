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
    logprobs are), in fp32. The entropy (when asked) is differentiable if grad is on.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    logits = logits[:, :-1].float() / (temperature or 1.0)
    lse = torch.logsumexp(logits, dim=-1)  # avoids a second (B, T, V) log_softmax copy
    logp = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    logp[:, 1:] = logits.gather(-1, input_ids[:, 1:, None])[..., 0] - lse
    entropy = None
    if with_entropy:
        probs = torch.softmax(logits, dim=-1)
        entropy = torch.zeros_like(logp)
        entropy[:, 1:] = lse - (probs * logits).sum(-1)
    return logp, entropy


@torch.no_grad()
def batched_logprobs(model, batch: Batch, temperature: float, micro_batch_tokens: int,
                     with_entropy: bool = False):
    """:func:`sequence_logprobs` over a whole batch in token-budgeted micro-batches."""
    from trainers.batch import micro_batches

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    width = batch.input_ids.shape[1]
    lps, ents = [], []
    lengths = batch.attention_mask.sum(-1).tolist()
    for idx in micro_batches(lengths, micro_batch_tokens):
        mb = batch.select(idx)
        lp, ent = sequence_logprobs(model, mb.input_ids.to(device),
                                    mb.attention_mask.to(device), temperature, with_entropy)
        pad = width - lp.shape[1]
        lps.append(torch.nn.functional.pad(lp.cpu(), (0, pad)))
        if with_entropy:
            ents.append(torch.nn.functional.pad(ent.cpu(), (0, pad)))
    model.train(was_training)
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)
