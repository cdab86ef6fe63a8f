"""PPO's critic: a value model, its values aligned with tokens, its clipped-value update.

The value model is the policy's architecture with a scalar head: transformers'
``AutoModelForTokenClassification`` with one label, as verl builds its critic
(``agentgym.models.zoo.load_value_model``). Its
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
from dataclasses import dataclass
from pathlib import Path

import torch

from agentgym.config import Config
from agentgym.models.zoo import resolve_model
from agentgym.trainers.algos import aggregate, explained_variance, masked_mean, value_loss
from agentgym.trainers.backends.base import ModelSpec
from agentgym.trainers.batch import Batch
from agentgym.trainers.phases import minibatch_updates
from agentgym.trainers.backends.factory import make_backend
from agentgym.trainers import packing as pk

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ValuesFn:
    """:func:`token_values` of a micro-batch, as a backend ``apply`` function (picklable)."""

    packing: bool = True  # trainer.packing

    def __call__(self, model, mb: Batch, device):
        return token_values(model, mb, device, self.packing, whole=True)


def token_values(model, mb: Batch, device, packing: bool = True, whole: bool = False):
    """``(B, T)`` values aligned with tokens (``[:, 0]`` is 0) and ``(B,)`` values of each
    whole (right-padded) sequence, in fp32.

    With ``packing`` (:mod:`agentgym.trainers.packing`) the rows run as one packed row
    (a group's shared prefix once, no padding) and the values are read at the sampled
    tokens only (what GAE and the value loss read), plus each row's last state with
    ``whole``; without ``whole`` the rows are packed only up to their last sampled token
    and the sequence values are 0 (the value loss does not read them)."""
    from agentgym.trainers import attention  # loads transformers: heavy
    ids, attn = mb.input_ids.to(device), mb.attention_mask.to(device)
    if not packing or not attention.enable(model):
        out = model(input_ids=ids, attention_mask=attn).logits[..., 0].float()
        values = torch.zeros_like(out)
        values[:, 1:] = out[:, :-1]
        last = attn.sum(-1).clamp(min=1) - 1
        return values, out[torch.arange(out.shape[0], device=out.device), last]
    lengths = mb.attention_mask.sum(-1).tolist()
    pack = pk.build_pack(mb.input_ids, lengths, mb.loss_mask, groups=mb.uids, keep_whole=whole)
    with attention.packed_forward():
        out = model(**pack.model_kwargs(device)).logits[0, :, 0].float()
    values = pk.scatter(out[pack.hidden_at.to(device)], pack)
    last = torch.zeros(len(lengths), dtype=torch.float32, device=out.device)
    if whole:
        at = pack.last_at.to(device)
        last = torch.where(at >= 0, out[at.clamp(min=0)], last)
    return values, last


@dataclass(frozen=True)
class ValueLoss:
    """The clipped value loss of a micro-batch, normalized by mini-batch totals
    (picklable, like :class:`agentgym.trainers.phases.PolicyLoss`)."""

    clip: float
    mode: str
    num_tokens: float
    num_seqs: int
    norm_len: int
    packing: bool = True  # trainer.packing

    def __call__(self, model, mb: Batch):
        dev = next(model.parameters()).device
        mask = mb.loss_mask.to(dev)
        v, _ = token_values(model, mb, dev, self.packing)
        per_tok, stats = value_loss(v, mb.values.to(dev), mb.returns.to(dev),
                                    mask, self.clip or None)
        loss = aggregate(per_tok, mask, self.mode, num_tokens=self.num_tokens,
                         num_seqs=self.num_seqs, norm_len=self.norm_len)
        share = float(mask.sum()) / self.num_tokens
        return loss, {"vf_loss": float(loss.detach()), **{k: x * share for k, x in stats.items()}}


class Critic:
    """The value model and its own optimizer (``critic.lr``; the trainer's backend,
    schedule, micro-batching and mixed precision).

    Args:
        cfg: the run's config (``critic.*``, ``trainer.*``, ``algo.loss_agg_mode``).
        policy_path: the policy's HF folder, the critic's start when ``critic.model`` is
            empty.
        cluster: the run's Ray placement (its ranks become actors), or None.
    """

    def __init__(self, cfg: Config, policy_path: str | Path, cluster=None) -> None:
        self.cfg = cfg
        path = resolve_model(cfg.critic.model) if cfg.critic.model else Path(policy_path)
        logger.info("critic from %s", path)
        spec = ModelSpec(str(path), cfg.model.dtype, "value", device=cfg.trainer.device,
                         gradient_checkpointing=cfg.model.gradient_checkpointing)
        self.backend = make_backend(cfg, spec, cfg.critic.lr, cluster)

    def values(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values (B, T), last_values (B,))`` of the current critic, no grad."""
        v, last = self.backend.apply(ValuesFn(self.cfg.trainer.packing), batch)
        return v, last

    def update(self, batch: Batch, step: int, hooks) -> dict[str, float]:
        """``ppo_epochs`` x ``mini_batches`` steps on ``batch.returns`` with value clipping
        around ``batch.values``; ``critic/…`` metrics."""
        mask = batch.loss_mask
        m = {"critic/values_mean": float(masked_mean(batch.values, mask)),
             "critic/returns_mean": float(masked_mean(batch.returns, mask)),
             "critic/explained_var": explained_variance(batch.values,
                                                        batch.returns, mask)}
        c = self.cfg

        def make_loss(mini: Batch):
            return ValueLoss(c.critic.value_clip, c.algo.loss_agg_mode,
                             float(mini.loss_mask.sum().clamp(min=1)), len(mini),
                             c.rollout.max_response_tokens, c.trainer.packing)
        m.update(minibatch_updates(c, self.backend, batch, make_loss, step, hooks, "critic",
                                   "critic/"))
        return m

    def close(self) -> None:
        self.backend.close()
