"""Stalled calls by where they hang: one stack file per stall site, and a run that ends
at once when the same site keeps hanging.

An env call past ``deadlines.env_step_s`` (its construction, reset, step with its tools and
reward, close), an agent's program as long without a call to its endpoint, or a
generation past ``deadlines.turn_s`` cuts its episode (:mod:`agentgym.rollout.manager`,
:mod:`agentgym.serving.agents`). Each cut is recorded in the process's
:class:`StallLedger` by its **site**: the innermost frame of the stuck thread outside the
standard library (the user's reward function, a tool's client, the env's own code); a
generation's site is the engine.

  A thread's stack is sampled a few times over 40 ms and the innermost frame every sample
  holds is taken, so a loop that spins through helpers is one site, not one per helper.
* **One file per site** in the run's ``stalls/``: ``stall-site-<file>-<function>-<line>.txt``
  holds the site, how many episodes it cut and each one (when, which call, which stage,
  what became of the call), then the first cut's whole dump (every thread's stack and
  those of the processes the run drives, :func:`agentgym.supervision.watchdog.dump_stacks`'s).
  ``agentgym status RUN_DIR`` lists the sites (:func:`site_summaries`).
* **The same site again and again ends the run**: when one site has cut
  ``deadlines.same_stall_limit`` episodes in a row with no episode finishing between, the
  cut returns :class:`StallsEndRun`, which the caller raises: the run ends at once (exit 3,
  as a stalled stage), naming the function, its file and line, the stage, and what to
  change. So it does when more than ``deadlines.max_abandoned`` calls given up on are
  still inside their threads (:meth:`StallLedger.too_many_stuck`; a thread cannot be
  killed).
* A process with no run directory (a Ray rollout worker, ``agentgym eval``) records into a
  ledger with no folder: the first cut of a site is logged whole, and :meth:`StallLedger.
  take` hands the cuts (with each site's first dump) to whoever merges them into a run's
  ``stalls/`` (:meth:`StallLedger.merge`: the Ray driver's).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from agentgym.supervision.watchdog import (STALLS, StageStalled, active_watch, format_stacks,
                                    run_stall_hooks)

logger = logging.getLogger(__name__)

PREFIX = "stall-site-"
_DUMP = "# ---- the first cut's whole dump ----"
_LISTED = 100  # cuts listed in a site's file; beyond them, a count
_STDLIB = tuple(sorted({os.path.realpath(sysconfig.get_paths()[k]) + os.sep
                        for k in ("stdlib", "platstdlib")}))


def in_stdlib(filename: str) -> bool:
    """Whether ``filename`` (a code object's) is the standard library's: under its folders,
    not in a site-packages below them; frozen modules (``<frozen ...>``) count."""
    if filename.startswith("<"):
        return True
    path = os.path.realpath(filename)
    return path.startswith(_STDLIB) and "site-packages" not in path \
        and "dist-packages" not in path


@dataclass(frozen=True)
class Site:
    """Where a stalled call was: a function (its file and the line it was at when first
    cut); ``first_line`` (where the function starts) with the file and name is its key."""

    function: str
    file: str
    line: int
    first_line: int = 0

    @property
    def key(self) -> tuple[str, str, int]:
        return self.file, self.function, self.first_line

    def __str__(self) -> str:
        return f"{self.function} ({self.file}, line {self.line})" if self.line else \
            f"{self.function} ({self.file})"

    def file_name(self) -> str:
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{Path(self.file).stem}-{self.function}")
        return f"{PREFIX}{stem.strip('_')[:80]}-{self.first_line}.txt"


def code_site(fn) -> Site | None:
    """The site of a function whose call runs out of sight (in a process of its own): where
    it starts (None: it has no Python code)."""
    fn = getattr(fn, "func", fn)  # a functools.partial's
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__call__", None), "__code__",
                                                    None)
    if code is None:
        return None
    return Site(code.co_name, code.co_filename, code.co_firstlineno, code.co_firstlineno)


#: a generation past deadlines.turn_s: the engine did not answer
ENGINE_SITE = Site("generate", "the rollout engine", 0)


def frames_site(frames: list) -> Site | None:
    """The site of a stack given oldest frame first (``task.get_stack()``'s order): its
    innermost frame outside the standard library, else its innermost."""
    if not frames:
        return None
    frame = next((f for f in reversed(frames) if not in_stdlib(f.f_code.co_filename)),
                 frames[-1])
    code = frame.f_code
    return Site(code.co_name, code.co_filename, frame.f_lineno, code.co_firstlineno)


def thread_site(ident: int | None, samples: int = 5, interval_s: float = 0.01) -> Site | None:
    """The site of thread ``ident`` (None: no such thread): its stack sampled ``samples``
    times ``interval_s`` apart, the innermost frame that every sample holds (a blocked
    thread's stack does not move; a spinning one's does below the loop that spins), then
    outward to the first outside the standard library."""
    common: list | None = None
    for k in range(samples):
        frame = sys._current_frames().get(ident) if ident is not None else None
        frames = []
        while frame is not None:
            frames.append(frame)
            frame = frame.f_back
        frames.reverse()  # oldest first
        if common is None:
            common = frames
        else:  # the same calls (frame objects) from the outermost in
            n = next((i for i, (a, b) in enumerate(zip(common, frames)) if a is not b),
                     min(len(common), len(frames)))
            common = common[:n]
        if k + 1 < samples:
            time.sleep(interval_s)
    return frames_site(common or [])


@dataclass
class Cut:
    """One episode a site cut."""

    site: Site
    episode: str
    call: str  # env.step, env.reset, env.make, env.close, agent, generate
    deadline: str  # "deadlines.env_step_s=600"
    outcome: str = "left running"  # or "its processes killed"
    stage: str = ""  # "eval of step 0 (cold start)"
    when: float = field(default_factory=time.time)
    where: str = field(default_factory=lambda: f"pid {os.getpid()} on {socket.gethostname()}")
    dump: str = ""  # the whole dump, on the first cut of its site in its process

    def line(self) -> str:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.when))
        stage = f"; {self.stage}" if self.stage else ""
        return f"#   {stamp}  episode {self.episode}: {self.call} past {self.deadline}" \
               f"{stage}; {self.outcome} ({self.where})"


class StallsEndRun(StageStalled):
    """Episodes' stalls end the run (module docstring): exit 3 like a stalled stage, the
    heartbeat ``stalled``; ``trainer.resume=auto`` continues after the fix."""

    def __init__(self, message: str, site: Site, stacks: Path | None = None,
                 stage: str = "rollout", step: int = 0, role: str = "trainer") -> None:
        RuntimeError.__init__(self, message)
        self.site, self.stacks, self.stage, self.step, self.role = site, stacks, stage, step, role
        self.waited, self.deadline, self.detail = 0.0, 0.0, ""

    def __reduce__(self):  # across processes (a Ray rollout worker's)
        return StallsEndRun, (str(self), self.site, self.stacks, self.stage, self.step,
                              self.role)

    def with_detail(self, detail: str) -> "StallsEndRun":
        return StallsEndRun(f"{self} ({detail})", self.site, self.stacks, self.stage,
                            self.step, self.role)


@dataclass
class _SiteState:
    site: Site
    path: Path | None
    count: int = 0
    in_a_row: int = 0
    lines: list[str] = field(default_factory=list)  # the first _LISTED cuts, listed
    dumped: bool = False  # its file holds the first dump

    @classmethod
    def load(cls, site: Site, path: Path | None) -> "_SiteState":
        """A site's state, continuing its file when one is there (the cold start's, or a
        run's before it was resumed)."""
        st = cls(site, path)
        if path is None or not path.exists():
            return st
        try:
            head = path.read_text().split(_DUMP)[0].splitlines()
            st.count = int(head[1].removeprefix("# episodes cut: "))
        except (OSError, ValueError, IndexError):
            return st
        st.lines = [x for x in head[2:] if x.startswith("#   ") and not x.startswith(
            "#   ... and ")]
        st.dumped = True
        return st


class StallLedger:
    """The cuts of one process, by site (module docstring).

    Args:
        directory: the run's ``stalls/`` (None: no run directory; logged, kept for
            :meth:`take`).
        stage_now: ``() -> (role, stage, step)`` of the stage the run is in (the watch's).
        on_end: called with the :class:`StallsEndRun` a cut returns (the watch marks its
            heartbeat ``stalled``).
    """

    def __init__(self, directory: Path | None = None,
                 stage_now: Callable[[], tuple[str, str, int] | None] | None = None,
                 on_end: Callable[[StallsEndRun], None] | None = None) -> None:
        self.directory = directory
        self._stage_now = stage_now or (lambda: None)
        self._on_end = on_end or (lambda error: None)
        self._sites: dict[tuple, _SiteState] = {}
        self._taken: list[Cut] = []
        self._lock = threading.RLock()

    # -- recording ------------------------------------------------------------------------
    def stage(self) -> str:
        """The stage the run is in, as a cut lists it ("" outside one)."""
        now = self._stage_now()
        if now is None:
            return ""
        role, name, step = now
        return f"{name} of step {step}" + ("" if role == "trainer" else f" ({role})")

    def cut(self, cut: Cut, same_limit: int, reason: str = "") -> StallsEndRun | None:
        """Record ``cut``; its site's first cut gets the whole dump (every thread's stack,
        under ``reason``). Returns the error that ends the run when its site has now cut
        ``same_limit`` episodes in a row (none finishing between), else None."""
        if not cut.stage:
            cut.stage = self.stage()
        with self._lock:
            st = self._state(cut.site)
            if not cut.dump and not st.dumped:
                cut.dump = format_stacks(reason or f"episode {cut.episode}: {cut.call} "
                                                   f"past {cut.deadline}")
            self._add(st, cut, hooks=True)
            if self.directory is None:
                self._taken.append(cut)
            st.in_a_row += 1
            if st.in_a_row < same_limit:
                return None
            error = self._repeated(st, cut, same_limit)
        self._on_end(error)
        return error

    def finished(self) -> None:
        """An episode finished uncut: every site's run of cuts in a row is broken."""
        with self._lock:
            for st in self._sites.values():
                st.in_a_row = 0

    def too_many_stuck(self, stuck: int, limit: int, cut: Cut) -> StallsEndRun | None:
        """The error that ends the run when ``stuck`` calls given up on are still in their
        threads, more than ``limit`` (``deadlines.max_abandoned``); ``cut``: the latest."""
        if stuck <= limit:
            return None
        with self._lock:
            path = self._state(cut.site).path
        error = StallsEndRun(
            f"{self._where()}{stuck} calls given up on are still running in their threads, "
            f"more than deadlines.max_abandoned={limit} (the latest: {cut.site}, "
            f"{cut.call}{'; its stacks: ' + str(path) if path else ''}). A thread cannot be "
            f"killed: fix what hangs, or run it in a process of its own (reward_process=true "
            f"for a reward= function; the code sandbox's cells already are), or raise "
            f"deadlines.max_abandoned; then continue with trainer.resume=auto",
            cut.site, path, *self._stage_of())
        self._on_end(error)
        return error

    def path(self, site: Site) -> Path | None:
        """The file of ``site`` (None: no run directory)."""
        with self._lock:
            return self._state(site).path

    # -- across processes -----------------------------------------------------------------
    def take(self) -> list[Cut]:
        """The cuts since the last take (a ledger with no folder keeps them), each site's
        first with its dump."""
        with self._lock:
            out, self._taken = self._taken, []
        return out

    def merge(self, cuts: list[Cut]) -> None:
        """Another process's cuts (:meth:`take`), into this ledger's files: counted and
        listed (their runs in a row are that process's business)."""
        with self._lock:
            for cut in cuts:
                self._add(self._state(cut.site), cut, hooks=False)

    def adopt(self, error: StallsEndRun, where: str) -> StallsEndRun:
        """Another process's run-ending error (a Ray rollout worker's), said from here:
        this run's stage and its file of the site."""
        path = self.path(error.site)
        said = f" ({where}{'; its stacks: ' + str(path) if path else ''})"
        ours = StallsEndRun(f"{self._where()}{error}{said}", error.site, path,
                            *self._stage_of())
        self._on_end(ours)
        return ours

    # -- the files ------------------------------------------------------------------------
    def _state(self, site: Site) -> _SiteState:
        st = self._sites.get(site.key)
        if st is None:
            path = self.directory / site.file_name() if self.directory is not None else None
            st = self._sites[site.key] = _SiteState.load(site, path)
        return st

    def _add(self, st: _SiteState, cut: Cut, hooks: bool) -> None:
        st.count += 1
        if len(st.lines) < _LISTED:
            st.lines.append(cut.line())
        if st.path is None:
            if not st.dumped:
                logger.error("stall at %s: %s past %s (episode %s)\n%s", st.site, cut.call,
                             cut.deadline, cut.episode, cut.dump)
                st.dumped = True
            else:
                logger.warning("stall at %s again (%d episodes cut): %s past %s (episode %s)",
                               st.site, st.count, cut.call, cut.deadline, cut.episode)
            return
        first = not st.dumped and bool(cut.dump)
        self._write(st, cut.dump if first else None)
        if first:
            st.dumped = True
            if hooks:  # the stacks of the processes the run drives, appended
                run_stall_hooks(st.path)
            logger.error("stall at %s: %s past %s (episode %s); every thread's stack: %s",
                         st.site, cut.call, cut.deadline, cut.episode, st.path)
        else:
            logger.warning("stall at %s again (%d episodes cut): %s", st.site, st.count,
                           st.path)

    def _write(self, st: _SiteState, body: str | None) -> None:
        """Rewrite the header of ``st``'s file; its body (the first dump) is ``body``, or
        kept from the file."""
        path = st.path
        assert path is not None
        if body is None:
            try:
                text = path.read_text()
                body = text[text.index(_DUMP) + len(_DUMP) + 1:]
            except (OSError, ValueError):
                body = ""
        more = st.count - len(st.lines)
        head = [f"# stall site: {st.site}: the innermost frame outside the standard library",
                f"# episodes cut: {st.count}", *st.lines,
                *([f"#   ... and {more} more"] if more > 0 else []), _DUMP, ""]
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text("\n".join(head) + body)
            os.replace(tmp, path)
        except OSError as e:  # a full disk must not turn a stall into a crash
            logger.warning("could not write %s: %s", path, e)

    # -- the end --------------------------------------------------------------------------
    def _stage_of(self) -> tuple[str, int, str]:
        now = self._stage_now()
        return ("rollout", 0, "trainer") if now is None else (now[1], now[2], now[0])

    def _where(self) -> str:
        stage = self.stage()
        return f"the {stage}: " if stage else ""

    def _repeated(self, st: _SiteState, cut: Cut, limit: int) -> StallsEndRun:
        call, deadline = cut.call, cut.deadline
        where = f"; its stacks: {st.path}" if st.path else ""
        if st.site is ENGINE_SITE:
            fix = ("find why the engine stops answering (its stack is in the file), or raise "
                   "deadlines.turn_s if generations are only slow")
        else:
            fix = (f"fix {st.site.function} in {st.site.file}, or raise "
                   f"{deadline.split('=')[0]} if it is only slow, or "
                   f"deadlines.same_stall_limit to let more episodes be cut in a row")
        return StallsEndRun(
            f"{self._where()}{st.site} hung {st.in_a_row} episodes in a row with none finishing "
            f"between ({call} past {deadline} each; deadlines.same_stall_limit={limit})"
            f"{where}. To continue: {fix}; then trainer.resume=auto", st.site, st.path,
            *self._stage_of())


def cut_call(cut: Cut, reason: str, deadlines, give_up: Callable[[], object],
             stuck: Callable[[], int]) -> Path | None:
    """A call past its deadline: ``cut`` recorded in this process's ledger (the stacks read
    before ``give_up()`` kills or leaves the call), then the run ended if its site has cut
    ``deadlines.same_stall_limit`` episodes in a row or ``stuck()`` calls are left in their
    threads in this process, more than ``deadlines.max_abandoned`` (:class:`StallsEndRun`
    raised). Returns
    the site's file (None: no run directory)."""
    led = ledger()
    ended = led.cut(cut, deadlines.same_stall_limit, reason)
    give_up()
    ended = ended or led.too_many_stuck(stuck(), deadlines.max_abandoned, cut)
    if ended is not None:
        raise ended
    return led.path(cut.site)


def site_summaries(directory: Path) -> list[tuple[str, int, Path]]:
    """``(site, episodes cut, file)`` of each site's file in a run's ``stalls/``, the most
    cuts first (what ``agentgym status`` shows)."""
    out = []
    for path in directory.glob(f"{PREFIX}*.txt"):
        try:
            with open(path) as f:
                head = [f.readline() for _ in range(2)]
            site = head[0].removeprefix("# stall site: ").split(": the innermost")[0]
            count = int(head[1].removeprefix("# episodes cut: "))
        except (OSError, ValueError):
            continue
        out.append((site.strip(), count, path))
    return sorted(out, key=lambda s: (-s[1], s[0]))


_NO_DIR = StallLedger()
_MADE = threading.Lock()


def ledger() -> StallLedger:
    """The ledger of the run this process is in (its watch's, in its ``stalls/``), else the
    process's own, with no folder."""
    watch = active_watch()
    if watch is None:
        return _NO_DIR
    with _MADE:
        if watch.stall_ledger is None:
            watch.stall_ledger = StallLedger(watch.run_dir / STALLS, watch.stage_now,
                                             watch.end_by)
        return watch.stall_ledger
