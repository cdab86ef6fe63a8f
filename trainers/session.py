"""The run around the steps (:mod:`agentgym.trainers.loop`): start-up (run directory, data,
models, a resume from the latest checkpoint, the step-0 eval), where each step's
trajectories come from (:func:`step_source`: synchronous or asynchronous, the same for
every algorithm), and per step: metrics, periodic eval, checkpoints; tear-down."""

from __future__ import annotations

import contextlib
import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from agentgym.config import Config, is_mixed, to_dict
from agentgym.core.memory import give_back
from agentgym.supervision.supervisor import (ServiceFailed, forget_unsupervised, infra_totals,
                                      raise_if_failed)
from agentgym.core.types import Trajectory
from agentgym.supervision.watchdog import NO_WATCH, Watchdog, end_state
from agentgym.data.rows import heldout_rows, training_rows
from agentgym.models.zoo import is_vision_language, load_tokenizer, resolve_model
from agentgym.reporting.evaluation import write_outcomes
from agentgym.reporting.metrics import MetricsLogger
from agentgym.rollout.engines.base import ENGINES
from agentgym.rollout.runtime import engine_for
from agentgym.trainers.backends.base import Backend
from agentgym.trainers.batch import Batch
from agentgym.trainers.hooks import Hooks, WatchedHooks
from agentgym.trainers.workers import LocalWorkers, eval_metrics
from agentgym.trainers.backends.factory import make_backend, policy_spec
from agentgym.trainers.checkpoints import resume, save_checkpoint, start_run
from agentgym.trainers.reference import reference
from agentgym.trainers.sample_log import write_samples
from agentgym.trainers.collection import SyncSteps
from agentgym.trainers.distill import teachers
from agentgym.trainers.async_steps import AsyncSteps
from agentgym.trainers.ray_cluster import RayCluster, RayWorkers
from agentgym.trainers.curriculum import make_curriculum

logger = logging.getLogger(__name__)


def check_vision(cfg: Config, path) -> None:
    """What a vision-language policy runs on so far (images through the single backend,
    the HF engine, the GRPO family); the rest fails here, naming the setting."""
    if not is_vision_language(path):
        return
    bad = [(cfg.trainer.backend != "single", f"trainer.backend={cfg.trainer.backend}"),
           (cfg.engine.name != "hf", f"engine={cfg.engine.name}"),
           (cfg.algo.needs_critic, f"algo.advantage={cfg.algo.advantage} (a critic)"),
           (bool(cfg.ray.address), "ray.address"), (cfg.model.lora.rank > 0, "model.lora.rank")]
    named = [what for cond, what in bad if cond]
    if named:
        raise ValueError(f"{path} is a vision-language model; images are supported with "
                         f"trainer.backend=single, engine=hf, no Ray, no LoRA and the GRPO-family "
                         f"estimators so far; not with {', '.join(named)}")


def setup(cfg: Config, built: contextlib.ExitStack):
    """Load the policy (trained), the workers that play episodes (an engine with its own
    copy, here or in Ray actors) and an optional frozen reference. Returns ``(path,
    tokenizer, backend, workers, ref_model, cluster)`` (``cluster``: the Ray placement, or
    None); each part that holds processes or actors is pushed onto ``built`` to close."""
    cluster = None
    if cfg.ray.address:
        cluster = RayCluster(cfg)
        built.callback(cluster.close)
    path = resolve_model(cfg.model.path or cfg.model.name)
    check_vision(cfg, path)
    tokenizer = load_tokenizer(path)
    backend = make_backend(cfg, policy_spec(cfg, path), cfg.trainer.lr, cluster)
    built.callback(backend.close)
    workers = make_workers(cfg, path, tokenizer, cluster)
    built.callback(workers.close)
    ref = reference(cfg, path, backend) if cfg.algo.kl_coef > 0 else None
    return path, tokenizer, backend, workers, ref, cluster


def make_workers(cfg: Config, path, tokenizer, cluster=None):
    """Where episodes are played: this process
    (:class:`~agentgym.trainers.workers.LocalWorkers`), or
    ``ray.rollout_workers`` actors of a Ray ``cluster``. Engines whose weights live in
    servers (``engine=sglang``) are driven from this process either way."""
    if cluster is not None and ENGINES.get(cfg.engine.name).needs_model:
        return RayWorkers(cluster, cfg, str(path))
    return LocalWorkers(cfg, engine_for(cfg, path, tokenizer), tokenizer)


@dataclass(kw_only=True)
class Session:
    """What the step loop works with, from :func:`open_session` (built with keywords)."""

    cfg: Config
    hooks: Hooks
    run_dir: Path
    rows: list[dict]  # training rows, shuffled with trainer.seed
    eval_rows: list[dict]
    tokenizer: Any
    backend: Backend  # SingleBackend, or DistributedBackend (FSDP2 / DeepSpeed ranks)
    workers: Any  # where episodes are played: LocalWorkers, or ray_cluster.RayWorkers
    ref: Any  # the frozen KL reference (Reference), or None
    teachers: Any  # on-policy distillation's teachers by env (trainers.distill.Teacher), or None
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
    #: where each step's trajectories come from (:func:`step_source`): it also pushes the
    #: weights and closes the workers
    steps: Any = None
    #: the stages' deadlines, heartbeat.json and stall stacks (agentgym.supervision.watchdog)
    watch: Any = NO_WATCH

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
        give_back()  # the step's freed memory, back to the system (agentgym.core.memory)
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
        with self.watch.stage("checkpoint", done):
            return save_checkpoint(self.run_dir, done, self.backend, self.tokenizer,
                                   {"data_cursor": self.cursor, "data_taken": self.taken,
                                    "policy_version": self.version,
                                    **({"curriculum": self.curriculum.state()}
                                       if self.curriculum else {})},
                                   critic=self.critic.backend if self.critic else None,
                                   keep=self.cfg.trainer.keep_checkpoints)

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
        with self.watch.stage("eval", step):  # its deadline counts from the last episode
            trajs = self.workers.generate(self.eval_rows, 1, self.cfg.trainer.seed,
                                          self.hooks, greedy=True)
        write_outcomes(self.run_dir / "eval" / f"step_{step}.json", trajs)
        return eval_metrics(trajs, per_env=is_mixed(self.cfg))

    def sync(self) -> None:
        """A new policy version: the trainer's full weights, gathered once, into every
        rollout engine."""
        self.version += 1
        with self.watch.stage("sync", self.version):
            (self.steps or self.workers).update_weights(self.backend.state_dict(),
                                                        self.version)

    def finish(self) -> None:
        """The final held-out eval (when configured and a step ran)."""
        t = self.cfg.trainer
        if self.eval_rows and self.start < t.total_steps:
            final = self.evaluate(t.total_steps)
            self.metrics_log.log(t.total_steps, final)
            self.hooks.step_end(t.total_steps, final)

    def close(self, state: str = "finished") -> None:
        """The heartbeat's last state, then workers, metrics, backend, critic and cluster,
        in that order: each is closed even when one before it fails (that error is raised
        once all have run), so no rank process or actor outlives a failed close."""
        with contextlib.ExitStack() as stack:  # its callbacks run last-in, first-out
            if self.cluster is not None:
                stack.callback(self.cluster.close)
            if self.critic is not None:
                stack.callback(self.critic.close)
            stack.callback(self.backend.close)  # a sharded backend stops its ranks / actors
            stack.callback(self.metrics_log.close)
            stack.callback((self.steps or self.workers).close)  # a step source: its workers
            stack.callback(self.watch.close, state)


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
    built = contextlib.ExitStack()  # closed if the set-up fails: no rank outlives it
    try:
        s = _opened(cfg, hooks, make_critic, run_dir, rows, eval_rows, built)
    except BaseException as error:
        try:  # every part is closed; one that fails to close does not replace the error
            built.close()
        except Exception as failed:
            logger.warning("closing what a failed set-up had started failed too (%s): %r",
                           type(error).__name__, failed)
        raise
    built.pop_all()  # the session closes them from here on
    return s


def _opened(cfg: Config, hooks: Hooks, make_critic, run_dir: Path, rows: list[dict],
            eval_rows: list[dict], built: contextlib.ExitStack) -> Session:
    t = cfg.trainer
    path, tokenizer, backend, workers, ref, cluster = setup(cfg, built)
    teach = teachers(cfg, tokenizer, backend)  # refused here, before any step, on a mismatch
    critic = make_critic(path, cluster) if make_critic else None
    if critic is not None:
        built.callback(critic.close)
    if cluster is not None:
        (run_dir / "placement.json").write_text(json.dumps(
            {"placement": cfg.ray.placement, "bundle": cluster.bundle, **cluster.nodes},
            indent=2) + "\n")
    state = resume(t.resume, run_dir, backend, critic.backend if critic else None)
    start = state["step"]
    version = state.get("policy_version", start)
    if version or getattr(workers, "remote", False):  # servers start from their own copy
        workers.update_weights(backend.state_dict(), version)
    watch = Watchdog(run_dir, cfg.deadlines)
    try:  # what goes wrong from here on (Ctrl-C included) is said by the heartbeat
        hooks = WatchedHooks(hooks, watch)
        metrics_log = MetricsLogger(run_dir, resume_step=start, sink=t.logger,
                                    config=to_dict(cfg))
        built.callback(metrics_log.close)  # its TensorBoard writer's thread, a W&B service
        s = Session(cfg=cfg, hooks=hooks, run_dir=run_dir, rows=rows, eval_rows=eval_rows,
                    watch=watch, tokenizer=tokenizer, backend=backend, workers=workers, ref=ref,
                    teachers=teach, metrics_log=metrics_log, critic=critic, cluster=cluster, start=start,
                    cursor=state.get("data_cursor", start * t.prompts_per_step), version=version,
                    temperature=cfg.rollout.temperature or 1.0,
                    taken=state.get("data_taken", []))
        if cfg.data.curriculum:
            s.curriculum = make_curriculum(rows, tuple(cfg.data.curriculum_band), t.seed,
                                           state.get("curriculum"))
        if eval_rows and start == 0:
            s.metrics_log.log(0, s.evaluate(0))
    except BaseException as e:
        watch.close(end_state(e))
        raise
    return s


def step_source(cfg: Config, s: Session):
    """Where each step's trajectories come from, the same for every algorithm, behind one
    interface (``take(step)``, ``weights_unchanged()``, ``cursor``, ``taken_after_cursor``):
    :class:`~agentgym.trainers.collection.SyncSteps`, or with ``trainer.mode=async`` an
    :class:`~agentgym.trainers.async_steps.AsyncSteps` that keeps rolling out while the
    trainer trains (it then also serves the session's evals and weight pushes)."""
    if cfg.trainer.mode == "async":
        if s.curriculum:
            raise ValueError("data.curriculum=solve_rate picks each step's prompts from the "
                             "last step's outcomes; run it with trainer.mode=sync")
        s.steps = AsyncSteps(cfg, s.workers, s.rows, s.cursor, s.version, s.taken,
                             s.watch)
    else:
        s.steps = SyncSteps(cfg, s.workers, s.rows, s.cursor, s.hooks, s.curriculum)
    return s.steps
