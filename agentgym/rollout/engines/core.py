"""The engine's core, in nano-vllm's shape: requests are added, one thread steps it, and it
says when it is finished. Nothing here locks: :class:`~agentgym.rollout.engines.hf.HFEngine`
(the front) guarantees that exactly one thread touches a core at a time.

Two cores share one interface, so one loop steps either:

* :class:`ContinuousCore`: continuous batching over the KV pool
  (:mod:`~agentgym.rollout.engines.scheduler`): each step admits what waits, as far as
  there is room, runs one prefill pass and one decode step, and returns what finished;
* :class:`~agentgym.rollout.engines.static_batch.StaticCore`: static batches through the
  model's own forward (vision-language models, architectures outside the Llama family,
  ``engine.continuous_batching=false``); each step runs one whole batch.

A step returns the finished requests as ``(request, (reason, stop_reason))`` pairs; the
front delivers them once its own state is settled (a caller whose request was the last
sees the engine idle when it resumes).
"""

from __future__ import annotations

import enum
import logging
from collections import deque

import torch

from agentgym.rollout.engines.hf_request import _Request
from agentgym.rollout.engines.scheduler import Scheduler

logger = logging.getLogger(__name__)

#: what a step hands back: each finished request with its (reason, stop_reason)
Finished = list[tuple[_Request, tuple]]


class State(enum.Enum):
    """The front's state; only the thread that steps the core moves it, except that
    :meth:`~agentgym.rollout.engines.hf.HFEngine.close` moves any state to ``CLOSED``."""

    RUNNING = "running"  # admits what waits and steps
    PAUSING = "pausing"  # admits nothing; what runs finishes
    PREEMPTING = "preempting"  # admits nothing; what runs stops at the next step (partial)
    PAUSED = "paused"  # admits nothing, and nothing runs
    CLOSED = "closed"


class ContinuousCore:
    """Continuous batching: requests join the running batch as rows leave it."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.waiting: deque[_Request] = deque()

    def add_request(self, r: _Request) -> None:
        self.waiting.append(r)

    def running(self) -> bool:
        """Whether requests are being prefilled or decoded."""
        return self.scheduler.busy

    def is_finished(self) -> bool:
        """Nothing waits and nothing runs."""
        return not self.waiting and not self.scheduler.busy

    def wait_s(self, admit: bool, now: float) -> float | None:
        """Seconds until a step has something to do (0: now; None: not until a request
        arrives, or admissions open)."""
        return 0.0 if self.scheduler.busy or (admit and self.waiting) else None

    def step(self, admit: bool = True) -> Finished:
        """Admit what waits (when ``admit``), as far as there is room; run one prefill pass
        and one decode step; return what finished. A failure fails every running request
        (their callers hear of it) and leaves the core idle, never dead."""
        sched = self.scheduler
        try:
            if admit:
                room = sched.room()
                while self.waiting and room > 0:
                    r = self.waiting.popleft()
                    if not r.abandoned:
                        sched.admit(r)
                        room -= 1
            with torch.inference_mode():
                sched.step()
        except BaseException as e:  # noqa: BLE001 - surface every failure to the caller
            logger.exception("generation step failed")
            self._fail_running(e)
        ready, sched.ready = sched.ready, []
        return ready

    def preempt(self) -> Finished:
        """Partial rollouts: every running request back to the head of the queue, in order,
        with its tokens so far; its keys/values are dropped (recomputed under the new
        weights). Returns what the step in flight finished."""
        sched = self.scheduler
        if not sched.busy:
            return []
        try:
            with torch.inference_mode():  # a row it finishes moves another's keys/values
                sched.drain()  # the tokens of the step in flight are kept
        except BaseException as e:  # noqa: BLE001 - as a failed step: the callers hear of it
            logger.exception("stopping the running requests failed")
            self._fail_running(e)
        ready, sched.ready = sched.ready, []
        back = [r for r in sched.running() if not r.closed]
        self.waiting.extendleft(reversed([r for r in back if not r.abandoned]))
        sched.stats["preempted"] += len(back)
        sched.clear()
        return ready

    def abort(self, error: BaseException) -> None:
        """Fail every request, running or waiting, with ``error``."""
        self._fail_running(error)
        while self.waiting:
            self.waiting.popleft().fail(error)

    def update_weights(self, version: int) -> None:
        """(Idle) New weights: tokens sampled from now on carry ``version``; a growable
        pool gives its memory back."""
        self.scheduler.version = version
        self.scheduler.clear()

    def _fail_running(self, error: BaseException) -> None:
        sched = self.scheduler
        for r in sched.running():
            if not r.closed:
                r.fail(error)
        sched.clear()
