"""GRPO and its critic-free relatives for multi-turn tool-using agents, top to bottom.

    agentgym train env=search                                   # GRPO, smollm2-135m, shipped data
    agentgym train env=search algo=rloo                         # or dr_grpo, reinforce_plus_plus,
                                                                #    reinforce_plus_plus_baseline, dapo, gspo
    agentgym train env=search model=tiny trainer.total_steps=2  # seconds, for a smoke test
    agentgym train env=search run_dir=runs/a trainer.resume=auto  # continue a killed run

(``algo=ppo`` trains a critic too: :mod:`agentgym.trainers.ppo`, which reuses these phases.)

Each step:
  1. roll out ``trainer.prompts_per_step`` prompts ``rollout.n`` times each (the
     GenerationManager; engine logprobs and the policy version land on every
     trajectory). With ``algo.dynamic_sampling`` (DAPO), groups whose rewards are all
     equal are dropped and further prompts rolled out until the step is full, for at
     most ``algo.max_sampling_rounds`` rounds;
  2. reference logprobs when ``algo.kl_coef`` > 0; the trainer's old logprobs (a
     separate pass only when the batch takes several optimizer steps or the KL penalty
     is in the reward: with one step they are the update's own forward pass); the
     engine/trainer logprob drift on sampled tokens;
  3. token rewards: each turn's env reward on the last token sampled in that turn, DAPO's
     overlong penalty (``algo.overlong_buffer``) on the last one, and the per-token KL
     penalty when ``algo.kl_mode=reward``; then the registered estimator
     ``algo.advantage`` (``grpo``, ``rloo``, ``reinforce_plus_plus``, …);
  4. ``trainer.ppo_epochs`` x ``trainer.mini_batches`` optimizer steps of the policy loss
     ``algo.policy_loss``, micro-batched under ``trainer.micro_batch_tokens`` with
     gradient accumulation, aggregated by ``algo.loss_agg_mode`` over the mini-batch;
  5. sync the new weights into the rollout engine (policy version + 1);
  6. log metrics (JSONL, TensorBoard, reward PNG) and save HF checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from agentgym._compat import deprecated_attributes
from agentgym.config import Config, is_mixed, to_dict
from agentgym.data.rows import heldout_rows, training_rows
from agentgym.reporting.evaluation import write_outcomes
from agentgym.reporting.metrics import MetricsLogger
from agentgym.core.device import peak_memory_gb
from agentgym.core.supervisor import (ServiceFailed, forget_unsupervised, infra_totals,
                                      raise_if_failed)
from agentgym.models.zoo import load_tokenizer, resolve_model
from agentgym.rollout.engines.base import ENGINES
from agentgym.rollout.runtime import engine_for
from agentgym.core.types import Trajectory
from agentgym.trainers.algos import (ADVANTAGES, POLICY_LOSSES, aggregate, behaviour_weights,
                            compute_advantages, compute_policy_loss, kl_estimate,
                            masked_mean, needs_critic, needs_groups, overlong_penalty)
from agentgym.trainers.backends.base import first_needed_position, sequence_logprobs
from agentgym.trainers.backends.single import SingleBackend
from agentgym.trainers.batch import Batch, collate
from agentgym.trainers.local_rollout import Hooks, LocalRollout, eval_metrics
from agentgym.trainers.run import (make_backend, policy_spec, reference, resume, save_checkpoint,
                          start_run)
from agentgym.trainers.samples import write_samples
from agentgym.trainers.sampling import SyncSteps

logger = logging.getLogger(__name__)
# moved to trainers.sampling; the old path works for one release
__getattr__ = deprecated_attributes(__name__, "agentgym.trainers.sampling",
                                    ("collect", "regroup", "rollout_metrics"))


def check_algo(cfg: Config) -> None:
    """Fail before any model loads: unknown estimator/loss names, settings that clash."""
    a, n = cfg.algo, cfg.rollout.n
    POLICY_LOSSES.get(a.policy_loss)
    ADVANTAGES.get(a.advantage)
    if cfg.trainer.mode == "async":
        bad = [(a.dynamic_sampling, "algo.dynamic_sampling"),
               (cfg.engine.name != "hf", f"engine={cfg.engine.name}"),
               (needs_critic(a.advantage), f"algo.advantage={a.advantage} (a critic)")]
        named = [what for cond, what in bad if cond]
        if named:
            raise ValueError(f"trainer.mode=async runs with the hf engine (here or in Ray "
                             f"rollout workers) and the GRPO family so far; not with "
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


def check_vision(cfg: Config, path) -> None:
    """What a vision-language policy runs on so far (images through the single backend,
    the HF engine, the GRPO family); the rest fails here, naming the setting."""
    from agentgym.models.zoo import is_vision_language
    if not is_vision_language(path):
        return
    from agentgym.trainers.algos import needs_critic
    bad = [(cfg.trainer.backend != "single", f"trainer.backend={cfg.trainer.backend}"),
           (cfg.engine.name != "hf", f"engine={cfg.engine.name}"),
           (needs_critic(cfg.algo.advantage), f"algo.advantage={cfg.algo.advantage} (a critic)"),
           (bool(cfg.ray.address), "ray.address"), (cfg.model.lora.rank > 0, "model.lora.rank")]
    named = [what for cond, what in bad if cond]
    if named:
        raise ValueError(f"{path} is a vision-language model; images are supported with "
                         f"trainer.backend=single, engine=hf, no Ray, no LoRA and the GRPO-family "
                         f"estimators so far; not with {', '.join(named)}")


def setup(cfg: Config):
    """Load the policy (trained), the rollouts (an engine with its own copy, here or in
    Ray actors) and an optional frozen reference. Returns ``(path, tokenizer, backend,
    rollout, ref_model, cluster)`` (``cluster``: the Ray placement, or None)."""
    check_algo(cfg)
    cluster = None
    if cfg.ray.address:
        from agentgym.trainers.ray_cluster import RayCluster
        cluster = RayCluster(cfg)
    path = resolve_model(cfg.model.path or cfg.model.name)
    check_vision(cfg, path)
    tokenizer = load_tokenizer(path)
    backend = make_backend(cfg, policy_spec(cfg, path), cfg.trainer.lr, cluster)
    rollout = make_rollout(cfg, path, tokenizer, cluster)
    ref = reference(cfg, path, backend) if cfg.algo.kl_coef > 0 else None
    return path, tokenizer, backend, rollout, ref, cluster


def make_rollout(cfg: Config, path, tokenizer, cluster=None):
    """Where rollouts run: this process (:class:`~agentgym.trainers.local_rollout.LocalRollout`), or
    ``ray.rollout_workers`` actors of a Ray ``cluster``. Engines whose weights live in
    servers (``engine=sglang``) are driven from this process either way."""
    if cluster is not None and ENGINES.get(cfg.engine.name).needs_model:
        from agentgym.trainers.ray_cluster import RayRollout
        return RayRollout(cluster, cfg, str(path))
    return LocalRollout(cfg, engine_for(cfg, path, tokenizer), tokenizer)


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


def score(cfg: Config, backend: SingleBackend, ref, trajs: list[Trajectory], tokenizer,
          temperature: float) -> tuple[Batch, torch.Tensor, dict]:
    """Collate ``trajs``; add old logprobs (unless the update provides them, see
    :func:`reuses_update_logprobs`) and reference logprobs to ``batch.extra``; build the
    ``(B, T)`` token rewards the estimators read. Returns ``(batch, rewards, metrics)``."""
    a = cfg.algo
    batch = collate(trajs, tokenizer.pad_token_id)
    mask = batch.loss_mask
    m: dict[str, float] = {}
    if not reuses_update_logprobs(cfg):
        old_logp, _ = backend.logprobs(batch, temperature)
        batch.extra["old_logp"] = old_logp
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
        batch.extra["ref_logp"] = ref_logp
        if a.kl_mode == "reward":
            kl_tok = kl_estimate(batch.extra["old_logp"], ref_logp, mask, a.kl_estimator)
            rewards = rewards - a.kl_coef * kl_tok
            m["rollout/kl_penalty"] = float(a.kl_coef * kl_tok.sum() / mask.sum().clamp(min=1))
    return batch, rewards, m


def advantages(cfg: Config, batch: Batch, rewards: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """``algo.advantage`` over the token rewards; stores ``adv`` and ``returns`` in
    ``batch.extra`` (critic inputs ``values``/``last_values`` are read from there)."""
    a = cfg.algo
    adv, returns = compute_advantages(
        a.advantage, rewards, batch.loss_mask, group_ids=batch.uids, episode_ids=batch.episodes,
        values=batch.extra.get("values"), last_values=batch.extra.get("last_values"),
        truncated=batch.truncated, gamma=a.gamma, lam=a.lam, norm_by_std=a.norm_adv_by_std,
        turn_ids=batch.turn_ids, input_ids=batch.input_ids, step_weight=a.step_weight)
    batch.extra["adv"], batch.extra["returns"] = adv, returns
    return adv, {"rollout/adv_abs": float(masked_mean(adv.abs(), batch.loss_mask))}


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

    def __call__(self, model, mb: Batch):
        a, num_tokens = self.algo, self.num_tokens
        agg = dict(mode=a.loss_agg_mode, num_tokens=num_tokens, num_seqs=self.num_seqs,
                   norm_len=self.norm_len)
        dev = next(model.parameters()).device
        ids, attn, mask = (mb.input_ids.to(dev), mb.attention_mask.to(dev),
                           mb.loss_mask.to(dev))
        share = float(mask.sum()) / (self.metric_tokens or num_tokens)
        logp, entropy = sequence_logprobs(model, ids, attn, self.temperature, with_entropy=True,
                                          start=first_needed_position(mb.loss_mask),
                                          entropy_grad=a.entropy_coef > 0, images=mb.images,
                                          chunk=self.logprob_chunk)
        metrics = {"entropy": float(masked_mean(entropy.detach(), mask)) * share}
        old = mb.extra.get("old_logp")
        if old is None:
            old = logp.detach()
            drift = drift_metrics(old, mb.rollout_logp.to(dev), mask)
            metrics.update(drift_mean=drift["drift_mean"] * share, drift_max=drift["drift_max"])
        pg, stats = compute_policy_loss(a.policy_loss, logp, old.to(dev),
                                        mb.extra["adv"].to(dev), mask, clip_low=a.clip_low,
                                        clip_high=a.clip_high, dual_clip=a.dual_clip)
        if a.off_policy != "recompute":  # samples drawn by another (stale) policy
            w, w_stats = behaviour_weights(old.to(dev), mb.rollout_logp.to(dev), mask,
                                           a.off_policy, a.is_cap, a.is_low, a.is_high)
            pg = pg * w
            metrics.update({k: v if k.endswith("_max") else v * share
                            for k, v in w_stats.items()})
        loss = aggregate(pg, mask, **agg)
        metrics.update({k: v * share for k, v in stats.items()})
        metrics["pg_loss"] = float(loss.detach())
        if "ref_logp" in mb.extra:
            kl_tok = kl_estimate(logp, mb.extra["ref_logp"].to(dev), mask, a.kl_estimator)
            metrics["kl"] = float(masked_mean(kl_tok.detach(), mask)) * share
            if a.kl_mode == "loss":
                kl = aggregate(kl_tok, mask, **agg)
                loss = loss + a.kl_coef * kl
                metrics["kl_loss"] = float(kl.detach())
        if a.entropy_coef > 0:
            loss = loss - a.entropy_coef * aggregate(entropy, mask, **agg)
        return loss, metrics


def make_loss_fn(cfg: Config, temperature: float, num_tokens: float, num_seqs: int,
                 norm_len: int) -> PolicyLoss:
    """The policy loss of one mini-batch (its token and sequence totals)."""
    return PolicyLoss(cfg.algo, temperature, num_tokens, num_seqs, norm_len,
                      logprob_chunk=cfg.trainer.logprob_chunk)


def minibatch_updates(cfg: Config, backend: SingleBackend, batch: Batch,
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
    adv = torch.where(batch.loss_mask > 0, batch.extra["adv"], 0.0)
    return [i for i, nonzero in enumerate((adv != 0).any(-1).tolist()) if not nonzero]


def update_policy(cfg: Config, backend: SingleBackend, batch: Batch, temperature: float,
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


# --- the run around the steps: start-up, 6. metrics / eval / checkpoints, tear-down ----
@dataclass
class Session:
    """What a recipe's step loop works with, from :func:`open_session`."""

    cfg: Config
    hooks: Hooks
    run_dir: Path
    rows: list[dict]  # training rows, shuffled with trainer.seed
    eval_rows: list[dict]
    tokenizer: Any
    backend: SingleBackend
    rollout: Any  # trainers.local_rollout.LocalRollout or trainers.ray_cluster.RayRollout
    ref: Any  # the frozen KL reference (Reference), or None
    metrics_log: MetricsLogger
    critic: Any  # trainers.critic.Critic, or None
    cluster: Any  # trainers.ray_cluster.RayCluster, or None
    start: int  # first step to run (after a resume)
    cursor: int  # next training row
    version: int  # policy version the engine holds
    temperature: float
    #: async mode: groups after ``cursor`` already trained on or dropped (taken oldest
    #: finished first, so not always a prefix)
    taken: list[int] = field(default_factory=list)
    #: this process's service counters when the run started (``infra/*`` count from it)
    infra_base: dict = field(default_factory=infra_totals)
    curriculum: Any = None  # trainers.curriculum.Curriculum (data.curriculum=solve_rate)

    def end_step(self, done: int, m: dict) -> None:
        """Periodic eval, the step's metrics line, and a checkpoint when one is due.

        Raises:
            ServiceFailed: a local service ran out of restarts (its episodes could only
                fail from here on): the run stops after a checkpoint of this step, so
                ``trainer.resume=auto`` continues it once the service is fixed.
        """
        t = self.cfg.trainer
        if self.eval_rows and t.eval_every and done % t.eval_every == 0 and done < t.total_steps:
            m.update(self.evaluate(done))
        # the services this run's tools used: restarts and seconds down since the start
        m.update({k: round(v - self.infra_base.get(k, 0.0), 3)
                  for k, v in infra_totals().items()})
        self.metrics_log.log(done, m)
        due = done % t.save_every == 0 or done == t.total_steps
        if due:
            self.save(done)
        self.hooks.step_end(done, m)
        try:
            raise_if_failed()
        except ServiceFailed as e:
            path = self.run_dir / "checkpoints" / f"step_{done}" if due else self.save(done)
            raise ServiceFailed(f"{e}. The run stopped after step {done} rather than train on "
                                f"failed tool calls; checkpoint {path}. Fix the service, then "
                                f"continue with trainer.resume=auto run_dir={self.run_dir}") \
                from None

    def save(self, done: int) -> Path:
        """``checkpoints/step_<done>``: weights, optimizer, data position, policy version."""
        return save_checkpoint(self.run_dir, done, self.backend, self.tokenizer,
                               {"data_cursor": self.cursor, "data_taken": self.taken,
                                "policy_version": self.version,
                                **({"curriculum": self.curriculum.state()}
                                   if self.curriculum else {})},
                               critic=self.critic.backend if self.critic else None)

    def write_samples(self, step: int, trajs: list[Trajectory], batch: Batch) -> None:
        """``trainer.log_samples`` of the step's trajectories, for ``agentgym inspect``."""
        if self.cfg.trainer.log_samples:
            path = write_samples(self.run_dir, step, self.cfg.trainer.log_samples, trajs, batch,
                                 self.backend, self.tokenizer, self.temperature)
            if path is not None:
                self.metrics_log.samples(step, path)

    def evaluate(self, step: int) -> dict:
        """Greedy single-sample accuracy on the held-out rows; each question's outcome in
        ``eval/step_<step>.json`` (for the paired test of two steps,
        :func:`agentgym.reporting.evaluation.paired_steps`)."""
        trajs = self.rollout.generate(self.eval_rows, 1, self.cfg.trainer.seed, self.hooks,
                                      greedy=True)
        write_outcomes(self.run_dir / "eval" / f"step_{step}.json", trajs)
        return eval_metrics(trajs, per_env=is_mixed(self.cfg))

    def sync(self) -> None:
        """A new policy version: the trainer's full weights, gathered once, into every
        rollout engine."""
        self.version += 1
        self.rollout.update_weights(self.backend.state_dict(), self.version)

    def finish(self) -> None:
        """The final held-out eval (when configured and a step ran)."""
        t = self.cfg.trainer
        if self.eval_rows and self.start < t.total_steps:
            final = self.evaluate(t.total_steps)
            self.metrics_log.log(t.total_steps, final)
            self.hooks.step_end(t.total_steps, final)

    def close(self) -> None:
        self.rollout.close()
        self.metrics_log.close()
        self.backend.close()  # a sharded backend stops its rank processes / actors
        if self.critic is not None:
            self.critic.close()
        if self.cluster is not None:
            self.cluster.close()


def open_session(cfg: Config, hooks: Hooks | None = None,
                 make_critic: Callable[[Path, Any], Any] | None = None) -> Session:
    """Run directory, data, models (``make_critic(policy_path, cluster)`` for a critic),
    resume from the latest checkpoint (weights, data position, policy version), the
    step-0 eval. With Ray, ``placement.json`` in the run directory says which node each
    train rank and rollout worker got."""
    hooks = hooks or Hooks()
    t = cfg.trainer
    forget_unsupervised()  # outages of URLs an earlier run in this process used
    run_dir = start_run(cfg)
    found = training_rows(cfg)
    hooks.announce(found.describe(cfg.data.name))
    rows = found.rows
    random.Random(t.seed).shuffle(rows)
    held_out = heldout_rows(cfg)
    if t.eval_limit:
        hooks.announce(held_out.describe(t.eval_data, "held-out"))
    eval_rows = held_out.rows
    path, tokenizer, backend, rollout, ref, cluster = setup(cfg)
    critic = make_critic(path, cluster) if make_critic else None
    if cluster is not None:
        (run_dir / "placement.json").write_text(json.dumps(
            {"placement": cfg.ray.placement, "bundle": cluster.bundle, **cluster.nodes},
            indent=2) + "\n")
    state = resume(t.resume, run_dir, backend, critic.backend if critic else None)
    start = state["step"]
    version = state.get("policy_version", start)
    if version or getattr(rollout, "remote", False):  # servers start from their own copy
        rollout.update_weights(backend.state_dict(), version)
    s = Session(cfg, hooks, run_dir, rows, eval_rows, tokenizer, backend, rollout, ref,
                MetricsLogger(run_dir, resume_step=start, sink=t.logger, config=to_dict(cfg)),
                critic, cluster, start,
                state.get("data_cursor", start * t.prompts_per_step), version,
                cfg.rollout.temperature or 1.0, state.get("data_taken", []))
    if cfg.data.curriculum:
        from agentgym.trainers.curriculum import make_curriculum
        s.curriculum = make_curriculum(rows, tuple(cfg.data.curriculum_band), t.seed,
                                       state.get("curriculum"))
    if eval_rows and start == 0:
        s.metrics_log.log(0, s.evaluate(0))
    return s


def step_source(cfg: Config, s: Session):
    """Where each step's trajectories come from, behind one interface (``take(step)``,
    ``cursor``, ``taken_after_cursor``): :class:`~agentgym.trainers.sampling.SyncSteps`, or with
    ``trainer.mode=async`` an :class:`~agentgym.trainers.async_rollout.AsyncRollout` that keeps
    rolling out while the trainer trains (it then also serves the session's evals and
    weight pushes)."""
    if cfg.trainer.mode == "async":
        if s.curriculum:
            raise ValueError("data.curriculum=solve_rate picks each step's prompts from the "
                             "last step's outcomes; run it with trainer.mode=sync")
        from agentgym.trainers.async_rollout import AsyncRollout
        s.rollout = AsyncRollout(cfg, s.rollout, s.rows, s.cursor, s.version, s.taken)
        return s.rollout
    return SyncSteps(cfg, s.rollout, s.rows, s.cursor, s.hooks, s.curriculum)


def train(cfg: Config, hooks: Hooks | None = None) -> Path:
    """Run a critic-free algorithm (GRPO, RLOO, REINFORCE++, DAPO, GSPO …) as configured;
    return the run directory."""
    if needs_critic(cfg.algo.advantage):
        raise ValueError(f"algo.advantage={cfg.algo.advantage!r} reads a critic's values: "
                         f"run it with trainers.ppo.train (trainers.train picks the recipe)")
    check_algo(cfg)  # before data and models load
    s = open_session(cfg, hooks)
    source = step_source(cfg, s)
    try:
        for step in range(s.start, cfg.trainer.total_steps):
            t0 = time.perf_counter()
            # 1. rollouts (async: the next finished groups, within the staleness bound)
            trajs, m = source.take(step)
            s.cursor, s.taken = source.cursor, source.taken_after_cursor
            t1 = time.perf_counter()
            if trajs:
                # 2. old / reference logprobs; 3. token rewards and advantages
                batch, rewards, mm = score(cfg, s.backend, s.ref, trajs, s.tokenizer,
                                           s.temperature)
                adv, ma = advantages(cfg, batch, rewards)
                m.update({**mm, **ma, "time/logprobs_s": time.perf_counter() - t1})
                s.write_samples(step + 1, trajs, batch)
                # 4. policy update
                tu = time.perf_counter()
                m.update(update_policy(cfg, s.backend, batch, s.temperature, step, s.hooks))
                m["time/update_s"] = time.perf_counter() - tu
            t2 = time.perf_counter()
            # 5. weight sync (none when dynamic sampling left nothing to train on)
            if trajs:
                s.sync()
            t3 = time.perf_counter()
            # 6. metrics and checkpoints
            m.update({"time/rollout_s": t1 - t0, "time/train_s": t2 - t1, "time/sync_s": t3 - t2,
                      "time/generate_s": m["rollout/generate_s"], "time/env_s": m["rollout/env_s"],
                      "time/step_s": time.perf_counter() - t0})
            if (peak := peak_memory_gb(getattr(s.backend, "device", None))) is not None:
                m["perf/peak_memory_gb"] = peak  # this process's GPU: policy, engine, ref
            s.end_step(step + 1, m)
        s.finish()
    finally:
        s.close()
    return s.run_dir
