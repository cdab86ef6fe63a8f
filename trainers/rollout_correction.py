"""Rollout correction: per-token weights on the policy loss for samples drawn by another
policy than the one the update starts from (``algo.off_policy``).

The behaviour policy is the rollout engine's (``rollout_logp``: a stale policy version in
asynchronous training, or an engine whose numerics differ from the trainer's); the proximal
policy is the recomputed old logprobs, which the PPO ratio is clipped against. With
``log rho_t = log pi_prox(t) - log pi_behav(t)`` on each sampled token, a sequence's ratio
is the product ``rho_seq = exp(sum_t log rho_t)`` (``seq_*``) or the geometric mean
``rho_geo = exp(mean_t log rho_t)`` (``geo_*``: length-normalised, so a long sequence is not
dropped for many tiny differences). The modes, as verl's rollout correction and TRL's
``vllm_importance_sampling_mode`` define them:

- ``recompute``: 1 (the loss trusts the recomputed old logprobs alone, as synchronous
  PPO/GRPO do);
- ``decoupled``: ``rho_t`` (AReaL's decoupled PPO objective), capped at ``is_cap`` when > 0;
- truncated IS, ``min(rho, is_cap)``: ``tis`` per token (``rho_t``), ``seq_tis`` with
  ``rho_seq`` on every token of the sequence, ``geo_tis`` with ``rho_geo``;
- masked IS, ``rho`` where ``is_low <= rho <= is_high`` and 0 outside (the token, or the whole
  sequence, is dropped from the loss): ``mis`` per token, ``seq_mis`` on ``rho_seq``,
  ``geo_mis`` on ``rho_geo``.

Weights are 0 off the mask and carry no gradient. Metrics, as shares of the sampled tokens
(so micro-batches add up): ``is_weight_mean`` / ``is_weight_max`` (the weights applied),
``is_ratio_mean`` / ``is_ratio_max`` / ``is_log_ratio_abs`` (the token ratios before any
truncation or mask), ``is_seq_log_ratio_abs`` (``|log rho_seq|``, or ``|log rho_geo|`` for
``geo_*``), ``is_capped_frac`` (tokens whose weight the cap cut) and ``is_masked_frac``
(tokens a mask dropped, alone or with their sequence).
"""

from __future__ import annotations

import torch

from agentgym.core.choices import OFF_POLICY_MODES


def behaviour_weights(prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor,
                      mode: str = "recompute", cap: float = 2.0, low: float = 0.5,
                      high: float = 2.0) -> tuple[torch.Tensor, dict]:
    """``(B, T)`` weights for the policy loss under ``mode`` (module docstring) and their
    metrics. ``cap`` is ``algo.is_cap`` (truncation), ``low`` / ``high`` are ``algo.is_low`` /
    ``algo.is_high`` (the masks' bounds)."""
    if mode not in OFF_POLICY_MODES:
        raise ValueError(f"off-policy correction {mode!r}; valid: {', '.join(OFF_POLICY_MODES)}")
    if mode == "recompute":
        return mask.to(prox_logp.dtype), {}
    m = mask.bool()
    zero = torch.zeros_like(prox_logp)
    log_rho = torch.where(m, (prox_logp - behav_logp).detach(), zero)
    rho = torch.exp(log_rho.clamp(max=30.0))
    if mode in ("decoupled", "tis", "mis"):
        log_r = log_rho
    else:  # one ratio per sequence, on each of its sampled tokens
        total = log_rho.sum(-1, keepdim=True)
        if mode.startswith("geo"):
            total = total / m.sum(-1, keepdim=True).clamp(min=1)
        log_r = torch.where(m, total.expand_as(log_rho), zero)
    r = torch.exp(log_r.clamp(min=-30.0, max=30.0))
    capped = masked = torch.zeros_like(m)
    if mode.endswith("mis"):
        masked = m & ((r < low) | (r > high))
        w = torch.where(masked, zero, r)
    elif mode == "decoupled" and cap <= 0:
        w = r
    else:
        capped = m & (r > cap)
        w = r.clamp(max=cap)
    w = torch.where(m, w, zero)
    n = m.sum().clamp(min=1)
    share = lambda x: (torch.where(m, x.float(), 0.0).sum() / n).detach()  # noqa: E731
    # metrics stay tensors: the backend turns a step's into floats with one host sync
    return w, {"is_weight_mean": share(w),
               "is_weight_max": torch.where(m, w, zero).max().detach() if w.numel() else w.new_zeros(()),
               "is_ratio_mean": share(rho),
               "is_ratio_max": torch.where(m, rho, zero).max().detach() if w.numel() else w.new_zeros(()),
               "is_log_ratio_abs": share(log_rho.abs()),
               "is_seq_log_ratio_abs": share(log_r.abs()),
               "is_capped_frac": share(capped), "is_masked_frac": share(masked)}
