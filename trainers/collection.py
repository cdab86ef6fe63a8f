"""Step 1 of a recipe, rollouts: ``collect`` (this step's prompts, DAPO's dynamic sampling),
``rollout_metrics`` and ``regroup``; and the one interface the sync and async paths share,
``take(step) -> (trajectories, metrics)`` with ``cursor`` / ``taken_after_cursor`` (the data
position a checkpoint keeps): :class:`SyncSteps` here, :class:`agentgym.trainers.async_steps.
AsyncSteps` when rollouts keep going while the trainer trains.
"""

from __future__ import annotations

import collections
import logging
import statistics

from agentgym.config import Config, is_mixed
from agentgym.core.types import Trajectory
from agentgym.rollout.manager import last_parts, summarize
from agentgym.trainers.algos import groups_with_signal, signal_share
from agentgym.trainers.hooks import Hooks
from agentgym.trainers.workers import split_by_env

logger = logging.getLogger(__name__)


def collect(cfg: Config, workers, rows: list[dict], cursor: int,
            step: int, hooks: Hooks, curriculum=None) -> tuple[list[Trajectory], int, dict]:
    """Roll out this step's prompts from ``rows[cursor:]``; return the trajectories to
    train on, the next data position and rollout metrics (over *every* sampled
    trajectory, dropped ones included, so the reward curve shows the policy).

    Episodes marked as infrastructure failures are left out as ``rollout.on_infra_error``
    says (:func:`without_infra_failures`); no update sees them unless it is ``keep``.

    With ``algo.dynamic_sampling``, groups whose rewards are all equal are dropped and
    further prompts are rolled out until ``trainer.prompts_per_step`` groups are kept or
    ``algo.max_sampling_rounds`` rounds have run (then the step trains on what it has).

    With a ``curriculum`` (:class:`agentgym.trainers.curriculum.Curriculum`), it picks the rows and
    is told how each group did; ``cursor`` then only counts the prompts taken.
    """
    t, a = cfg.trainer, cfg.algo
    kept: list[Trajectory] = []
    seen: list[Trajectory] = []
    n_kept = rounds = infra_dropped = 0
    for rnd in range(a.max_sampling_rounds if a.dynamic_sampling else 1):
        need = t.prompts_per_step - n_kept
        picked = (curriculum.take(need) if curriculum else
                  [(cursor + i) % len(rows) for i in range(need)])
        step_rows = [rows[i] for i in picked]
        cursor += need
        seed = t.seed * 1_000_003 + step + 104_729 * rnd
        trajs = workers.generate(step_rows, cfg.rollout.n, seed, hooks)
        if curriculum:
            # one trajectory per episode (its last, when rollout.context split it): n a row
            cm = curriculum.observe(picked, last_parts(trajs), cfg.rollout.n)
        rounds += 1
        regroup(trajs, cfg.rollout.n, {tr.uid for tr in seen}, f"{step}.{rnd}")
        seen += trajs
        usable = without_infra_failures(trajs, cfg.rollout.on_infra_error, cfg.rollout.n)
        infra_dropped += len(trajs) - len(usable)
        trajs = usable
        if not a.dynamic_sampling:
            kept = trajs
            break
        signal = groups_with_signal([tr.reward for tr in trajs], [tr.uid for tr in trajs])
        kept += [tr for tr, s in zip(trajs, signal) if s]
        n_kept = len({tr.uid for tr in kept})
        if n_kept >= t.prompts_per_step:
            break
    if not seen:  # an agent program's episodes fail rather than yield (serving.agents)
        raise ValueError(f"step {step}: none of its {t.prompts_per_step * cfg.rollout.n} "
                         f"episodes produced a trajectory (each failed: the warnings above "
                         f"say why)")
    m = {**rollout_metrics(seen, per_env=is_mixed(cfg)), **infra_metrics(seen, infra_dropped),
         **(cm if curriculum else {}), **getattr(workers, "extra_metrics", dict)()}
    if a.dynamic_sampling:
        groups = len({tr.uid for tr in seen})
        m.update({"rollout/sampling_rounds": float(rounds),
                  "rollout/groups_kept": float(n_kept),
                  "rollout/groups_dropped": float(groups - n_kept)})
        if n_kept < t.prompts_per_step:
            logger.warning("step %d: %d of %d groups had reward variance after %d rounds",
                           step + 1, n_kept, t.prompts_per_step, rounds)
    return kept, cursor, m


def infra_failed(tr: Trajectory) -> bool:
    """A tool failed through no fault of the policy in this episode (after any replay)."""
    return tr.metrics.get("infra_failures", 0.0) > 0


def without_infra_failures(trajs: list[Trajectory], policy: str, n: int) -> list[Trajectory]:
    """What of ``trajs`` may reach an update under ``rollout.on_infra_error``: everything
    with ``keep``; else the episodes not marked as infrastructure failures, less the
    groups that are left with a single member when groups were sampled (``n > 1``): a
    group-relative advantage has no baseline for one sample (GRPO's group std is 0, RLOO's
    leave-one-out mean is undefined), and its prompt is not learned from this step."""
    if policy == "keep":
        return list(trajs)
    ok = [tr for tr in trajs if not infra_failed(tr)]
    if n > 1:
        sizes = collections.Counter(tr.uid for tr in ok)
        ok = [tr for tr in ok if sizes[tr.uid] > 1]
    if len(ok) < len(trajs):
        logger.warning("%d of %d trajectories left out of the update: %d with an "
                       "infrastructure failure (rollout.on_infra_error=%s), the rest from "
                       "groups left with one member", len(trajs) - len(ok), len(trajs),
                       sum(map(infra_failed, trajs)), policy)
    return ok


def infra_metrics(seen: list[Trajectory], dropped: int) -> dict:
    """``rollout/infra_failed`` (episodes that hit an infrastructure failure, replayed or
    not) and ``rollout/infra_dropped`` (``dropped``: episodes left out of the update for
    it). The services' own counters (``infra/*``) are the session's (``end_step``)."""
    hit = sum(1 for tr in seen if infra_failed(tr) or tr.metrics.get("infra_retried", 0.0))
    return {"rollout/infra_failed": float(hit), "rollout/infra_dropped": float(dropped)}


def rollout_metrics(trajs: list[Trajectory], per_env: bool = False) -> dict:
    """``rollout/*``: means over the trajectories, the oldest policy version, and (with
    groups) ``rollout/signal_groups``: the fraction of groups whose rewards are not all
    equal, the only ones a group-relative advantage learns from."""
    m = {f"rollout/{k}": v for k, v in summarize(trajs).items()}
    m["rollout/policy_version"] = float(min(tr.policy_version for tr in trajs))
    uids = [tr.uid for tr in trajs]
    if len(set(uids)) < len(uids):
        m["rollout/signal_groups"] = signal_share([tr.reward for tr in trajs], uids)
    m["rollout/reward_ci95"] = reward_ci95(trajs)
    if per_env:  # a mixed run: the same, env by env (search/rollout/reward, ...)
        for env, part in split_by_env(trajs).items():
            m.update({f"{env}/{k}": v for k, v in rollout_metrics(part).items()
                      if k.startswith("rollout/") and k != "rollout/policy_version"})
    return m


def reward_ci95(trajs: list[Trajectory]) -> float:
    """Half-width of the 95% interval of the step's mean reward over its groups (one
    value per group: its mean; a group's samples are not independent of each other),
    ``1.96 * sd / sqrt(groups)``; 0 for a single group. The reward curve draws it as a
    band, so a step's noise is not read as learning."""
    groups: dict[str, list[float]] = collections.defaultdict(list)
    for tr in trajs:
        groups[tr.uid].append(tr.reward)
    means = [statistics.fmean(r) for r in groups.values()]
    return 1.96 * statistics.stdev(means) / len(means) ** 0.5 if len(means) > 1 else 0.0


def regroup(trajs: list[Trajectory], n: int, taken: set[str], tag: str) -> None:
    """Keep one group per rolled-out row: ``trajs`` come row by row, in row order, each
    row's samples in order (``n`` of them from an env; an agent's episode may yield
    several trajectories, or none); a row whose uid is already ``taken`` (the same prompt
    again: an earlier round, or data that wrapped around within the step) gets a fresh uid
    for its samples."""
    start, block = 0, 0
    while start < len(trajs):
        end = start + 1
        while end < len(trajs) and trajs[end].uid == trajs[start].uid and \
                trajs[end].sample_index >= trajs[end - 1].sample_index:
            end += 1
        uid = trajs[start].uid
        if uid in taken:
            uid = f"{uid}#{tag}.{block}"
            for tr in trajs[start:end]:
                tr.uid = uid
        taken.add(uid)
        start, block = end, block + 1


class SyncSteps:
    """The synchronous path: each :meth:`take` rolls out the step's prompts with the
    current weights (:func:`collect`) and returns them with their metrics."""

    taken_after_cursor: list[int] = []  # prompts are taken in order: nothing after the cursor

    def __init__(self, cfg: Config, workers, rows: list[dict], cursor: int, hooks: Hooks,
                 curriculum=None) -> None:
        self.cfg, self.workers, self.rows, self.cursor = cfg, workers, rows, cursor
        self.hooks, self.curriculum = hooks, curriculum

    def take(self, step: int) -> tuple[list[Trajectory], dict]:
        trajs, self.cursor, m = collect(self.cfg, self.workers, self.rows, self.cursor, step,
                                        self.hooks, self.curriculum)
        return trajs, m

    def update_weights(self, state_dict: dict, version: int) -> None:
        self.workers.update_weights(state_dict, version)

    def close(self) -> None:
        self.workers.close()

    def weights_unchanged(self) -> None:
        """A step ended without new weights: the next one rolls out on the same (nothing
        to do here; :meth:`AsyncSteps.weights_unchanged` opens its schedule)."""
