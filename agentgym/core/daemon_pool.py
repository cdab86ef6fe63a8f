"""A thread pool whose threads do not hold the process: :class:`DaemonPool`.

``concurrent.futures.ThreadPoolExecutor`` joins its threads at interpreter exit, so one
call that never returns (a hung tool, a reward that waits forever) keeps a finished run
from exiting. The env calls of a rollout (:mod:`agentgym.rollout.manager`) run here
instead: daemon threads, and a :meth:`DaemonPool.shutdown` that waits for the calls that
are running except those a caller gave up on (:meth:`DaemonPool.abandon`)."""

from __future__ import annotations

import concurrent.futures
import queue
import threading


class DaemonPool(concurrent.futures.Executor):
    def __init__(self, workers: int, thread_name_prefix: str = "pool") -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._abandoned: set[concurrent.futures.Future] = set()
        self._lock = threading.Lock()
        self._shutdown = False
        self._current: dict[str, concurrent.futures.Future] = {}  # thread name -> its call
        self._threads = [threading.Thread(target=self._work, daemon=True,
                                          name=f"{thread_name_prefix}_{i}")
                         for i in range(max(1, workers))]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            fut, fn, args, kwargs = item
            if not fut.set_running_or_notify_cancel():
                continue
            me = threading.current_thread().name
            self._current[me] = fut
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - the caller's to see
                fut.set_exception(e)
            finally:
                self._current.pop(me, None)

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new calls after shutdown")
            fut: concurrent.futures.Future = concurrent.futures.Future()
            self._queue.put((fut, fn, args, kwargs))
            return fut

    def abandon(self, fut: concurrent.futures.Future) -> None:
        """The caller no longer waits for ``fut`` (its call is stuck): :meth:`shutdown`
        does not wait for it, and the pool has one thread fewer while it stays stuck."""
        with self._lock:
            self._abandoned.add(fut)

    @property
    def abandoned(self) -> int:
        """Calls given up on that have not returned yet."""
        with self._lock:
            return sum(not f.done() for f in self._abandoned)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shutdown = True
        if cancel_futures:  # calls still queued are not started
            pending = []
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    pending.append(item[0])
            for fut in pending:
                fut.cancel()
        for _ in self._threads:
            self._queue.put(None)
        if wait:  # every thread but those running a call given up on
            with self._lock:
                stuck = {name for name, fut in self._current.items() if fut in self._abandoned}
            for t in self._threads:
                if t.name not in stuck:
                    t.join()
