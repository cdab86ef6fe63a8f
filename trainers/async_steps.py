"""Asynchronous rollouts with bounded staleness (``trainer.mode=async``).

A producer (its own thread and event loop) keeps rolling out prompt groups (``n`` samples
of one row) into a queue while the trainer trains on earlier ones; the trainer takes
``trainer.prompts_per_step`` finished groups per step. Weight updates land while the
producer runs: the engine pauses (the batch in flight finishes), loads the new weights
and resumes; episodes in flight continue on the new weights and record each turn's
policy version (``Trajectory.turn_versions``; ``policy_version`` is the oldest).

Staleness of a sample, at the step that trains policy version ``v``: ``v`` minus the
oldest version that sampled it. It never exceeds ``trainer.max_staleness``:

- **never scheduled**: with the engine at version ``v``, the steps that may still train
  what starts now are ``v … v + max_staleness``; they take ``(max_staleness + 1) *
  prompts_per_step`` groups, less those step ``v`` has taken already. A group starts
  only while the groups in flight and finished-but-untaken are fewer than that. A
  dropped group frees its place, so drops never shrink the window.
- **dropped**: a group that finishes too late (a long tail kept it in flight across more
  updates) is dropped when it is taken, and counted (``async/dropped_groups``).

Group ``g`` plays row ``g`` with the seed and uid synchronous training gives it (step
``g // prompts_per_step``). With ``max_staleness=0`` a step's groups start only on the
weights it trains, so the run reproduces synchronous training sample for sample.

Every group is consumed or dropped exactly once. Groups are taken oldest *finished*
first, so the groups taken are not always a prefix: :attr:`AsyncSteps.cursor` is the
first group not taken and :attr:`AsyncSteps.taken_after_cursor` the ones after it that
were; a checkpoint keeps both, and a resumed run skips those. Groups in flight or
finished but not taken at a kill are rolled out again. :meth:`AsyncSteps.restart` (a
crashed producer) re-schedules the groups that were in flight and keeps the finished
ones.

The producer has its own watch (:mod:`agentgym.supervision.watchdog`): its ``rollout`` stage
moves when a group finishes or while it has none in flight (then it waits on the
trainer, which is watched on its own), so a producer whose groups stop finishing stalls
after ``deadlines.rollout_s`` with its stacks written, and the stall is raised in the
trainer's thread. The trainer's wait for a step's groups (its own ``rollout`` stage)
moves with each group finished.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from agentgym.config import is_mixed
from agentgym.core.types import Trajectory
from agentgym.supervision.watchdog import NO_WATCH, StageStalled
from agentgym.rollout.manager import row_uid
from agentgym.trainers.collection import infra_metrics, regroup, rollout_metrics, without_infra_failures

logger = logging.getLogger(__name__)


class AsyncSteps:
    """Continuous rollouts over ``rows`` from group ``start_group`` on (module docstring).

    Wraps a :class:`~agentgym.trainers.workers.LocalWorkers` or a
    :class:`~agentgym.trainers.ray_cluster.RayWorkers`
    (their ``run_group`` rolls out one group: in this process, or on the rollout worker
    with the fewest groups in flight; their ``generate`` serves evals);
    ``update_weights`` pushes to the engines and opens the schedule.
    """

    def __init__(self, cfg, local, rows: list[dict], start_group: int, version: int,
                 taken: list[int] = (), watch=NO_WATCH) -> None:
        self.cfg, self.local, self.watch = cfg, local, watch
        self._stage = None  # the producer's watched stage
        self.rows = rows
        self.P, self.n = cfg.trainer.prompts_per_step, cfg.rollout.n
        self.max_staleness = cfg.trainer.max_staleness
        self.version = version
        self.next_group = start_group  # next group to schedule
        self.done: dict[int, list[Trajectory]] = {}  # finished, not yet taken
        self.in_flight: set[int] = set()
        self.consumed: list[int] = []  # every group trained on, in order (tests)
        self.dropped: list[int] = []
        self._taken: set[int] = set(taken)  # consumed or dropped (a resume: after the cursor)
        self._cursor = start_group
        self._advance_cursor()
        self._consumed_at_version = 0  # groups the step training self.version has taken
        self.stats = {"dropped_groups": 0, "restarts": 0}
        self._cv = threading.Condition()
        self._stop = False
        self._tasks: dict[int, asyncio.Task] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._start()

    # -- the producer -------------------------------------------------------------------
    def _start(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="async-rollout", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            with self.watch.stage("rollout", self.step_of(self.next_group) + 1,
                                  in_main=True) as self._stage:
                self._loop.run_until_complete(self._produce())
        except BaseException as e:  # noqa: BLE001 - handed to the trainer
            with self._cv:
                self._error = e
                self._cv.notify_all()
        finally:
            self._loop.close()

    def step_of(self, group: int) -> int:
        return group // self.P

    def _may_start(self) -> bool:
        """Whether another group may start now (module docstring: "never scheduled").
        Call with the lock held."""
        window = (self.max_staleness + 1) * self.P - self._consumed_at_version
        return len(self.in_flight) + len(self.done) < window

    async def _produce(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            with self._cv:
                ok = self._stop or self._may_start()
            if not ok:  # wait for a newer policy version, without blocking the loop
                if not self.in_flight:  # waiting on the trainer: not a stall of its own
                    self._moved(trainer_too=False)
                await loop.run_in_executor(None, self._wait_schedulable)
                continue
            if self._stop:
                break
            g = self.next_group
            self.next_group += 1
            with self._cv:
                if g in self.done or g in self._taken or g < self._cursor:
                    # finished before a restart, or taken before a resume
                    continue
                self.in_flight.add(g)
            self._tasks[g] = loop.create_task(self._group(g))
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        # the tasks belong to this loop: a restarted producer (a new loop) must not gather
        # them again (asyncio refuses futures of another loop)
        self._tasks.clear()

    def _wait_schedulable(self) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._stop or self._may_start(), timeout=0.5)

    async def _group(self, g: int) -> None:
        """Roll out group ``g``: row ``g`` with the seed and uid synchronous training
        would give it."""
        step, i = self.step_of(g), g % self.P
        row = self.rows[g % len(self.rows)]
        seed = self.cfg.trainer.seed * 1_000_003 + step
        uid = row_uid(row, i)
        try:
            trajs = await self.local.run_group(row, uid, self.n, seed)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the trainer re-raises it
            if not isinstance(e, StageStalled):  # a stall's file says where it was
                logger.exception("rollout group %d failed", g)
            with self._cv:
                self._error = e
                self._cv.notify_all()
            return
        with self._cv:
            self.in_flight.discard(g)
            self.done[g] = list(trajs)
            self._cv.notify_all()
        self._tasks.pop(g, None)
        self._moved(trainer_too=True)

    def _moved(self, trainer_too: bool) -> None:
        """The producer's watch moves (in its thread): a group finished (the trainer's wait
        for one moves too), or none is in flight. Its step: the oldest group's in flight."""
        if self._stage is not None:
            self._stage.step = self.step_of(min(self.in_flight, default=self.next_group)) + 1
        self.watch.progress("rollout" if trainer_too else None)

    # -- the trainer's side -------------------------------------------------------------
    def staleness(self, trajs: list[Trajectory]) -> int:
        # an agent's group may be empty (every episode failed): it is not stale
        return self.version - min((t.policy_version for t in trajs), default=self.version)

    def take(self, step: int, timeout: float | None = None) -> tuple[list[Trajectory], dict]:
        """The next ``prompts_per_step`` groups for training step ``step`` (blocks until
        they finish; ``timeout`` in seconds, None: as long as the producer runs), in group
        order, and the step's async metrics. Groups staler than the bound are dropped
        (and counted) instead."""
        t0 = time.perf_counter()
        taken: list[tuple[int, list[Trajectory]]] = []
        stale = []
        with self._cv:
            while len(taken) < self.P:
                self._wait_for_a_group(t0, timeout, len(stale))
                g = min(self.done)  # the oldest finished group first
                trajs = self.done.pop(g)
                s = self.staleness(trajs)
                self._mark_taken(g)
                if s > self.max_staleness:
                    self.dropped.append(g)
                    self.stats["dropped_groups"] += 1
                    stale.append(s)
                    self._cv.notify_all()  # its place in the window is free again
                    continue
                taken.append((g, trajs))
                self.consumed.append(g)
                self._consumed_at_version += 1
            queued = len(self.done)
        taken.sort()
        sampled = [t for _, group in taken for t in group]
        regroup(sampled, self.n, set(), f"{step}.0")
        out = without_infra_failures(sampled, self.cfg.rollout.on_infra_error, self.n)
        ages = [self.version - t.policy_version for t in sampled] or [0]
        token_ages = [self.version - v for t in sampled for v in t.token_versions] or [0]
        mixed = sum(len(set(t.token_versions)) > 1 for t in sampled)
        return out, {**rollout_metrics(sampled, per_env=is_mixed(self.cfg)),
                     **getattr(self.local, "extra_metrics", dict)(),
                     **infra_metrics(sampled, len(sampled) - len(out)),
                     "async/staleness_max": float(max(ages)),
                     "async/staleness_mean": sum(ages) / len(ages),
                     # per sampled token (partial rollouts: a trajectory spans versions)
                     "async/token_staleness_mean": sum(token_ages) / len(token_ages),
                     "async/token_staleness_max": float(max(token_ages)),
                     "async/mixed_version_share": mixed / max(len(sampled), 1),
                     "async/dropped_groups": float(len(stale)),
                     "async/queued_groups": float(queued),
                     "async/in_flight_groups": float(len(self.in_flight)),
                     "async/wait_s": time.perf_counter() - t0}

    def _wait_for_a_group(self, t0: float, timeout: float | None, dropped: int) -> None:
        """Block (lock held) until a finished group is there; raise if the producer
        failed or stopped, or after ``timeout`` seconds."""
        while not self.done:
            if self._error is not None:
                self._raise_error()
            if self._stop or self._thread is None or not self._thread.is_alive():
                raise RuntimeError("the rollout producer is not running (closed?)")
            waited = time.perf_counter() - t0
            if timeout is not None and waited >= timeout:
                raise TimeoutError(f"no rollout group fresh enough to train within {timeout} s "
                                   f"({dropped} dropped as too stale, {len(self.in_flight)} "
                                   f"in flight; training is at policy version {self.version})")
            self._cv.wait(timeout=1.0 if timeout is None else min(1.0, timeout - waited))
        if self._error is not None:
            self._raise_error()

    def _raise_error(self) -> None:
        """The producer's failure, here: a stall that ends the run as it is (a stage's
        exit status, agentgym.supervision.stalls), anything else as the producer's."""
        if isinstance(self._error, StageStalled):
            raise self._error
        raise RuntimeError("the rollout producer failed") from self._error

    def _mark_taken(self, g: int) -> None:
        self._taken.add(g)
        self._advance_cursor()

    def _advance_cursor(self) -> None:
        while self._cursor in self._taken:  # keep only the groups after the cursor
            self._taken.discard(self._cursor)
            self._cursor += 1

    @property
    def cursor(self) -> int:
        """The first group not yet taken (consumed or dropped): where a resumed run
        starts scheduling."""
        return self._cursor

    @property
    def taken_after_cursor(self) -> list[int]:
        """Groups after :attr:`cursor` that were taken already (a resume skips them)."""
        with self._cv:
            return sorted(self._taken)

    # -- weights, evals, faults, shutdown -----------------------------------------------
    def update_weights(self, state_dict: dict, version: int) -> None:
        """Push new weights (the engine pauses only while loading them) and let the
        producer schedule the groups this version allows."""
        self.local.update_weights(state_dict, version)
        with self._cv:
            self.version = version
            self._consumed_at_version = 0
            self._cv.notify_all()

    def weights_unchanged(self) -> None:
        """A step ended without new weights (PPO's critic warm-up): the steps the current
        version may train move on by one, as after an update to the same weights."""
        with self._cv:
            self._consumed_at_version = 0
            self._cv.notify_all()

    def generate(self, rows: list[dict], n: int, seed: int, hooks, greedy: bool = False):
        """Evals and other one-off rollouts, next to the producer on the same engine."""
        return self.local.generate(rows, n, seed, hooks, greedy)

    def restart(self) -> None:
        """Stop the producer as if it had crashed (episodes in flight are lost) and start
        a new one: the lost groups are scheduled again, finished ones are kept."""
        self._shutdown()
        with self._cv:
            lost = sorted(self.in_flight)
            self.in_flight.clear()
            self._stop = False
            self._error = None
            if lost:
                self.next_group = min(lost)  # groups after it are re-run unless finished
            self.stats["restarts"] += 1
        self._start()

    def _shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def close(self, engine_too: bool = True) -> None:
        self._shutdown()
        if engine_too:
            self.local.close()
        else:
            self.local.close(engine_too=False)

    @property
    def remote(self) -> bool:
        return getattr(self.local, "remote", False)
