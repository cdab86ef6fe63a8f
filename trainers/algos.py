"""Pure functions of policy-gradient RL for LLMs: advantages, policy and value losses, KL,
aggregation, and DAPO's group filter and overlong shaping.

Shapes: ``B`` trajectories, ``T`` tokens (the full sequence, prompt included). Per-token
tensors are aligned with ``input_ids``: ``logp[b, t]`` is the log-probability of token
``t`` given tokens ``< t`` (``logp[:, 0]`` is 0), and ``values[b, t]`` is the critic's
value of that same state (the prefix ``< t``). ``mask`` is the trajectory's ``loss_mask``
(1 only on sampled tokens), so prompt, observation and padding positions never
contribute to any advantage, loss, KL, entropy or length statistic.

Time steps are the sampled tokens. An observation the env appended between two turns is
part of the transition from the last token of one turn to the first token of the next:
GAE and discounted returns skip mask-0 positions (they neither reset nor discount
there), so rewards, values or logprobs stored at those positions never reach an
advantage. ``rewards[b, t]`` is the reward received after sampling token ``t``: the
recipe puts each turn's env reward on the last token sampled in that turn, and a
per-token KL penalty on every sampled token when ``algo.kl_mode=reward``.

Registries (names are the config values; an unknown name fails with the valid ones):

The names and the estimators' flags are :mod:`agentgym.core.choices`' (the config validates
against them without loading torch); this module registers one function under each.

* ``ADVANTAGES``: ``grpo`` (``norm_by_std=False`` is Dr. GRPO), ``rloo``,
  ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``, ``gae``, ``none`` (zeros:
  on-policy distillation alone); and the turn-level
  ones of :mod:`agentgym.trainers.turn_credit`: ``mt_grpo``, ``gigpo``, ``gae_turn``. Each is
  ``fn(rewards (B, T), mask (B, T), *, <inputs it declares>) -> (advantages, returns)``,
  both ``(B, T)`` and 0 where ``mask`` is 0. Call them through
  :func:`compute_advantages`, which passes each estimator the inputs it declares.
  Register one with :func:`estimator`; whether it reads a critic's values
  (``needs_critic``) or its prompt's group (``needs_groups``) is its vocabulary entry's
  flag (:class:`agentgym.core.choices.Estimator`), which ``AlgoConfig.needs_critic`` reads.
* ``POLICY_LOSSES``: ``ppo_clip`` (asymmetric clip-higher when ``clip_high >
  clip_low``), ``dual_clip``, ``gspo``. Each is ``fn(logp, old_logp, adv, mask, *,
  <params>) -> (loss (B, T), metrics)``; reduce the loss with :func:`aggregate`. Register
  one with :func:`policy_loss`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch

from agentgym.core import choices
from agentgym.core.choices import KL_ESTIMATORS, LOSS_AGG_MODES
from agentgym.core.registry import Registry
from agentgym.trainers.group_stats import (_group_stats, group_indices, masked_mean,  # noqa: F401
                                  masked_whiten)
from agentgym.trainers import turn_credit  # the turn-level estimators, registered below
from agentgym.trainers.rollout_correction import OFF_POLICY_MODES, behaviour_weights  # noqa: F401

ADVANTAGES: Registry = Registry("advantage estimator")
POLICY_LOSSES: Registry = Registry("policy loss")


def estimator(name: str, **flags: bool) -> Callable[[Callable], Callable]:
    """Register an advantage estimator under ``name`` (a decorator). A built-in's flags are
    its :data:`agentgym.core.choices.ADVANTAGES` entry's; one registered outside the project
    states its own (``needs_critic=True``, ``needs_groups=True``), and its name and flags
    join that vocabulary, so a config built afterwards accepts it."""
    if flags and name in choices.ADVANTAGES:
        raise ValueError(f"advantage estimator {name!r} is built in: its flags are "
                         f"agentgym.core.choices.ADVANTAGES[{name!r}]; register yours under "
                         f"another name")

    def deco(fn: Callable) -> Callable:
        ADVANTAGES.register(name, fn)
        choices.ADVANTAGES.setdefault(name, choices.Estimator(**flags))
        return fn
    return deco


def policy_loss(name: str) -> Callable[[Callable], Callable]:
    """Register a policy loss under ``name`` (a decorator); a name outside
    :data:`agentgym.core.choices.POLICY_LOSSES` joins it, so a config built afterwards
    accepts it."""
    def deco(fn: Callable) -> Callable:
        POLICY_LOSSES.register(name, fn)
        if name not in choices.POLICY_LOSSES:
            choices.POLICY_LOSSES = (*choices.POLICY_LOSSES, name)
        return fn
    return deco


def _call_with(kind: str, name: str, fn: Callable, args: tuple, inputs: dict[str, Any]):
    """Call ``fn(*args, **inputs)`` passing only the keyword inputs ``fn`` declares; a
    declared input without a default that is missing (or None) is an error naming it."""
    params = inspect.signature(fn).parameters
    kw = {k: v for k, v in inputs.items() if k in params}
    missing = [p for p, spec in params.items() if spec.kind is spec.KEYWORD_ONLY
               and spec.default is spec.empty and kw.get(p) is None]
    if missing:
        raise ValueError(f"{kind} {name!r} needs {', '.join(missing)} "
                         f"(got {', '.join(sorted(k for k, v in inputs.items() if v is not None))})")
    return fn(*args, **kw)


def compute_advantages(name: str, rewards: torch.Tensor, mask: torch.Tensor,
                       **inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the registered estimator ``name``; ``inputs`` may hold more than it needs
    (``group_ids``, ``values``, ``last_values``, ``truncated``, ``gamma``, ``lam``,
    ``norm_by_std``): each estimator takes the ones it declares."""
    return _call_with("advantage estimator", name, ADVANTAGES.get(name), (rewards, mask), inputs)


def compute_policy_loss(name: str, logp: torch.Tensor, old_logp: torch.Tensor,
                        adv: torch.Tensor, mask: torch.Tensor, **params: Any):
    """Run the registered policy loss ``name`` with the params it declares."""
    return _call_with("policy loss", name, POLICY_LOSSES.get(name),
                      (logp, old_logp, adv, mask), params)


def needs_groups(advantage: str) -> bool:
    """Whether the estimator's baseline is the other samples of the same prompt (so it
    needs ``rollout.n >= 2``: a group of one gets advantage 0)."""
    return choices.estimator(advantage).needs_groups


# --- helpers ---------------------------------------------------------------------------
def outcome_scores(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` token rewards → ``(B,)`` episode return (sum over sampled tokens)."""
    return torch.where(mask > 0, rewards.float(), 0.0).sum(-1)


def discounted_scan(rewards: torch.Tensor, mask: torch.Tensor, values: torch.Tensor,
                    next_value: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """GAE's backward recursion over the sampled tokens of each row, vectorized over rows.

    With ``k`` indexing the sampled positions ``t_0 < t_1 < …`` of a row::

        delta_k = r[t_k] + gamma * V[t_{k+1}] - V[t_k]      (V after the last: next_value)
        A_k     = delta_k + gamma * lam * A_{k+1}

    Mask-0 positions are skipped: their reward and value are never read, and the
    recursion carries over them unchanged. ``values = 0, lam = 1`` gives the discounted
    return-to-go.

    Args:
        rewards, mask, values: ``(B, T)``.
        next_value: ``(B,)`` value of the state after each row's last sampled token
            (0 for a terminated episode).

    Returns:
        ``(B, T)`` advantages, 0 where ``mask`` is 0.
    """
    B, T = rewards.shape
    m = mask > 0
    out = torch.zeros(B, T, dtype=torch.float32)
    nxt = next_value.float().clone()
    running = torch.zeros(B, dtype=torch.float32)
    for t in range(T - 1, -1, -1):
        delta = rewards[:, t].float() + gamma * nxt - values[:, t].float()
        gae = delta + gamma * lam * running
        running = torch.where(m[:, t], gae, running)
        nxt = torch.where(m[:, t], values[:, t].float(), nxt)
        out[:, t] = torch.where(m[:, t], gae, 0.0)
    return out


# --- advantage estimators --------------------------------------------------------------
@estimator("grpo")
def grpo_advantages(rewards: torch.Tensor, mask: torch.Tensor, *, group_ids: Sequence,
                    norm_by_std: bool = True, eps: float = 1e-6,
                    episode_ids: Sequence | None = None):
    """Group-relative advantages (GRPO): ``(R - mean_group) / (std_group + eps)``.

    Args:
        rewards, mask: ``(B, T)``; ``R`` is each row's summed reward over sampled tokens.
        group_ids: length ``B``; trajectories of the same prompt share an id.
        norm_by_std: divide by the group's (unbiased) std. False is Dr. GRPO
            (mean-centering only; pair it with ``seq-mean-token-sum-norm``).
        episode_ids: length ``B``; rows of one episode count once in the group's stats
            (:func:`_group_stats`) and each gets the episode's advantage.

    Returns:
        ``(B, T)`` advantages (the row's scalar on each sampled token) and returns (``R``
        on each sampled token). A group of one, or one whose rewards are all equal, gets 0.
    """
    scores = outcome_scores(rewards, mask)
    mean, std, count, flat = _group_stats(scores, group_ids, episode_ids)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (std + eps)
    adv = torch.where((count > 1) & ~flat, adv, 0.0)
    return broadcast_to_tokens(adv, mask), broadcast_to_tokens(scores, mask)


@estimator("none")
def no_advantages(rewards: torch.Tensor, mask: torch.Tensor):
    """No advantage from the env (``algo=opd``: on-policy distillation's per-token term,
    :mod:`agentgym.trainers.distill`, is then the whole of it). Returns zeros and the
    episode return ``R`` on each sampled token (what the other estimators return)."""
    scores = outcome_scores(rewards, mask)
    return torch.zeros_like(mask, dtype=torch.float32), broadcast_to_tokens(scores, mask)


@estimator("rloo")
def rloo_advantages(rewards: torch.Tensor, mask: torch.Tensor, *, group_ids: Sequence,
                    episode_ids: Sequence | None = None):
    """REINFORCE leave-one-out: ``R_i - mean_{j != i, same group} R_j``.

    Args:
        rewards, mask: ``(B, T)``; ``R`` is each row's summed reward.
        group_ids: length ``B``; trajectories of the same prompt share an id.
        episode_ids: as for GRPO: an episode's rows count once.

    Returns:
        ``(B, T)`` advantages and returns (``R``), 0 off the mask. A group of one gets 0
        (it has no baseline). Equals ``n / (n - 1) * (R_i - mean_group)``.
    """
    scores = outcome_scores(rewards, mask)
    mean, _, count, flat = _group_stats(scores, group_ids, episode_ids)
    adv = (scores - mean) * count / (count - 1).clamp(min=1)
    adv = torch.where((count > 1) & ~flat, adv, 0.0)
    return broadcast_to_tokens(adv, mask), broadcast_to_tokens(scores, mask)


@estimator("reinforce_plus_plus")
def reinforce_pp_advantages(rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0):
    """REINFORCE++ (Hu, 2025): token-level discounted return-to-go, whitened over every
    sampled token of the batch (no critic, no group baseline).

    Args:
        rewards, mask: ``(B, T)``; with ``algo.kl_mode=reward`` the rewards already
            carry the per-token KL penalty, as the method prescribes.
        gamma: discount per sampled token.

    Returns:
        ``(B, T)`` whitened advantages and the raw returns ``G_t``, 0 off the mask.
    """
    returns = discounted_scan(rewards, mask, torch.zeros_like(rewards, dtype=torch.float32),
                              torch.zeros(rewards.shape[0]), gamma, 1.0)
    return masked_whiten(returns, mask), returns


@estimator("reinforce_plus_plus_baseline")
def reinforce_pp_baseline_advantages(rewards: torch.Tensor, mask: torch.Tensor, *,
                                     group_ids: Sequence,
                                     episode_ids: Sequence | None = None):
    """REINFORCE++-baseline: the group mean as baseline (``R - mean_group``), on every
    sampled token, then whitened over all sampled tokens of the batch.

    Args:
        rewards, mask: ``(B, T)``; ``R`` is each row's summed reward.
        group_ids: length ``B``.

    Returns:
        ``(B, T)`` advantages and returns (``R``), 0 off the mask.
    """
    scores = outcome_scores(rewards, mask)
    mean, _, _, _ = _group_stats(scores, group_ids, episode_ids)
    adv = masked_whiten(broadcast_to_tokens(scores - mean, mask), mask)
    return adv, broadcast_to_tokens(scores, mask)


@estimator("gae")
def gae_advantages(rewards: torch.Tensor, mask: torch.Tensor, *, values: torch.Tensor,
                   last_values: torch.Tensor | None = None,
                   truncated: torch.Tensor | None = None, gamma: float = 1.0,
                   lam: float = 1.0, norm_by_std: bool = True):
    """Generalized advantage estimation over sampled tokens (PPO with a critic).

    Bootstrapping at the end of an episode depends on how it ended: a ``terminated``
    episode (the env answered) has no future, so the value after its last token is 0; a
    ``truncated`` one (turn or token budget) was cut off, so the return is bootstrapped
    with ``last_values``, the critic's value of the state after its last token.

    Args:
        rewards, mask: ``(B, T)``.
        values: ``(B, T)`` critic values aligned with tokens (``values[:, t]`` = V of the
            prefix ``< t``); read only where ``mask`` is 1.
        last_values: ``(B,)`` V of the full sequence; needed when any row is truncated.
        truncated: ``(B,)`` bool; None means every row terminated.
        gamma, lam: discount and GAE lambda, per sampled token.
        norm_by_std: whiten the advantages over the batch's sampled tokens.

    Returns:
        ``(B, T)`` advantages and returns (``A + V``, the critic's targets), 0 off the mask.
    """
    B = rewards.shape[0]
    boot = torch.zeros(B)
    if truncated is not None and bool(truncated.any()):
        if last_values is None:
            raise ValueError("gae: truncated rows need last_values to bootstrap from")
        boot = torch.where(truncated.bool(), last_values.float(), 0.0)
    adv = discounted_scan(rewards, mask, values, boot, gamma, lam)
    returns = torch.where(mask > 0, adv + values.float(), 0.0)
    return (masked_whiten(adv, mask) if norm_by_std else adv), returns


estimator("mt_grpo")(turn_credit.mt_grpo_advantages)
estimator("gigpo")(turn_credit.gigpo_advantages)
estimator("gae_turn")(turn_credit.gae_turn_advantages)


def broadcast_to_tokens(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(B,)`` → ``(B, T)``: the scalar on every sampled token, 0 elsewhere."""
    return torch.where(mask > 0, adv.float()[:, None], 0.0)


# --- DAPO: dynamic sampling filter and overlong reward shaping -------------------------
def groups_with_signal(rewards: Sequence[float], group_ids: Sequence) -> list[bool]:
    """Per row: True when its group's rewards are not all equal (DAPO's dynamic sampling
    keeps only those groups: an all-equal group has zero advantage everywhere)."""
    _, _, _, flat = _group_stats(torch.tensor([float(r) for r in rewards]), group_ids)
    return (~flat).tolist()


def signal_share(rewards: Sequence[float], group_ids: Sequence) -> float:
    """The fraction of groups whose rewards are not all equal (the groups a
    group-relative advantage learns from)."""
    with_signal = {g for g, s in zip(group_ids, groups_with_signal(rewards, group_ids)) if s}
    return len(with_signal) / max(len(set(group_ids)), 1)


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int,
                     factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment, ``(B,)`` → ``(B,)`` values in ``[-factor, 0]``.

    0 up to ``max_len - buffer`` tokens, then falling linearly to ``-factor`` at
    ``max_len`` (and beyond).
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"overlong buffer must be in (0, max_len={max_len}], got {buffer}")
    start = max_len - buffer
    return factor * ((start - lengths.float()) / buffer).clamp(min=-1.0, max=0.0)


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
    masked = torch.where(mask > 0, values, 0.0)
    if mode == "token-mean":
        denom = num_tokens if num_tokens is not None else mask.sum().clamp(min=1)
        return masked.sum() / denom
    seqs = num_seqs if num_seqs is not None else values.shape[0]
    per_seq_sum = masked.sum(-1)
    if mode == "seq-mean-token-sum":
        return per_seq_sum.sum() / seqs
    if mode == "seq-mean-token-mean":
        return (per_seq_sum / mask.sum(-1).clamp(min=1)).sum() / seqs
    if norm_len is None:
        raise ValueError("seq-mean-token-sum-norm needs norm_len (e.g. max response length)")
    return (per_seq_sum / norm_len).sum() / seqs


# --- policy losses ---------------------------------------------------------------------
def _clip_metrics(clipped, unclipped, log_ratio, mask) -> dict[str, float]:
    with torch.no_grad():
        return {"clipfrac": masked_mean((clipped > unclipped).float(), mask).detach(),
                "approx_kl": masked_mean(0.5 * log_ratio ** 2, mask).item()}


def _clipped_surrogate(logp, old_logp, adv, mask, clip_low, clip_high, dual_clip):
    log_ratio = torch.where(mask > 0, logp - old_logp, 0.0)
    ratio = torch.exp(log_ratio.clamp(-20, 20))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = _clip_metrics(clipped, unclipped, log_ratio, mask)
    if dual_clip is not None:
        if dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        bound = -adv * dual_clip
        hit = (adv < 0) & (loss > bound)
        loss = torch.where(hit, bound, loss)
        metrics["dual_clipfrac"] = masked_mean(hit.float(), mask).detach()
    return loss, metrics


@policy_loss("ppo_clip")
def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                  mask: torch.Tensor, *, clip_low: float = 0.2, clip_high: float = 0.2
                  ) -> tuple[torch.Tensor, dict]:
    """PPO's clipped surrogate, per token: ``max(-A r, -A clip(r, 1 - lo, 1 + hi))``.

    Args:
        logp, old_logp, adv, mask: ``(B, T)``; ``r = exp(logp - old_logp)``.
        clip_low / clip_high: ratio bounds ``[1 - clip_low, 1 + clip_high]``; a larger
            ``clip_high`` is DAPO's asymmetric clip-higher (``algo=dapo``: 0.2 / 0.28).

    Returns:
        ``(B, T)`` loss (to aggregate) and metrics: ``clipfrac``, ``approx_kl``.
    """
    return _clipped_surrogate(logp, old_logp, adv, mask, clip_low, clip_high, None)


@policy_loss("dual_clip")
def dual_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                   mask: torch.Tensor, *, clip_low: float = 0.2, clip_high: float = 0.2,
                   dual_clip: float = 3.0) -> tuple[torch.Tensor, dict]:
    """Dual-clip PPO (Ye et al., 2020): :func:`ppo_clip_loss`, with the loss of a negative
    advantage also bounded at ``-dual_clip * A`` so a huge ratio on a bad action cannot
    blow up the update (``algo.dual_clip``, default 3 as in verl).

    Returns:
        ``(B, T)`` loss and metrics ``clipfrac``, ``approx_kl``, ``dual_clipfrac``.
    """
    return _clipped_surrogate(logp, old_logp, adv, mask, clip_low, clip_high, dual_clip)


@policy_loss("gspo")
def gspo_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
              mask: torch.Tensor, *, clip_low: float = 3e-4, clip_high: float = 4e-4
              ) -> tuple[torch.Tensor, dict]:
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
    m = mask > 0
    diff = torch.where(m, logp - old_logp, 0.0)
    seq_log_ratio = diff.sum(-1) / m.sum(-1).clamp(min=1)  # (B,)
    log_ratio = logp - logp.detach() + seq_log_ratio.detach()[:, None]
    ratio = torch.exp(log_ratio.clamp(max=10.0))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.where(m, torch.maximum(unclipped, clipped), 0.0)
    return loss, _clip_metrics(clipped, unclipped, diff, mask)


# --- value loss ------------------------------------------------------------------------
def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, clip: float | None = None) -> tuple[torch.Tensor, dict]:
    """The critic's regression loss, per token: ``0.5 (V - R)^2``; with ``clip``, PPO's
    value clipping ``0.5 max((V - R)^2, (old + clip(V - old, -c, c) - R)^2)``.

    Args:
        values: ``(B, T)`` current values (with grad); ``old_values``: the values before
            this update; ``returns``: GAE's targets; ``mask``: sampled tokens.
        clip: the value clip range ``c`` (None or 0: no clipping).

    Returns:
        ``(B, T)`` loss (to aggregate) and metrics ``vf_clipfrac``.
    """
    err = (values - returns) ** 2
    if clip:
        v_clipped = old_values + (values - old_values).clamp(-clip, clip)
        err_clipped = (v_clipped - returns) ** 2
        loss = 0.5 * torch.maximum(err, err_clipped)
        frac = masked_mean((err_clipped > err).float(), mask).detach()
    else:
        loss, frac = 0.5 * err, 0.0
    return torch.where(mask > 0, loss, 0.0), {"vf_clipfrac": frac}


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over sampled tokens (1 = perfect critic, <= 0 = none);
    NaN when the returns have (up to float rounding) no variance to explain."""
    m = mask > 0
    r, v = returns[m].float(), values[m].float()
    if r.numel() < 2 or float(r.var()) <= 1e-8:
        return float("nan")
    return float(1 - (r - v).var() / r.var())


# --- KL --------------------------------------------------------------------------------
def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token logprobs.

    ``k1``: ``logp - ref``; ``k2``: ``0.5 (logp - ref)^2``; ``k3`` (low-variance,
    unbiased, >= 0): ``exp(ref - logp) - (ref - logp) - 1``; ``abs``: ``|logp - ref|``.
    All inputs ``(B, T)``; the result is 0 where ``mask`` is 0. As a reward penalty
    (``algo.kl_mode=reward``) only ``k1`` gives an unbiased gradient.
    """
    diff = torch.where(mask > 0, logp - ref_logp, 0.0)
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff ** 2
    if kind == "k3":
        return (torch.exp((-diff).clamp(max=20)) + diff - 1).clamp(min=0, max=10)
    if kind == "abs":
        return diff.abs()
    raise ValueError(f"kl estimator {kind!r}; valid: {', '.join(KL_ESTIMATORS)}")

