"""Asynchronous rollouts with bounded staleness (``trainer.mode=async``).

A producer (its own thread and event loop) keeps rolling out prompt groups (``n`` samples
of one row) into a queue while the trainer trains on earlier ones; the trainer takes
``trainer.prompts_per_step`` finished groups per step. Weight updates land while the
producer runs: the engine pauses (the batch in flight finishes), loads the new weights
and resumes; episodes in flight continue on the new weights and record each turn's
policy version (``Trajectory.turn_versions``; ``policy_version`` is the oldest).

Staleness of a sample, at the step that trains policy version ``v``: ``v`` minus the
oldest version that sampled it. It never exceeds ``trainer.max_staleness``:

- **never scheduled**: group ``g`` belongs to step ``g // prompts_per_step`` (as in
  synchronous training: same rows, same seeds) and starts only once the engine holds
  version ``step - max_staleness`` or newer;
- **dropped**: a group that finishes too late (a long tail kept it in flight across more
  updates) is dropped when it is taken, and counted (``async/dropped_groups``).

With ``max_staleness=0`` a step's groups start only on the weights it trains, so the run
reproduces synchronous training sample for sample. Every group is consumed or dropped
exactly once: :meth:`AsyncRollout.restart` (a crashed producer) re-schedules the groups
that were in flight and keeps the finished ones.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from agentgym.manager import row_uid
from agentgym.types import Trajectory

logger = logging.getLogger(__name__)


class AsyncRollout:
    """Continuous rollouts over ``rows`` from group ``start_group`` on (module docstring).

    Wraps a :class:`~trainers.run.LocalRollout` or a :class:`~trainers.ray_cluster.RayRollout`
    (their ``run_group`` rolls out one group: in this process, or on the rollout worker
    with the fewest groups in flight; their ``generate`` serves evals);
    ``update_weights`` pushes to the engines and opens the schedule.
    """

    def __init__(self, cfg, local, rows: list[dict], start_group: int, version: int) -> None:
        self.cfg, self.local = cfg, local
        self.rows = rows
        self.P, self.n = cfg.trainer.prompts_per_step, cfg.rollout.n
        self.max_staleness = cfg.trainer.max_staleness
        self.version = version
        self.next_group = start_group  # next group to schedule
        self.done: dict[int, list[Trajectory]] = {}  # finished, not yet taken
        self.in_flight: set[int] = set()
        self.start_group = start_group
        self.consumed: list[int] = []  # every group taken, in order (tests)
        self.dropped: list[int] = []
        self._taken: set[int] = set()  # consumed or dropped
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
            self._loop.run_until_complete(self._produce())
        except BaseException as e:  # noqa: BLE001 - handed to the trainer
            with self._cv:
                self._error = e
                self._cv.notify_all()
        finally:
            self._loop.close()

    def step_of(self, group: int) -> int:
        return group // self.P

    def _may_start(self, group: int) -> bool:
        return self.step_of(group) - self.version <= self.max_staleness

    async def _produce(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            with self._cv:
                ok = self._stop or self._may_start(self.next_group)
            if not ok:  # wait for a newer policy version, without blocking the loop
                await loop.run_in_executor(None, self._wait_schedulable)
                continue
            if self._stop:
                break
            g = self.next_group
            self.next_group += 1
            with self._cv:
                if g in self.done or g in self._taken:  # finished before a restart
                    continue
                self.in_flight.add(g)
            self._tasks[g] = loop.create_task(self._group(g))
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def _wait_schedulable(self) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._stop or self._may_start(self.next_group), timeout=0.5)

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

    # -- the trainer's side -------------------------------------------------------------
    def staleness(self, trajs: list[Trajectory]) -> int:
        return self.version - min(t.policy_version for t in trajs)

    def take(self, step: int, timeout: float | None = None) -> tuple[list[Trajectory], dict]:
        """The next ``prompts_per_step`` groups for training step ``step`` (blocks), in
        group order, and the step's async metrics. Groups staler than the bound are
        dropped (and counted) instead."""
        t0 = time.perf_counter()
        taken: list[tuple[int, list[Trajectory]]] = []
        stale = []
        with self._cv:
            while len(taken) < self.P:
                if self._error is not None:
                    raise RuntimeError("the rollout producer failed") from self._error
                if not self.done:
                    if not self._cv.wait(timeout=timeout if timeout is not None else 600):
                        raise TimeoutError(f"no rollout group finished within {timeout} s")
                    continue
                g = min(self.done)  # the oldest finished group first
                trajs = self.done.pop(g)
                s = self.staleness(trajs)
                self._taken.add(g)
                if s > self.max_staleness:
                    self.dropped.append(g)
                    self.stats["dropped_groups"] += 1
                    stale.append(s)
                    continue
                taken.append((g, trajs))
                self.consumed.append(g)
            queued = len(self.done)
        taken.sort()
        out = [t for _, group in taken for t in group]
        from trainers.grpo import regroup
        regroup(out, self.n, set(), f"{step}.0")
        ages = [self.version - t.policy_version for t in out]
        return out, {"async/staleness_max": float(max(ages)),
                     "async/staleness_mean": sum(ages) / len(ages),
                     "async/dropped_groups": float(len(stale)),
                     "async/queued_groups": float(queued),
                     "async/in_flight_groups": float(len(self.in_flight)),
                     "async/wait_s": time.perf_counter() - t0}

    @property
    def cursor(self) -> int:
        """Where a resumed run starts: the first group plus those taken or dropped."""
        return self.start_group + len(self.consumed) + len(self.dropped)

    # -- weights, evals, faults, shutdown -----------------------------------------------
    def update_weights(self, state_dict: dict, version: int) -> None:
        """Push new weights (the engine pauses only while loading them) and let the
        producer schedule the groups this version allows."""
        self.local.update_weights(state_dict, version)
        with self._cv:
            self.version = version
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
