"""A thread pool whose stuck calls do not hold it or the process: :class:`DaemonPool`.

``concurrent.futures.ThreadPoolExecutor`` joins its threads at interpreter exit, so one
call that never returns (a hung tool, a reward that waits forever) keeps a finished run
from exiting; and a thread blocked in such a call is a worker the pool has lost. The env
calls of a rollout (:mod:`agentgym.rollout.manager`) and an agent's program
(:mod:`agentgym.serving.agents`) run here instead:

* daemon threads, and a :meth:`DaemonPool.shutdown` that waits for the calls that are
  running except those a caller gave up on;
* a caller that gives up on a call (:meth:`DaemonPool.give_up`: past its deadline, or its
  episode cancelled) retires that call's thread, which exits when the call returns, and
  starts a new one in its place, so the pool keeps its size however many calls hang;
  :attr:`DaemonPool.stuck` counts the retired threads still inside their calls (a thread
  cannot be killed);
* a call that runs its work in processes of its own says so
  (:func:`killable_process_group`, or :meth:`Call.own` from another thread: the code
  sandbox's, a test harness's, a ``reward_process=true`` reward's): giving up on it kills
  those process groups (SIGKILL), so the call returns at once instead of being left
  behind.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import os
import queue
import signal
import threading
import time
import weakref

_local = threading.local()
_POOLS: weakref.WeakSet = weakref.WeakSet()  # every pool of the process (stuck_calls)
#: how long a killed call's thread may take to return before it counts as stuck
KILLED_RETURN_S = 10.0


class Call:
    """One call running on a pool thread: its thread, its future and the process groups it
    runs its work in (:meth:`own`), which :meth:`kill` ends."""

    def __init__(self, thread: threading.Thread, future: concurrent.futures.Future) -> None:
        self.thread, self.future = thread, future
        self._groups: set[int] = set()
        self._lock = threading.Lock()
        self._given_up = False
        self.killed = 0  # process groups killed when the call was given up on
        self.killed_at = 0.0  # time.monotonic() of the last kill
        self.started = time.monotonic()
        #: the function the call waits on in a process of its own (call_in_process): its
        #: thread's stack shows only the wait, so this names where the call is
        self.delegate = None

    def own(self, pgid: int) -> None:
        """The call's work runs in process group ``pgid`` (a process started with
        ``start_new_session=True``: its pid) until :meth:`disown`. A group owned after the
        call was given up on is killed at once."""
        with self._lock:
            self._groups.add(pgid)
            late = self._given_up
        if late:
            self._kill({pgid})

    def owns(self) -> bool:
        with self._lock:
            return bool(self._groups)

    def disown(self, pgid: int) -> None:
        with self._lock:
            self._groups.discard(pgid)

    def kill(self) -> int:
        """The call is given up on: SIGKILL every process group it owns (and any it owns
        later); how many it owned now."""
        with self._lock:
            self._given_up = True
            groups = set(self._groups)
        self._kill(groups)
        return len(groups)

    def _kill(self, groups: set[int]) -> None:
        for pgid in groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue
            with self._lock:
                self.killed += 1
                self.killed_at = time.monotonic()


def current_call() -> Call | None:
    """The pool call this thread is running (None outside a :class:`DaemonPool` thread)."""
    return getattr(_local, "call", None)


@contextlib.contextmanager
def killable_process_group(pgid: int):
    """Inside a pool call: the block's work runs in process group ``pgid`` (started with
    ``start_new_session=True``), which a caller that gives up on the call kills instead of
    leaving the call behind. Outside a pool call the block just runs."""
    call = current_call()
    if call is None:
        yield
        return
    call.own(pgid)
    try:
        yield
    finally:
        call.disown(pgid)


class DaemonPool(concurrent.futures.Executor):
    """At most ``workers`` daemon threads taking calls from one queue, started as calls
    need them (see the module docstring)."""

    def __init__(self, workers: int, thread_name_prefix: str = "pool") -> None:
        self.max_workers = max(1, workers)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._shutdown = False
        self._prefix = thread_name_prefix
        self._numbers = itertools.count()
        self._running: dict[concurrent.futures.Future, Call] = {}
        self._workers: set[threading.Thread] = set()  # taking calls
        self._retired: dict[threading.Thread, Call] = {}  # given up on, still in their call
        self._queued = self._idle = 0  # calls not taken yet; workers waiting for one
        _POOLS.add(self)

    def _spawn_if_needed(self) -> None:  # with the lock held
        if self._queued > self._idle and len(self._workers) < self.max_workers \
                and not self._shutdown:
            t = threading.Thread(target=self._work, daemon=True,
                                 name=f"{self._prefix}_{next(self._numbers)}")
            self._workers.add(t)
            t.start()

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                self._idle += 1
            item = self._queue.get()
            with self._lock:
                self._idle -= 1
                self._queued -= item is not None
            if item is None:
                return
            fut, fn, args, kwargs = item
            if not fut.set_running_or_notify_cancel():
                continue
            call = Call(me, fut)
            with self._lock:
                self._running[fut] = call
            _local.call = call
            try:
                result, error = fn(*args, **kwargs), None
            except BaseException as e:  # noqa: BLE001 - the caller's to see
                result, error = None, e
            _local.call = None
            with self._lock:
                del self._running[fut]
                retired = self._retired.pop(me, None) is not None
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)
            if retired:  # its place was taken when its call was given up on
                return

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new calls after shutdown")
            fut: concurrent.futures.Future = concurrent.futures.Future()
            self._queue.put((fut, fn, args, kwargs))
            self._queued += 1
            self._spawn_if_needed()
            return fut

    def give_up(self, fut: concurrent.futures.Future) -> str:
        """The caller no longer waits for ``fut``. Not started yet: it never starts.
        Running: its process groups are killed (:meth:`Call.own`) and its thread retired,
        a new thread taking its place (:meth:`shutdown` does not wait for the retired one,
        which exits when its call returns). Returns what became of it: ``"cancelled"``,
        ``"done"`` (it had returned), ``"killed"`` (it owned processes) or ``"abandoned"``
        (it did not: its thread stays in the call until the call returns)."""
        if fut.cancel():
            return "cancelled"
        with self._lock:
            call = self._running.get(fut)
            if call is None:
                return "done"
            if call.thread not in self._retired:
                self._retired[call.thread] = call
                self._workers.discard(call.thread)
                self._spawn_if_needed()
        return "killed" if call.kill() else "abandoned"

    def running(self, fut: concurrent.futures.Future) -> Call | None:
        """The call of ``fut`` while it runs (None: queued, or returned)."""
        with self._lock:
            return self._running.get(fut)

    def owns_processes(self, fut: concurrent.futures.Future) -> bool:
        """Whether ``fut``'s call runs its work in processes it owns (:meth:`Call.own`)."""
        call = self.running(fut)
        return call is not None and call.owns()

    def fate(self, fut: concurrent.futures.Future) -> str:
        """What giving up on ``fut`` will do to it, in words (a stall's file lists it)."""
        return "its processes killed" if self.owns_processes(fut) else \
            "left running, its thread replaced"

    @property
    def stuck(self) -> int:
        """Calls given up on whose threads are still inside them: those that owned no
        process to kill, and those still there :data:`KILLED_RETURN_S` after the kill (a
        killed call's thread returns as its processes die)."""
        now = time.monotonic()
        with self._lock:
            return sum(not c.killed or now - c.killed_at > KILLED_RETURN_S
                       for c in self._retired.values())

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shutdown = True
            workers = list(self._workers)
        if cancel_futures:  # calls still queued are not started
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in workers:
            self._queue.put(None)
        if wait:  # the threads taking calls, not those retired meanwhile (in calls given up on)
            for t in workers:
                while t.is_alive():
                    t.join(0.1)
                    with self._lock:
                        if t in self._retired:
                            break


def stuck_calls() -> int:
    """Calls given up on still inside their threads, in every pool of this process (a
    retired thread keeps its pool alive, so a closed pool's are counted too)."""
    return sum(pool.stuck for pool in list(_POOLS))
