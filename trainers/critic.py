"""PPO's critic: a value model, its values aligned with tokens, its clipped-value update.

The value model is the policy's architecture with a scalar head: transformers'
``AutoModelForTokenClassification`` with one label, as verl builds its critic. Its
backbone starts from the policy's checkpoint (``critic.model`` empty) or from another
model (``critic.model=tiny|smollm2-135m|/path``); the head (``score``) starts fresh.
Dropout is off, so the values the update trains are those the advantages were computed
from. Checkpoints are HF folders (``checkpoints/step_N/critic``).

Alignment, as for logprobs: ``values[b, t]`` is V of the prefix ``< t`` (read from the
hidden state at ``t - 1``), the state in which token ``t`` was sampled; ``values[:, 0]``
is 0. ``last_values[b]`` is V of the whole sequence, the bootstrap for a truncated
episode.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from agentgym.config import Config
from agentgym.models import resolve_model
from trainers.algos import aggregate, explained_variance, masked_mean, value_loss
from trainers.backends.base import batched_apply
from trainers.batch import Batch
from trainers.grpo import make_backend, minibatch_updates

logger = logging.getLogger(__name__)


def load_value_model(path: str | Path, dtype: str = "float32"):
    """A token-classification model with one output (the value) from a local HF folder;
    a causal-LM checkpoint loads its backbone, the head is initialized fresh."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(path, num_labels=1, local_files_only=True)
    config.classifier_dropout = 0.0
    return AutoModelForTokenClassification.from_pretrained(
        path, config=config, dtype=getattr(torch, dtype), local_files_only=True)


def _values_fn(model, mb: Batch, device):
    return token_values(model, mb.input_ids.to(device), mb.attention_mask.to(device))


def token_values(model, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """``(B, T)`` values aligned with tokens (``[:, 0]`` is 0) and ``(B,)`` values of each
    whole (right-padded) sequence, in fp32."""
    out = model(input_ids=input_ids, attention_mask=attention_mask).logits[..., 0].float()
    values = torch.zeros_like(out)
    values[:, 1:] = out[:, :-1]
    last = attention_mask.sum(-1).clamp(min=1) - 1
    return values, out[torch.arange(out.shape[0], device=out.device), last]


class Critic:
    """The value model and its own optimizer (``critic.lr``; the trainer's schedule,
    micro-batching and mixed precision).

    Args:
        cfg: the run's config (``critic.*``, ``trainer.*``, ``algo.loss_agg_mode``).
        policy_path: the policy's HF folder, the critic's start when ``critic.model`` is
            empty.
    """

    def __init__(self, cfg: Config, policy_path: str | Path) -> None:
        self.cfg = cfg
        path = resolve_model(cfg.critic.model) if cfg.critic.model else Path(policy_path)
        logger.info("critic from %s", path)
        self.backend = make_backend(cfg, load_value_model(path, cfg.model.dtype), cfg.critic.lr)

    def values(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values (B, T), last_values (B,))`` of the current critic, no grad."""
        with self.backend.autocast():
            v, last = batched_apply(self.backend.model, batch,
                                    self.cfg.trainer.micro_batch_tokens, _values_fn)
        return v, last

    def make_loss_fn(self, num_tokens: float, num_seqs: int, norm_len: int):
        """The clipped value loss of a micro-batch, normalized by mini-batch totals."""
        clip = self.cfg.critic.value_clip
        agg = dict(mode=self.cfg.algo.loss_agg_mode, num_tokens=num_tokens,
                   num_seqs=num_seqs, norm_len=norm_len)

        def loss_fn(model, mb: Batch):
            dev = next(model.parameters()).device
            mask = mb.loss_mask.to(dev)
            v, _ = token_values(model, mb.input_ids.to(dev), mb.attention_mask.to(dev))
            per_tok, stats = value_loss(v, mb.extra["values"].to(dev),
                                        mb.extra["returns"].to(dev), mask, clip or None)
            loss = aggregate(per_tok, mask, **agg)
            share = float(mask.sum()) / num_tokens
            return loss, {"vf_loss": float(loss.detach()),
                          **{k: x * share for k, x in stats.items()}}
        return loss_fn

    def update(self, batch: Batch, step: int, hooks) -> dict[str, float]:
        """``ppo_epochs`` x ``mini_batches`` steps on ``batch.extra['returns']`` with
        value clipping around ``batch.extra['values']``; ``critic/…`` metrics."""
        mask = batch.loss_mask
        m = {"critic/values_mean": float(masked_mean(batch.extra["values"], mask)),
             "critic/returns_mean": float(masked_mean(batch.extra["returns"], mask)),
             "critic/explained_var": explained_variance(batch.extra["values"],
                                                        batch.extra["returns"], mask)}

        def make_loss(mini: Batch):
            return self.make_loss_fn(float(mini.loss_mask.sum().clamp(min=1)), len(mini),
                                     self.cfg.rollout.max_response_tokens)
        m.update(minibatch_updates(self.cfg, self.backend, batch, make_loss, step, hooks,
                                   "critic", "critic/"))
        return m
