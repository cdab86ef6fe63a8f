"""Deadlines for the stages of a run, a heartbeat file, and every thread's stack when a
stage stalls.

A run's stages (a step's rollouts, the update, the weight sync, a checkpoint, an eval)
each run under :meth:`Watchdog.stage`, with a deadline from ``deadlines.*``
(:class:`DeadlinesConfig`). The deadline counts from the stage's start or from its last
:meth:`~Watchdog.progress` (an episode finished, a batch trained), so a long stage that
keeps moving (an eval over a big set) is not a stall; one that stops is. A thread (the
watchdog's) checks the stages every second and writes ``heartbeat.json`` in the run
directory (the stage, the step, since when, the process's threads: ``agentgym status``
reads it). A stage past its deadline:

* writes every thread's Python stack to ``stalls/stall-step<N>-<stage>-<time>.txt`` in the
  run directory, then the stacks of the processes the run drives (rank processes, Ray rank
  actors on this host, the servers it started: :func:`collect_stacks`), and names the
  stage, the step, how long it waited and that file in the log;
* then does what the stage's failure should do. A fatal stage (the update, the weight sync,
  a checkpoint, a step's rollouts, an eval) is interrupted: the thread that runs it gets
  :class:`StageStalled` raised (a signal to the main thread; a checkpoint being written is
  then removed, the earlier ones intact), the CLI says it and exits non-zero, and
  ``trainer.resume=auto`` continues from the last checkpoint. If the thread does not
  unwind within ``deadlines.grace_s`` (a call that holds the interpreter), the process
  exits with :data:`EXIT_STALLED` after writing the same message.

The episode-level deadlines (an env's construction, reset, step with its tools and
reward, or close; an agent's program; one generation) are the rollout manager's
(:mod:`agentgym.rollout.manager`, :mod:`agentgym.serving.agents`): a stalled call ends its
episode as an infrastructure failure, kept out of the gradient, its thread replaced, and
is recorded by where it hangs in the watch's :class:`~agentgym.supervision.stalls.StallLedger`
(one stack file per site; the same site hanging ``deadlines.same_stall_limit`` episodes in
a row ends the run at once).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

#: the exit status of a process whose stalled stage would not unwind
EXIT_STALLED = 70
HEARTBEAT = "heartbeat.json"
STALLS = "stalls"


@dataclass
class DeadlinesConfig:
    """``deadlines.*``: how long each stage may go without progress, in seconds. The
    defaults are far above what a healthy stage takes; a user never has to touch them."""

    rollout_s: float = 3600.0  # a step's rollouts with no episode finishing
    eval_s: float = 3600.0  # an eval with no episode finishing
    update_s: float = 3600.0  # the policy (and critic) update of one step
    sync_s: float = 1800.0  # the new weights into the rollout engines
    checkpoint_s: float = 1800.0  # one checkpoint's save
    env_step_s: float = 600.0  # one env construction, reset, step (tools, reward), close
    turn_s: float = 3600.0  # one generation of the policy (the request is then cancelled)
    grace_s: float = 60.0  # a fatal stall's time to unwind before the process exits
    heartbeat_s: float = 5.0  # how often heartbeat.json is rewritten
    # the run ends when one stall site (agentgym.supervision.stalls) cuts this many episodes in a
    # row, none finishing between
    same_stall_limit: int = 3
    max_abandoned: int = 32  # calls given up on still stuck in their threads: more end the run

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                unit = "" if name in ("same_stall_limit", "max_abandoned") else " seconds"
                raise ValueError(f"deadlines.{name} must be > 0{unit}, got {value!r}")


class StageStalled(RuntimeError):
    """A stage ran past its deadline (raised in the thread that ran it). ``detail`` is
    what the stalled code knew of it (:meth:`with_detail`: the ranks that did not
    answer)."""

    def __init__(self, stage: str, step: int, waited: float, deadline: float,
                 stacks: Path | None, detail: str = "", role: str = "trainer") -> None:
        self.stage, self.step, self.waited, self.stacks = stage, step, waited, stacks
        self.deadline, self.detail, self.role = deadline, detail, role
        where = f"; every thread's stack is in {stacks}" if stacks else ""
        said = f" ({detail})" if detail else ""
        of = "" if role == "trainer" else f"{role} "  # the cold start's stages
        super().__init__(f"the {of}{stage} of step {step} made no progress for {waited:.0f}s, past "
                         f"its deadline (deadlines.{stage}_s={deadline:g}){said}{where}. The "
                         f"last complete checkpoint is intact: continue with "
                         f"trainer.resume=auto")

    def with_detail(self, detail: str) -> "StageStalled":
        return StageStalled(self.stage, self.step, self.waited, self.deadline, self.stacks,
                            detail, self.role)


@dataclass
class _Stage:
    name: str
    step: int
    deadline: float
    fatal: bool
    thread: int
    started: float
    progress_at: float
    fired: bool = False
    in_main: bool = False  # its stall is raised in the main thread, not in its own


def _thread_names() -> dict[int, str]:
    return {t.ident: t.name for t in threading.enumerate() if t.ident is not None}


def format_stacks(reason: str) -> str:
    """Every thread's Python stack, innermost call last, under a line saying why."""
    names = _thread_names()
    lines = [f"# {reason}", f"# pid {os.getpid()} on {socket.gethostname()}, "
             f"{time.strftime('%Y-%m-%d %H:%M:%S')}", ""]
    for ident, frame in sys._current_frames().items():
        lines.append(f"Thread {names.get(ident, '?')} ({ident}):")
        lines.extend(line.rstrip("\n") for line in traceback.format_stack(frame))
        lines.append("")
    return "\n".join(lines)


#: where :func:`dump_stacks` writes when no file is given (the active watchdog's run dir)
_STALL_DIR: Path | None = None
#: what else a stall's stack file gets: ``hook(path)`` appends the stacks of processes
#: this one drives (the rank processes of a sharded backend, :func:`add_stall_hook`)
_HOOKS: list = []


#: the watches of this process, the latest last (active_watch)
_WATCHES: list = []


def active_watch() -> "Watchdog | None":
    """The watch of the run this process is in (None: none)."""
    return _WATCHES[-1] if _WATCHES else None


def add_stall_hook(hook) -> None:
    """``hook(path)`` runs after a stall's stacks are written to ``path`` (and appends to
    it); :func:`remove_stall_hook` when what it reports is gone."""
    _HOOKS.append(hook)


def remove_stall_hook(hook) -> None:
    if hook in _HOOKS:
        _HOOKS.remove(hook)


#: set by the process that starts a child (a service, a rank): the file the child writes
#: its threads' stacks into on SIGUSR2 (:func:`stacks_on_signal`, :func:`collect_stacks`)
STACKS_FILE_ENV = "AGENTGYM_STACKS_FILE"


def stacks_on_signal(path: str | Path | None = None) -> bool:
    """In a child process of a run (a service, a rank): on SIGUSR2, write every thread's
    stack to ``path`` (default: the file its parent named in ``AGENTGYM_STACKS_FILE``),
    which the parent sends when one of its stages stalls (:func:`collect_stacks`).
    ``faulthandler``'s dump: it runs even while this process's Python is stuck. Whether
    a file was named (the parent signals only a child whose file exists: SIGUSR2 would
    kill any other)."""
    path = path or os.environ.get(STACKS_FILE_ENV)
    if not path:
        return False
    import faulthandler
    dump = open(path, "a")  # noqa: SIM115 - open for the process's life
    faulthandler.register(signal.SIGUSR2, file=dump, all_threads=True)
    return True


def collect_stacks(out: Path, children: list[tuple[str, int | None, Path, str]]) -> None:
    """Append the stacks of ``children`` (what to call it, its pid, the file it writes its
    stacks into on SIGUSR2: :func:`stacks_on_signal`, a note) to ``out``, each under a
    line ``# NAME (pid PID on HOST): NOTE``: every live one whose file exists is
    signalled, and what it writes within 5 s is copied."""
    def alive(pid: int | None) -> bool:
        return pid is not None and Path(f"/proc/{pid}").exists()

    sizes = {}
    for _, pid, path, _ in children:
        if alive(pid) and path.exists():
            sizes[path] = path.stat().st_size
            os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(p.stat().st_size == n for p, n in sizes.items()):
        time.sleep(0.05)
    time.sleep(0.2)  # the last lines of a dump in progress
    with open(out, "a") as f:
        for name, pid, path, note in children:
            where = f" (pid {pid} on {socket.gethostname()})" if pid is not None else ""
            f.write(f"\n# {name}{where}{': ' + note if note else ''}\n")
            if path not in sizes:
                f.write("not signalled from here\n" if pid is None else "not running\n"
                        if not alive(pid) else f"its stacks were not asked for (no {path})\n")
                continue
            with open(path, "rb") as src:
                src.seek(sizes[path])
                f.write(src.read().decode(errors="replace") or "it wrote no stacks within 5 s\n")


def dump_stacks(reason: str, name: str, directory: Path | None = None) -> Path | None:
    """Write :func:`format_stacks` to ``<directory>/stall-<name>-<time>.txt`` (the active
    watchdog's ``stalls/`` by default) and log where; with no directory, log the stacks."""
    text = format_stacks(reason)
    directory = directory or _STALL_DIR
    if directory is None:
        logger.error("%s\n%s", reason, text)
        return None
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"stall-{name}-{time.strftime('%Y%m%d-%H%M%S')}-{time.monotonic_ns()}.txt"
    path.write_text(text)
    run_stall_hooks(path)
    logger.error("%s; every thread's stack: %s", reason, path)
    return path


def run_stall_hooks(path: Path) -> None:
    """Append to a stall's file ``path`` what the hooks report (:func:`add_stall_hook`)."""
    for hook in list(_HOOKS):
        try:
            hook(path)
        except Exception as e:  # noqa: BLE001 - the report must not fail the stall's handling
            logger.warning("a stall hook failed: %s", e)


class Watchdog:
    """Watches the stages of one process (see the module docstring)."""

    def __init__(self, run_dir: Path, cfg: DeadlinesConfig | None = None,
                 role: str = "trainer", poll_s: float = 1.0) -> None:
        global _STALL_DIR
        self.run_dir, self.cfg, self.role = Path(run_dir), cfg or DeadlinesConfig(), role
        self.poll_s = min(poll_s, self.cfg.heartbeat_s)
        self._stages: list[_Stage] = []
        self._lock = threading.RLock()  # the signal handler takes it in the main thread
        self._beat_lock = threading.Lock()  # one writer of heartbeat.json at a time
        self._stop = threading.Event()
        self._state = "running"
        self._stalled: StageStalled | None = None
        self._main = threading.main_thread().ident
        self._previous_handler = None
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGUSR2, self._interrupt)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _STALL_DIR = self.run_dir / STALLS
        #: the episodes' stalls by site, in this run's stalls/ (agentgym.supervision.stalls.ledger)
        self.stall_ledger = None
        _WATCHES.append(self)
        self._beat()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="watchdog")
        self._thread.start()

    # -- the stages ------------------------------------------------------------------
    @contextlib.contextmanager
    def stage(self, name: str, step: int, fatal: bool = True, in_main: bool = False):
        """Run the body as stage ``name`` of step ``step`` under ``deadlines.<name>_s``.
        ``in_main``: a fatal stall is raised in the main thread (the trainer, which waits
        on this helper thread's work), not in this one."""
        now = time.monotonic()
        st = _Stage(name, step, getattr(self.cfg, f"{name}_s"), fatal, threading.get_ident(),
                    now, now, in_main=in_main)
        with self._lock:
            self._stages.append(st)
        self._beat()
        try:
            yield st
        except StageStalled:
            raise
        except BaseException:
            if st.fired and self._stalled is not None:  # the stall's interrupt, unwound
                raise self._stalled from None
            raise
        finally:
            with self._lock:
                self._stages.remove(st)
            self._beat()

    def progress(self, name: str | None = None) -> None:
        """Stages are moving: their deadlines count from now. Those named ``name``, or
        else this thread's (every stage, when called from a thread that runs none)."""
        now, me = time.monotonic(), threading.get_ident()
        with self._lock:
            if name is not None:
                mine = [s for s in self._stages if s.name == name]
            else:
                mine = [s for s in self._stages if s.thread == me] or self._stages
            for s in mine:
                s.progress_at = now

    def stage_now(self) -> tuple[str, str, int] | None:
        """``(role, stage, step)`` of the stage episodes are played in now: the latest
        rollout or eval, else the latest stage (None: between stages)."""
        with self._lock:
            stages = list(self._stages)
        playing = [s for s in stages if s.name in ("rollout", "eval")] or stages
        return (self.role, playing[-1].name, playing[-1].step) if playing else None

    def end_by(self, error: StageStalled) -> None:
        """Episodes' stalls end the run (agentgym.supervision.stalls): the heartbeat says so."""
        if self._stalled is None:
            self._stalled = error
        self._state = "stalled"
        self._beat()

    # -- the watch -------------------------------------------------------------------
    def _watch(self) -> None:
        last_beat = time.monotonic()
        while not self._stop.wait(self.poll_s):
            now = time.monotonic()
            with self._lock:
                late = [s for s in self._stages if not s.fired and
                        now - s.progress_at > s.deadline]
                for s in late:
                    s.fired = True
            for s in late:
                self._fire(s, now - s.progress_at)
            if now - last_beat >= self.cfg.heartbeat_s or late:
                self._beat()
                last_beat = now

    def _fire(self, st: _Stage, waited: float) -> None:
        reason = (f"{self.role}: the {st.name} of step {st.step} made no progress for "
                  f"{waited:.0f}s (deadlines.{st.name}_s={st.deadline:g})")
        path = dump_stacks(reason, f"step{st.step}-{st.name}")
        if not st.fatal or self._stalled is not None:  # the first fatal stall ends the run
            return
        self._stalled = StageStalled(st.name, st.step, waited, st.deadline, path,
                                     role=self.role)
        self._state = "stalled"
        self._beat()
        if (st.in_main or st.thread == self._main) and self._previous_handler is not None:
            signal.pthread_kill(self._main, signal.SIGUSR2)  # raises StageStalled there
        threading.Thread(target=self._exit_after_grace, args=(st,), daemon=True,
                         name="watchdog-grace").start()

    def _interrupt(self, signum, frame) -> None:
        with self._lock:  # not if the stage ended between the check and the signal
            active = any(s.fired for s in self._stages)
        if self._stalled is not None and active:
            raise self._stalled

    def _exit_after_grace(self, st: _Stage) -> None:
        deadline = time.monotonic() + self.cfg.grace_s
        while time.monotonic() < deadline:
            with self._lock:
                if st not in self._stages:
                    return  # it unwound
            time.sleep(0.2)
        message = f"agentgym: {self._stalled} (it did not unwind within deadlines.grace_s=" \
                  f"{self.cfg.grace_s:g}; exiting)"
        logger.critical(message)
        print(message, file=sys.stderr, flush=True)
        os._exit(EXIT_STALLED)

    # -- the heartbeat ---------------------------------------------------------------
    def _beat(self) -> None:
        # one writer at a time (a stage's thread, the watchdog, close), each writing what
        # holds when it writes: a beat that read "running" must not land after close's
        with self._beat_lock:
            self._write_beat()

    def _write_beat(self) -> None:
        now_mono, now = time.monotonic(), time.time()
        with self._lock:
            stages = list(self._stages)
        names = _thread_names()
        beat = {"pid": os.getpid(), "host": socket.gethostname(), "role": self.role,
                "state": self._state, "time": now,
                "stages": [{"stage": s.name, "step": s.step, "thread": names.get(s.thread, "?"),
                            "since": now - (now_mono - s.started),
                            "progress_at": now - (now_mono - s.progress_at),
                            "deadline_s": s.deadline} for s in stages],
                "threads": sorted(names.values())}
        if self._stalled is not None:
            beat["stall"] = str(self._stalled)
        path = self.run_dir / HEARTBEAT
        tmp = path.with_name(f".{HEARTBEAT}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(beat, indent=1))
            os.replace(tmp, path)
        except OSError as e:  # a full disk must not stop the run here
            logger.warning("could not write %s: %s", path, e)

    def close(self, state: str = "finished") -> None:
        global _STALL_DIR
        if self in _WATCHES:
            _WATCHES.remove(self)
        self._stop.set()
        self._thread.join(timeout=10)
        if self._state == "running":
            self._state = state
        self._beat()
        if self._previous_handler is not None:
            signal.signal(signal.SIGUSR2, self._previous_handler)
        if _STALL_DIR == self.run_dir / STALLS:
            _STALL_DIR = None


def end_state(error: BaseException | None) -> str:
    """The heartbeat's last state for a run that ended with ``error`` (None: it finished)."""
    if error is None:
        return "finished"
    if isinstance(error, StageStalled):
        return "stalled"
    if isinstance(error, (KeyboardInterrupt, SystemExit)):  # Ctrl-C, or SIGTERM
        return "interrupted"  # (exit_cleanly_on_sigterm)
    return "failed"


@contextlib.contextmanager
def closed_with_end_state(close):
    """Runs the block, then ``close(end_state(...))`` with how it ended: "finished", or
    the error's state. That error is raised on even when the close fails too (the close's
    error is logged): a Ctrl-C stays an interrupt, a stall a stall."""
    try:
        yield
    except BaseException as error:
        try:
            close(end_state(error))
        except Exception as failed:
            logger.warning("closing the run after %s failed too: %r", type(error).__name__,
                           failed, exc_info=logger.isEnabledFor(logging.DEBUG))
        raise
    close("finished")


@contextlib.contextmanager
def signals_deferred(signums: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)):
    """Runs the block whole: a Ctrl-C or SIGTERM that arrives meanwhile is handed to its
    handler (``KeyboardInterrupt``, ``SystemExit(143)``, ...) as the block ends. For work a
    signal must not cut in two: one raised inside a C extension's first import becomes an
    ``ImportError`` ("initialization failed"), and a Python module's is left half-imported
    for the next user. Outside the main thread, where handlers do not run, the block just
    runs; a signal whose handler was not set from Python is not deferred."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list = []
    previous = {s: signal.signal(s, lambda signum, frame: arrived.append((signum, frame)))
                for s in signums if signal.getsignal(s) is not None}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if arrived:  # the first to arrive: it ends the run
            signum, frame = arrived[0]
            handler = previous[signum]
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)  # its default action, now


class _NoWatch:
    """Stands in for a :class:`Watchdog` where nothing is watched (no run directory)."""

    @contextlib.contextmanager
    def stage(self, name: str, step: int, fatal: bool = True, in_main: bool = False):
        yield None

    def progress(self, name: str | None = None) -> None:
        pass

    def close(self, state: str = "finished") -> None:
        pass


NO_WATCH = _NoWatch()
