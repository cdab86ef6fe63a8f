"""What each step does, phase by phase (the order: :mod:`agentgym.trainers.loop`): the
settings checked once (:func:`check_algo`); 2. old and reference logprobs and token rewards
(:func:`score`); 3. advantages (:func:`advantages`); 4. the policy's optimizer steps
(:func:`update_policy`, the loss: :class:`PolicyLoss`)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from agentgym.config import Config
from agentgym.core.types import Trajectory
from agentgym.trainers.algos import (ADVANTAGES, POLICY_LOSSES, aggregate, behaviour_weights,
                                     compute_advantages, compute_policy_loss, kl_estimate,
                                     masked_mean, needs_groups, overlong_penalty)
from agentgym.trainers.backends.base import Backend, token_logprobs
from agentgym.trainers.batch import Batch, collate
from agentgym.trainers.hooks import Hooks
from agentgym.trainers.distill import distill_metrics, distill_term, teacher_logprobs, teacher_names

logger = logging.getLogger(__name__)


def check_algo(cfg: Config) -> None:
    """Fail before any model loads: unknown estimator/loss names, settings that clash."""
    a, n = cfg.algo, cfg.rollout.n
    POLICY_LOSSES.get(a.policy_loss)
    ADVANTAGES.get(a.advantage)
    has_teacher = any(teacher_names(cfg))
    if a.distill_coef > 0 and not has_teacher:
        raise ValueError(f"algo.distill_coef={a.distill_coef} distils from a teacher, but "
                         f"trainer.teacher is empty; give a model folder, a run folder or an "
                         f"endpoint (trainer.teacher=runs/teacher), or set algo.distill_coef=0")
    if has_teacher and a.distill_coef == 0:
        raise ValueError(f"trainer.teacher={cfg.trainer.teacher!r} is given but "
                         f"algo.distill_coef=0 would leave it unused; set algo.distill_coef > 0 "
                         f"(beside the env's reward) or algo=opd (distillation alone)")
    if a.advantage == "none" and a.distill_coef == 0:
        raise ValueError("algo.advantage=none gives every token advantage 0; it is for "
                         "on-policy distillation alone (algo=opd with trainer.teacher=…)")
    if cfg.trainer.mode == "async":
        bad = [(a.dynamic_sampling, "algo.dynamic_sampling"),
               (cfg.engine.name != "hf", f"engine={cfg.engine.name}")]
        named = [what for cond, what in bad if cond]
        if named:
            raise ValueError(f"trainer.mode=async runs with the hf engine (here or in Ray "
                             f"rollout workers) and fixed-size steps so far; not with "
                             f"{', '.join(named)}")
    if cfg.rollout.partial and cfg.trainer.mode != "async":
        logger.warning("rollout.partial=true matters only with trainer.mode=async (weights "
                       "change while episodes are in flight); this run is synchronous")
    if a.overlong_buffer > cfg.rollout.max_response_tokens:
        raise ValueError(f"algo.overlong_buffer={a.overlong_buffer} exceeds "
                         f"rollout.max_response_tokens={cfg.rollout.max_response_tokens}")
    if n < 2 and (needs_groups(a.advantage) or a.dynamic_sampling):
        what = ("algo.dynamic_sampling" if a.dynamic_sampling
                else f"algo.advantage={a.advantage!r}")
        raise ValueError(f"{what} compares the samples of a prompt, so it needs rollout.n >= 2 "
                         f"(got {n}); with one sample per prompt use algo=ppo or "
                         f"algo=reinforce_plus_plus")
    if a.kl_coef > 0 and a.kl_mode == "reward" and a.kl_estimator != "k1":
        logger.warning("algo.kl_mode=reward with algo.kl_estimator=%s: a penalty in the reward "
                       "passes only its score-function gradient, which is unbiased for k1 "
                       "alone; consider algo.kl_estimator=k1", a.kl_estimator)


# --- 2. old / reference logprobs, 3. token rewards -------------------------------------
def reuses_update_logprobs(cfg: Config) -> bool:
    """True when the update's own forward pass gives the old logprobs: one optimizer step
    per batch (``ppo_epochs`` = ``mini_batches`` = 1) means every micro-batch sees the
    weights that would have recomputed them, so the separate no-grad pass is skipped
    (its drift and entropy metrics come from the update instead). A KL penalty in the
    reward needs them before the update, so it keeps the pass."""
    t, a = cfg.trainer, cfg.algo
    return (t.ppo_epochs == 1 and t.mini_batches == 1
            and not (a.kl_coef > 0 and a.kl_mode == "reward"))


def drift_metrics(logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict:
    """|trainer - engine| logprob of the sampled tokens: mean and max."""
    drift = torch.where(mask > 0, (logp - rollout_logp).abs(), 0.0)
    return {"drift_mean": float(drift.sum() / mask.sum().clamp(min=1)),
            "drift_max": float(drift.max()) if drift.numel() else 0.0}


def score(cfg: Config, backend: Backend, ref, trajs: list[Trajectory], tokenizer,
          temperature: float, teachers: dict | None = None) -> tuple[Batch, torch.Tensor, dict]:
    """Collate ``trajs``; add old logprobs (unless the update provides them, see
    :func:`reuses_update_logprobs`), reference logprobs and the teachers' (on-policy
    distillation, :mod:`agentgym.trainers.distill`; ``teachers`` by env) to the batch;
    build the ``(B, T)`` token rewards the estimators read. Returns ``(batch, rewards,
    metrics)``."""
    a = cfg.algo
    batch = collate(trajs, tokenizer.pad_token_id)
    mask = batch.loss_mask
    m: dict[str, float] = {}
    if not reuses_update_logprobs(cfg):
        old_logp, _ = backend.logprobs(batch, temperature)
        batch.old_logp = old_logp
        m.update({f"rollout/{k}": v for k, v in
                  drift_metrics(old_logp, batch.rollout_logp, mask).items()})
    rewards = batch.token_rewards.clone()
    if a.overlong_buffer:
        lengths = torch.tensor([tr.response_length for tr in trajs])
        pen = overlong_penalty(lengths, cfg.rollout.max_response_tokens, a.overlong_buffer,
                               a.overlong_penalty)
        last = (mask * torch.arange(mask.shape[1])).argmax(-1)
        rewards[torch.arange(len(trajs)), last] += pen
        m["rollout/overlong_penalty"] = float(pen.mean())
    if ref is not None:
        ref_logp = ref.logprobs(batch, temperature)
        batch.ref_logp = ref_logp
        if a.kl_mode == "reward":
            kl_tok = kl_estimate(batch.old_logp, ref_logp, mask, a.kl_estimator)
            rewards = rewards - a.kl_coef * kl_tok
            m["rollout/kl_penalty"] = float(a.kl_coef * kl_tok.sum() / mask.sum().clamp(min=1))
    if teachers:
        envs = [str(t.info.get("env", "")) or cfg.env for t in trajs]
        batch.teacher_logp, batch.teacher_mask = teacher_logprobs(teachers, batch, envs,
                                                                  temperature)
        m.update(distill_metrics(batch.teacher_logp, batch.rollout_logp, batch.teacher_mask))
    return batch, rewards, m


def advantages(cfg: Config, batch: Batch, rewards: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """``algo.advantage`` over the token rewards; sets the batch's ``adv`` and ``returns``
    (a critic's ``values`` / ``last_values`` are read from it)."""
    a = cfg.algo
    adv, returns = compute_advantages(
        a.advantage, rewards, batch.loss_mask, group_ids=batch.uids, episode_ids=batch.episodes,
        values=batch.values, last_values=batch.last_values,
        truncated=batch.truncated, gamma=a.gamma, lam=a.lam, norm_by_std=a.norm_adv_by_std,
        turn_ids=batch.turn_ids, input_ids=batch.input_ids, step_weight=a.step_weight)
    m = {}
    if batch.teacher_logp is not None:  # on-policy distillation: not group-normalised
        term = distill_term(batch.teacher_logp, batch.rollout_logp, batch.teacher_mask,
                            a.distill_coef, a.distill_discount)
        adv = adv + term
        m["rollout/distill_adv_abs"] = float(masked_mean(term.abs(), batch.loss_mask))
    batch.adv, batch.returns = adv, returns
    return adv, {"rollout/adv_abs": float(masked_mean(adv.abs(), batch.loss_mask)), **m}


# --- 4. update -------------------------------------------------------------------------
@dataclass(frozen=True)
class PolicyLoss:
    """The policy's micro-batch loss; totals are the mini-batch's so accumulation is exact.

    Metrics are returned as additive contributions (token-weighted shares for means), so
    summing them over micro-batches gives the mini-batch value whatever the split
    (``*_max`` keys are maxima). Without ``old_logp`` in the batch, the old logprobs are
    this forward pass's own (:func:`reuses_update_logprobs`), and the drift is measured
    here. A small picklable class, so distributed backends can send it to their ranks.
    """

    algo: Any  # agentgym.config.AlgoConfig
    temperature: float
    num_tokens: float
    num_seqs: int
    norm_len: int
    #: tokens the metrics average over when zero-gradient rows are left out (0: num_tokens)
    metric_tokens: float = 0.0
    logprob_chunk: int = 0  # trainer.logprob_chunk
    packing: bool = True  # trainer.packing (agentgym.trainers.packing)

    def __call__(self, model, mb: Batch):
        a, num_tokens = self.algo, self.num_tokens
        agg = dict(mode=a.loss_agg_mode, num_tokens=num_tokens, num_seqs=self.num_seqs,
                   norm_len=self.norm_len)
        dev = next(model.parameters()).device
        mask = mb.loss_mask.to(dev)
        # from the host's mask: no device sync (metrics stay tensors until the step's end)
        share = float(mb.loss_mask.sum()) / (self.metric_tokens or num_tokens)
        logp, entropy = token_logprobs(model, mb, dev, self.temperature, with_entropy=True,
                                       entropy_grad=a.entropy_coef > 0,
                                       chunk=self.logprob_chunk, packing=self.packing)
        metrics = {"entropy": masked_mean(entropy.detach(), mask) * share}
        old = mb.old_logp
        if old is None:
            old = logp.detach()
            drift = torch.where(mask > 0, (old - mb.rollout_logp.to(dev)).abs(), 0.0)
            metrics.update(drift_mean=drift.sum() / mask.sum().clamp(min=1) * share,
                           drift_max=drift.max())
        pg, stats = compute_policy_loss(a.policy_loss, logp, old.to(dev),
                                        mb.adv.to(dev), mask, clip_low=a.clip_low,
                                        clip_high=a.clip_high, dual_clip=a.dual_clip)
        if a.off_policy != "recompute":  # samples drawn by another (stale) policy
            w, w_stats = behaviour_weights(old.to(dev), mb.rollout_logp.to(dev), mask,
                                           a.off_policy, a.is_cap, a.is_low, a.is_high)
            pg = pg * w
            metrics.update({k: v if k.endswith("_max") else v * share
                            for k, v in w_stats.items()})
        loss = aggregate(pg, mask, **agg)
        metrics.update({k: v * share for k, v in stats.items()})
        metrics["pg_loss"] = loss.detach()
        if mb.ref_logp is not None:
            kl_tok = kl_estimate(logp, mb.ref_logp.to(dev), mask, a.kl_estimator)
            metrics["kl"] = masked_mean(kl_tok.detach(), mask) * share
            if a.kl_mode == "loss":
                kl = aggregate(kl_tok, mask, **agg)
                loss = loss + a.kl_coef * kl
                metrics["kl_loss"] = kl.detach()
        if a.entropy_coef > 0:
            loss = loss - a.entropy_coef * aggregate(entropy, mask, **agg)
        return loss, metrics


def make_loss_fn(cfg: Config, temperature: float, num_tokens: float, num_seqs: int,
                 norm_len: int) -> PolicyLoss:
    """The policy loss of one mini-batch (its token and sequence totals)."""
    return PolicyLoss(cfg.algo, temperature, num_tokens, num_seqs, norm_len,
                      logprob_chunk=cfg.trainer.logprob_chunk, packing=cfg.trainer.packing)


def minibatch_updates(cfg: Config, backend: Backend, batch: Batch,
                      make_loss: Callable[[Batch], Callable], step: int, hooks: Hooks,
                      phase: str, prefix: str,
                      trim: Callable[[Batch], list[int]] | None = None) -> dict[str, float]:
    """``ppo_epochs`` x ``mini_batches`` optimizer steps of ``backend`` over ``batch``;
    ``make_loss(mini_batch)`` gives the micro-batch loss for that mini-batch's totals.
    ``trim(mini_batch)``, when given, names the rows whose gradient is exactly zero: they
    are left out of the forward/backward (``make_loss(mini_batch, trained_rows)`` keeps the
    whole mini-batch's totals, so the gradient is unchanged; one row stays when all are
    zero, so the optimizer step and Adam's state are the same as without trimming). Returns the metrics averaged over
    optimizer steps, keys under ``prefix``; with ``trim``, ``skipped_tokens`` too."""
    gen = torch.Generator().manual_seed(cfg.trainer.seed * 1_000_003 + step)
    results: list[dict] = []
    n_mini = max(1, min(cfg.trainer.mini_batches, len(batch)))
    hooks.phase(phase, cfg.trainer.ppo_epochs * n_mini)
    skipped = 0.0
    for _ in range(cfg.trainer.ppo_epochs):
        order = torch.randperm(len(batch), generator=gen).tolist()
        for k in range(n_mini):
            mini = batch.select(sorted(order[k::n_mini]))
            if trim is None:
                loss_fn = make_loss(mini)
            else:
                zero = set(trim(mini))
                if len(zero) == len(mini):  # keep the shortest: an exactly zero gradient
                    zero.discard(int(mini.attention_mask.sum(-1).argmin()))
                trained = mini.select([i for i in range(len(mini)) if i not in zero])
                skipped += float(mini.loss_mask.sum() - trained.loss_mask.sum())
                loss_fn, mini = make_loss(mini, trained), trained
            results.append(backend.train_step(backend.split(mini), loss_fn))
            hooks.advance()
    m = {f"{prefix}{k}": max(r[k] for r in results) if k.endswith("_max")
         else sum(r[k] for r in results) / len(results) for k in results[0]}
    if trim is not None:
        m[f"{prefix}skipped_tokens"] = skipped / cfg.trainer.ppo_epochs
    return m


def zero_gradient_rows(cfg: Config, batch: Batch) -> list[int] | None:
    """Rows whose policy gradient is exactly zero, or None when that cannot be known.

    With no KL loss and no entropy bonus, a row contributes ``adv * f(ratio)`` per token
    (every policy loss here, clipped or not, weighted or not), so a row whose advantages
    are all zero adds nothing. With either term on, every row has a gradient."""
    a = cfg.algo
    if (a.kl_coef > 0 and a.kl_mode == "loss") or a.entropy_coef > 0:
        return None
    adv = torch.where(batch.loss_mask > 0, batch.adv, 0.0)
    return [i for i, nonzero in enumerate((adv != 0).any(-1).tolist()) if not nonzero]


def update_policy(cfg: Config, backend: Backend, batch: Batch, temperature: float,
                  step: int, hooks: Hooks) -> dict[str, float]:
    """The policy's optimizer steps over this step's batch (``train/…`` metrics).

    Zero-gradient rows (:func:`zero_gradient_rows`) are left out of the update; when every
    row is one, the whole update is skipped: no forward/backward, no optimizer or scheduler
    step (``train/skipped_steps`` 1). ``train/skipped_tokens``: sampled tokens of the step
    no forward/backward saw (per epoch)."""
    zero = zero_gradient_rows(cfg, batch)
    if zero is not None and len(zero) == len(batch):
        logger.info("step %d: every advantage is zero and no other loss term is on; "
                    "the update is skipped", step + 1)
        return {"train/skipped_steps": 1.0, "train/skipped_tokens": float(batch.loss_mask.sum())}

    def make_loss(mini: Batch, trained: Batch | None = None):
        loss = make_loss_fn(cfg, temperature, float(mini.loss_mask.sum().clamp(min=1)),
                            len(mini), cfg.rollout.max_response_tokens)
        if trained is None:
            return loss
        return dataclasses.replace(loss, metric_tokens=float(trained.loss_mask.sum().clamp(min=1)))
    trim = None if zero is None else (lambda mini: zero_gradient_rows(cfg, mini))
    m = minibatch_updates(cfg, backend, batch, make_loss, step, hooks, "update", "train/",
                          trim=trim)
    m["train/skipped_steps"] = 0.0
    m.setdefault("train/skipped_tokens", 0.0)
    for key in ("drift_mean", "drift_max"):  # measured by the update (reused logprobs)
        if f"train/{key}" in m:
            m[f"rollout/{key}"] = m.pop(f"train/{key}")
    return m
