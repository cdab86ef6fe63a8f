"""Pure functions of policy-gradient RL for LLMs: advantages, policy losses, KL, aggregation.

Shapes: ``B`` trajectories, ``T`` tokens (the full sequence, prompt included). Per-token
tensors are aligned with ``input_ids``: ``logp[b, t]`` is the log-probability of token
``t`` given tokens ``< t`` (``logp[:, 0]`` is 0). ``mask`` is the trajectory's
``loss_mask`` (1 only on sampled tokens), so prompt, observation and padding positions
never contribute to any loss, KL, entropy or length statistic.

Advantage estimators and policy losses are registered by name (``algo.advantage=grpo``,
``algo.policy_loss=ppo_clip``) so new variants slot in without touching the recipe.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch

from agentgym.registry import Registry

ADVANTAGES: Registry = Registry("advantage estimator")
POLICY_LOSSES: Registry = Registry("policy loss")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3", "abs")


# --- advantages ------------------------------------------------------------------------
def group_indices(group_ids: Sequence) -> list[list[int]]:
    """Row indices of each group, groups in order of first appearance."""
    groups: dict = defaultdict(list)
    for i, g in enumerate(group_ids):
        groups[g].append(i)
    return list(groups.values())


@ADVANTAGES.register("grpo")
def grpo_advantages(rewards: torch.Tensor, group_ids: Sequence, norm_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages: ``(r - mean_group) / (std_group + eps)``.

    Args:
        rewards: ``(B,)`` scalar reward per trajectory.
        group_ids: length ``B``; trajectories of the same prompt share an id.
        norm_by_std: divide by the group's std (GRPO); False gives Dr. GRPO's
            mean-centering only.

    Returns:
        ``(B,)`` advantages; a group of one, or with identical rewards, gets 0.
    """
    rewards = rewards.float()
    adv = torch.zeros_like(rewards)
    for idx in group_indices(group_ids):
        r = rewards[idx]
        if len(idx) == 1:
            continue
        centered = r - r.mean()
        adv[idx] = centered / (r.std(unbiased=True) + eps) if norm_by_std else centered
    return adv


@ADVANTAGES.register("rloo")
def rloo_advantages(rewards: torch.Tensor, group_ids: Sequence, **_) -> torch.Tensor:
    """REINFORCE leave-one-out: ``r_i - mean_{j != i, same group} r_j``.

    Args:
        rewards: ``(B,)`` scalar reward per trajectory.
        group_ids: length ``B``; trajectories of the same prompt share an id.

    Returns:
        ``(B,)`` advantages; a group of one gets 0 (it has no baseline).
        Equivalently ``n / (n - 1) * (r_i - mean_group)`` for a group of ``n``.
    """
    rewards = rewards.float()
    adv = torch.zeros_like(rewards)
    for idx in group_indices(group_ids):
        n = len(idx)
        if n == 1:
            continue
        r = rewards[idx]
        adv[idx] = r - (r.sum() - r) / (n - 1)
    return adv


def broadcast_to_tokens(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(B,)`` → ``(B, T)``: the scalar advantage on every sampled token, 0 elsewhere."""
    return adv[:, None] * mask


# --- aggregation -----------------------------------------------------------------------
def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str,
              num_tokens: float | None = None, num_seqs: float | None = None,
              norm_len: int | None = None) -> torch.Tensor:
    """Reduce a ``(B, T)`` per-token loss to a scalar under ``mode``.

    Modes: ``token-mean`` (every sampled token weighs the same across the whole
    mini-batch), ``seq-mean-token-sum``, ``seq-mean-token-mean`` and
    ``seq-mean-token-sum-norm`` (token sum divided by a constant ``norm_len``, Dr. GRPO).

    ``num_tokens`` / ``num_seqs`` are the *mini-batch* totals. Passing them makes the sum
    of micro-batch losses equal the loss of the whole mini-batch, so gradient
    accumulation over any split gives the same gradient. Defaults: this tensor's totals.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
    mask = mask.to(values.dtype)
    if mode == "token-mean":
        denom = num_tokens if num_tokens is not None else mask.sum().clamp(min=1)
        return (values * mask).sum() / denom
    seqs = num_seqs if num_seqs is not None else values.shape[0]
    per_seq_sum = (values * mask).sum(-1)
    if mode == "seq-mean-token-sum":
        return per_seq_sum.sum() / seqs
    if mode == "seq-mean-token-mean":
        return (per_seq_sum / mask.sum(-1).clamp(min=1)).sum() / seqs
    if norm_len is None:
        raise ValueError("seq-mean-token-sum-norm needs norm_len (e.g. max response length)")
    return (per_seq_sum / norm_len).sum() / seqs


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


# --- policy losses ---------------------------------------------------------------------
@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                  mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                  dual_clip: float | None = None) -> tuple[torch.Tensor, dict]:
    """PPO's clipped surrogate, per token.

    Args:
        logp, old_logp, adv, mask: ``(B, T)``.
        clip_low / clip_high: ratio bounds ``[1 - clip_low, 1 + clip_high]``
            (a larger ``clip_high`` is DAPO's clip-higher).
        dual_clip: if set (> 1), bounds the loss of negative advantages at
            ``-dual_clip * adv`` (dual-clip PPO).

    Returns:
        ``(B, T)`` loss (to aggregate) and metrics: ``clipfrac``, ``approx_kl``.
    """
    log_ratio = (logp - old_logp) * mask
    ratio = torch.exp(log_ratio.clamp(-20, 20))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        if dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * dual_clip), loss)
    with torch.no_grad():
        metrics = {"clipfrac": masked_mean((clipped > unclipped).float(), mask).item(),
                   "approx_kl": masked_mean(0.5 * log_ratio ** 2, mask).item()}
    return loss, metrics


@POLICY_LOSSES.register("gspo")
def gspo_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
              mask: torch.Tensor, clip_low: float = 3e-4, clip_high: float = 4e-4,
              **_) -> tuple[torch.Tensor, dict]:
    """GSPO (Zheng et al., 2025): the clipped surrogate on a *sequence-level* ratio.

    ``s_i = exp(mean_{t in mask_i} (logp - old_logp))`` (length-normalized), used on every
    sampled token of sequence ``i`` in the GSPO-token form ``sg[s_i] * pi_t / sg[pi_t]``:
    the value is ``s_i`` and the gradient flows through each token's own logprob.

    Args:
        logp, old_logp, adv, mask: ``(B, T)``; ``adv`` is constant over a sequence's
            sampled tokens for outcome rewards.
        clip_low / clip_high: bounds on ``s_i`` (the paper uses 3e-4 / 4e-4: sequence
            ratios stay much closer to 1 than token ratios). Use
            ``algo.loss_agg_mode=seq-mean-token-mean``, as the paper does.

    Returns:
        ``(B, T)`` loss (to aggregate) and metrics: ``clipfrac`` (share of sampled tokens
        whose sequence was clipped), ``approx_kl``.
    """
    mask = mask.to(logp.dtype)
    diff = (logp - old_logp) * mask
    seq_log_ratio = diff.sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)
    log_ratio = logp - logp.detach() + seq_log_ratio.detach()[:, None]
    ratio = torch.exp(log_ratio.clamp(max=10.0))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped) * mask
    with torch.no_grad():
        metrics = {"clipfrac": masked_mean((clipped > unclipped).float(), mask).item(),
                   "approx_kl": masked_mean(0.5 * diff ** 2, mask).item()}
    return loss, metrics


# --- KL and entropy --------------------------------------------------------------------
def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token logprobs.

    ``k1``: ``logp - ref``; ``k2``: ``0.5 (logp - ref)^2``; ``k3`` (low-variance,
    unbiased, >= 0): ``exp(ref - logp) - (ref - logp) - 1``; ``abs``: ``|logp - ref|``.
    """
    diff = logp - ref_logp
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff ** 2
    if kind == "k3":
        return (torch.exp((-diff).clamp(max=20)) + diff - 1).clamp(min=0, max=10)
    if kind == "abs":
        return diff.abs()
    raise ValueError(f"kl estimator {kind!r}; valid: {', '.join(KL_ESTIMATORS)}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """``(..., V)`` logits → ``(...)`` entropy of the softmax, in nats."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
