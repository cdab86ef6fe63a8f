"""Local services under watch: restarted when they die, their outages counted.

Whatever AgentGym starts itself (the local retriever; any :class:`ServerProcess` a run
owns) gets a :class:`Supervisor`: a daemon thread that checks every ``interval_s`` that
the process is alive and its health URL answers. When the process died, or the health
check failed ``unhealthy_after`` times in a row, it is restarted on the same port (so
clients keep their URL) with exponential backoff, at most ``max_restarts`` times within
``restart_window_s`` (a service that keeps dying is given up on; one that dies now and
then over a long run is not). Each restart is logged once at WARNING with its reason and counted.
When the budget is spent the supervisor gives up: :func:`raise_if_failed` then raises
:class:`ServiceFailed`, which a training run turns into a checkpoint and a clear stop
instead of steps trained on tool failures.

A service the user started (a URL they passed) is never restarted: its clients report
what they see (:func:`report_down` on a transport failure, :func:`report_up` on the next
answer), and the outage is counted the same way.

The counters, over this process's life: :func:`infra_totals` (``infra/restarts``,
``infra/outage_s``); a training run reports them from its start in every step's metrics.

Import-light (no torch): tools/ and envs/ use it from env worker threads.

Example::

    proc = ServerProcess(cmd, url, name="retriever server")
    proc.start()
    sup = Supervisor(proc)     # watches until sup.stop() (or proc is stopped by us)
    ...
    wait_healthy(60)           # before replaying an episode that hit the outage
    raise_if_failed()          # at a step boundary
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from typing import Protocol

import httpx

logger = logging.getLogger(__name__)


class ServiceFailed(RuntimeError):
    """A local service could not be brought back within its restart budget."""


class Restartable(Protocol):
    """What a :class:`Supervisor` needs of a service (:class:`ServerProcess` has it)."""

    name: str
    url: str
    health_path: str

    @property
    def alive(self) -> bool: ...

    @property
    def stopped(self) -> bool:
        """Stopped on purpose (then it is not restarted)."""

    def start(self) -> str: ...

    def stop(self) -> None: ...


class Outage:
    """Down/up bookkeeping of one service, keyed by its URL: the seconds it was down and
    how often it came back by a restart. Thread-safe."""

    def __init__(self) -> None:
        self.restarts = 0
        self._closed_s = 0.0
        self._down_since: float | None = None
        self._lock = threading.Lock()

    @property
    def down(self) -> bool:
        return self._down_since is not None

    def mark_down(self) -> bool:
        """Note the service is down; True when it was up until now."""
        with self._lock:
            if self._down_since is not None:
                return False
            self._down_since = time.monotonic()
            return True

    def mark_up(self) -> float | None:
        """Note the service answers again; the outage's length in seconds if it was down."""
        with self._lock:
            if self._down_since is None:
                return None
            length = time.monotonic() - self._down_since
            self._closed_s += length
            self._down_since = None
            return length

    @property
    def outage_s(self) -> float:
        """Seconds down so far, an ongoing outage included."""
        with self._lock:
            now = self._closed_s
            if self._down_since is not None:
                now += time.monotonic() - self._down_since
            return now


_outages: dict[str, Outage] = {}
_supervisors: list["Supervisor"] = []
_registry_lock = threading.Lock()


def outage_for(url: str) -> Outage:
    """The :class:`Outage` record of the service at ``url`` (created on first use)."""
    key = url.rstrip("/")
    with _registry_lock:
        if key not in _outages:
            _outages[key] = Outage()
        return _outages[key]


def report_down(url: str, reason: str) -> None:
    """A client could not reach ``url`` (after its own retries). Logged once per outage;
    a supervised service is restarted by its supervisor, a user's is not."""
    out = outage_for(url)
    if out.mark_down() and not _supervised(url):
        logger.warning("%s is down (%s); it was started outside AgentGym, so it is not "
                       "restarted: its outage is counted in infra/outage_s", url, reason)


def report_up(url: str) -> None:
    """A client got an answer from ``url``: closes an outage it reported."""
    key = url.rstrip("/")
    with _registry_lock:
        out = _outages.get(key)
    if out is not None and out.down:
        length = out.mark_up()
        if length is not None and not _supervised(url):
            logger.warning("%s answers again after %.1f s down", url, length)


def _supervised(url: str) -> bool:
    key = url.rstrip("/")
    with _registry_lock:
        return any(s.url == key and not s.stopped for s in _supervisors)


def infra_totals() -> dict[str, float]:
    """``infra/restarts`` and ``infra/outage_s`` summed over every service this process
    watched or reported on, over its life."""
    with _registry_lock:
        outs = list(_outages.values())
    return {"infra/restarts": float(sum(o.restarts for o in outs)),
            "infra/outage_s": round(sum(o.outage_s for o in outs), 3)}


def forget_unsupervised() -> None:
    """Drop the outage records of services no supervisor watches (URLs a user passed): a
    new run counts only what its own clients see. Supervised services keep theirs."""
    with _registry_lock:
        watched = {s.url for s in _supervisors if not s.stopped}
        for key in [k for k in _outages if k not in watched]:
            del _outages[key]


def raise_if_failed() -> None:
    """Raise :class:`ServiceFailed` if a supervised service ran out of restarts."""
    with _registry_lock:
        failed = [s for s in _supervisors if s.failed]
    if failed:
        raise ServiceFailed("; ".join(s.failed for s in failed))


def recovering(url: str) -> bool:
    """True while a supervisor is bringing the service at ``url`` back (down, not given
    up on): a client may wait for it rather than fail."""
    key = url.rstrip("/")
    with _registry_lock:
        return any(s.url == key and not s.stopped and not s.failed and not s.is_healthy()
                   for s in _supervisors)


def wait_healthy(timeout_s: float) -> bool:
    """Block until every supervised service is healthy (True), one has failed for good,
    or ``timeout_s`` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with _registry_lock:
            sups = [s for s in _supervisors if not s.stopped]
        if any(s.failed for s in sups):
            return False
        waiting = next((s for s in sups if not s.is_healthy()), None)
        if waiting is None:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        with waiting.changed:
            waiting.changed.wait(min(left, 0.5))


class Supervisor:
    """Watch ``service`` (already started) and restart it when it dies or stops answering.

    Args:
        service: a started :class:`Restartable` (a :class:`ServerProcess`).
        interval_s: seconds between checks.
        health_timeout_s: timeout of one health request.
        unhealthy_after: consecutive failed health checks (process alive) that count as
            a hung service.
        max_restarts: restarts allowed within any ``restart_window_s``; one more and the
            service is failed.
        restart_window_s: the window of that budget, seconds.
        backoff_s: delay before the first restart attempt, doubled per consecutive
            failed attempt, capped at ``backoff_max_s``.
        on_restart: called after each restart, before the service counts as healthy
            again (e.g. to load the weights it had); an exception counts as a failed
            attempt, :class:`ServiceFailed` gives up at once.

    Attributes:
        healthy: set while the service is known healthy.
        failed: the reason it was given up on ("" while not).
    """

    def __init__(self, service: Restartable, interval_s: float = 0.5,
                 health_timeout_s: float = 2.0, unhealthy_after: int = 3,
                 max_restarts: int = 5, restart_window_s: float = 600.0,
                 backoff_s: float = 0.5,
                 backoff_max_s: float = 30.0, on_restart=None) -> None:
        if interval_s <= 0 or health_timeout_s <= 0 or unhealthy_after < 1 \
                or max_restarts < 0 or backoff_s < 0:
            raise ValueError(f"need interval_s > 0, health_timeout_s > 0, unhealthy_after >= 1, "
                             f"max_restarts >= 0, backoff_s >= 0; got {interval_s}, "
                             f"{health_timeout_s}, {unhealthy_after}, {max_restarts}, "
                             f"{backoff_s}")
        self.service = service
        self.url = service.url.rstrip("/")
        self.interval_s, self.health_timeout_s = interval_s, health_timeout_s
        self.unhealthy_after, self.max_restarts = unhealthy_after, max_restarts
        self.restart_window_s = restart_window_s
        self._restarted_at: list[float] = []  # monotonic times of this service's restarts
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.on_restart = on_restart
        self.outage = outage_for(self.url)
        self.healthy = threading.Event()
        self.healthy.set()
        self.changed = threading.Condition()
        self.failed = ""
        self.stopped = False
        self._stop = threading.Event()
        with _registry_lock:
            _supervisors.append(self)
        self._thread = threading.Thread(target=self._watch, name=f"supervise-{service.name}",
                                        daemon=True)
        self._thread.start()
        self._stop_before_service_at_exit()

    def _stop_before_service_at_exit(self) -> None:
        # atexit runs last-registered first: after the service's own stop() is registered
        # (each start() registers it anew), so no restart can race the exit
        atexit.unregister(self.stop)
        atexit.register(self.stop)

    def stop(self) -> None:
        """Stop watching (the service itself is left as it is). Idempotent; call it before
        stopping the service on purpose."""
        self.stopped = True
        self._stop.set()
        atexit.unregister(self.stop)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        with _registry_lock:
            if self in _supervisors:
                _supervisors.remove(self)

    def is_healthy(self) -> bool:
        """Known healthy: its last check passed and no client has seen it down since."""
        return self.healthy.is_set() and not self.outage.down

    def _check(self, http: httpx.Client) -> str:
        """"" when healthy, else why not."""
        if self.service.stopped:
            return ""  # its owner stopped it (e.g. at exit): _watch ends
        if not self.service.alive:
            return "its process exited"
        try:
            r = http.get(self.url + self.service.health_path)
        except httpx.HTTPError as e:
            return f"health check failed ({type(e).__name__}: {e})"
        return "" if r.status_code == 200 else f"health check answered HTTP {r.status_code}"

    def _set(self, healthy: bool) -> None:
        (self.healthy.set if healthy else self.healthy.clear)()
        with self.changed:
            self.changed.notify_all()

    def _watch(self) -> None:
        misses = 0
        with httpx.Client(timeout=self.health_timeout_s) as http:
            while not self._stop.wait(self.interval_s):
                if self.service.stopped:
                    self.stopped = True  # stopped by its owner, not dead: nothing to watch
                    with _registry_lock:
                        if self in _supervisors:
                            _supervisors.remove(self)
                    return
                reason = self._check(http)
                if not reason:
                    misses = 0
                    if self.outage.down and self.outage.mark_up() is not None:
                        self._set(True)  # a client saw it down; it answers now
                    continue
                if self._stop.is_set():
                    return  # stopped on purpose while we looked
                misses += 1
                if self.service.alive and misses < self.unhealthy_after:
                    continue
                self.outage.mark_down()
                self._set(False)
                if not self._restart(reason):
                    return
                misses = 0

    def _restart(self, reason: str) -> bool:
        """Bring the service back; False when the budget is spent (the service is failed)."""
        attempt = 0
        while not self._stop.is_set():
            now = time.monotonic()
            recent = [t for t in self._restarted_at if now - t < self.restart_window_s]
            if len(recent) >= self.max_restarts:
                self.failed = (f"{self.service.name} at {self.url} is down ({reason}) and its "
                               f"restart budget is spent ({self.max_restarts} restarts "
                               f"within {self.restart_window_s:.0f} s); see "
                               f"its log {getattr(self.service, 'log_path', None)}")
                logger.error("%s", self.failed)
                self._set(False)
                return False
            delay = min(self.backoff_s * 2 ** attempt, self.backoff_max_s)
            logger.warning("%s at %s: %s; restarting it in %.1f s (restart %d of at most %d "
                           "within the window)",
                           self.service.name, self.url, reason, delay,
                           len(recent) + 1, self.max_restarts)
            if self._stop.wait(delay) or self.service.stopped:
                return False  # stopped on purpose meanwhile
            self.outage.restarts += 1
            self._restarted_at.append(time.monotonic())
            try:
                self.service.stop()  # reap what is left, remove its old folder
                self.service.start()
                if self.on_restart is not None:
                    self.on_restart()
            except ServiceFailed as e:
                self.failed = f"{self.service.name} at {self.url} restarted, but {e}"
                logger.error("%s", self.failed)
                self._set(False)
                return False
            except Exception as e:  # noqa: BLE001 - a failed start is one more attempt
                reason = f"restart failed: {type(e).__name__}: {e}"
                attempt += 1
                continue
            self._stop_before_service_at_exit()
            length = self.outage.mark_up()
            logger.info("%s back at %s after %.1f s down", self.service.name, self.url,
                        length or 0.0)
            self._set(True)
            return True
        return False
