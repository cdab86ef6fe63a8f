"""A local HTTP server as a subprocess: start it, wait for its health URL, stop it.

Shared by the local retriever (``tools/local_retriever.py``), ``agentgym serve`` and the
SGLang launcher (``agentgym/rollout/engines/launcher.py``). The server runs in its own process
group; its output goes to a log file whose tail is quoted when it fails to start.
Import-light: no torch.

Nothing outlives the process that started the server. ``stop()`` (also at interpreter
exit) ends the process group and removes the server's temporary folder
(``$TMPDIR/agentgym-NAME-*``, holding its log) unless the caller named a ``log_dir`` to
keep. A server leads its own session, so a Ctrl-C in a terminal does not reach it, and a
SIGTERM to the starting process would skip ``atexit``: the first ``start()`` in the main
thread therefore turns SIGTERM, when nothing else handles it, into ``SystemExit`` (as
SIGINT is turned into ``KeyboardInterrupt``), so ``finally`` blocks and exit handlers run.

When a stage of the starting process's run stalls (:mod:`agentgym.supervision.watchdog`), the
stall's file gets the stacks of each running server that listens for the ask (one that
calls :func:`watch_parent`: the retriever, ``agentgym serve``), by SIGUSR2.

Example::

    proc = ServerProcess([sys.executable, "-m", "agentgym.retriever_server", "--port", "8000", ...],
                         "http://127.0.0.1:8000", name="retriever server")
    proc.start()          # waits for GET /health == 200
    ...
    proc.stop()           # SIGTERM to the group, SIGKILL after a grace period
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from pathlib import Path

import httpx

from agentgym.supervision.watchdog import (STACKS_FILE_ENV, add_stall_hook, collect_stacks,
                                    stacks_on_signal)

logger = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, n: int = 30) -> str:
    """The last ``n`` lines of a log file (or a note that there is none)."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:]) or "(empty log)"


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def exit_cleanly_on_sigterm() -> None:
    """Make SIGTERM raise ``SystemExit(143)`` in the main thread when its handler is still
    the default (which kills the process without running ``finally`` blocks or ``atexit``
    handlers, leaving servers and temporary folders behind). A handler someone else set
    is kept; outside the main thread this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


#: set by :class:`ServerProcess` in its child's environment: the pid that started it, and
#: the temporary folder that holds its log (removed by :meth:`ServerProcess.stop`)
PARENT_PID_ENV, TMP_DIR_ENV = "AGENTGYM_PARENT_PID", "AGENTGYM_SERVER_TMP_DIR"


def watch_parent(poll_s: float = 1.0) -> threading.Thread | None:
    """In a server that :class:`ServerProcess` started: end this process (SIGTERM to itself,
    so the server shuts down as on ``stop()``) and remove its temporary log folder when the
    process that started it is gone, however that one died (a SIGKILL runs no cleanup of
    its own; the server would otherwise run on, orphaned). A daemon thread polling the
    parent pid; None when not started by a :class:`ServerProcess`. Also: this server's
    threads' stacks go to the file its parent named when a stage of the parent's run
    stalls (:func:`agentgym.supervision.watchdog.stacks_on_signal`)."""
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent:
        return None
    stacks_on_signal()
    parent_pid, tmp_dir = int(parent), os.environ.get(TMP_DIR_ENV)

    def run() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        logger.warning("the process that started this server (pid %d) is gone: stopping",
                       parent_pid)
        if tmp_dir:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=run, name="watch-parent", daemon=True)
    thread.start()
    return thread


class ServerProcess:
    """One server subprocess, healthy once ``GET url + health_path`` answers 200.

    Args:
        cmd: the command line.
        url: the base URL it will serve (``http://127.0.0.1:PORT``).
        name: what to call it in logs and errors.
        health_path: polled until it answers 200.
        startup_timeout: seconds to wait for health before giving up.
        env: extra environment variables for the child.
        stop_grace_s: seconds between SIGTERM and SIGKILL when stopping.
        log_dir: where ``server.log`` goes and stays; default: a temporary folder that
            ``stop()`` removes.
    """

    def __init__(self, cmd: list[str], url: str, name: str = "server",
                 health_path: str = "/health", startup_timeout: float = 120.0,
                 env: dict[str, str] | None = None, stop_grace_s: float = 5.0,
                 log_dir: str | Path | None = None) -> None:
        self.cmd, self.url, self.name = list(cmd), url.rstrip("/"), name
        self.health_path = health_path
        self.startup_timeout = startup_timeout
        self.env = env or {}
        self.stop_grace_s = stop_grace_s
        self.log_dir = Path(log_dir) if log_dir is not None else None
        #: the server's combined stdout/stderr (None before ``start``; with the default
        #: temporary folder, gone after ``stop``)
        self.log_path: Path | None = None
        #: beside the log: the server's stacks, when a stall of this process asks for them
        #: (a server that calls :func:`watch_parent` creates it; others are not signalled)
        self.stacks_path: Path | None = None
        self._tmp_dir: Path | None = None  # ours to remove
        self.proc: subprocess.Popen | None = None

    @property
    def alive(self) -> bool:
        """True while the process is running."""
        return self.proc is not None and self.proc.poll() is None

    @property
    def stopped(self) -> bool:
        """True before ``start`` and after ``stop``: not running on purpose (a process that
        died by itself is neither alive nor stopped)."""
        return self.proc is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> str:
        """Start the process (no-op if running) and wait until it is healthy.

        Returns:
            The base URL.

        Raises:
            RuntimeError: the process exited during startup (message holds its log tail).
            TimeoutError: it was not healthy within ``startup_timeout`` seconds.
        """
        if self.alive:
            return self.url
        t0 = time.perf_counter()
        exit_cleanly_on_sigterm()
        atexit.register(self.stop)  # before anything exists that stop() must clean up
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self.log_path = self.log_dir / "server.log"
        else:
            slug = "".join(c if c.isalnum() else "-" for c in self.name)
            self._tmp_dir = Path(tempfile.mkdtemp(prefix=f"agentgym-{slug}-"))
            self.log_path = self._tmp_dir / "server.log"
        self.stacks_path = self.log_path.with_name("stacks.txt")
        self.stacks_path.unlink(missing_ok=True)  # the child creates it when it listens
        with open(self.log_path, "ab") as log:
            watch = {PARENT_PID_ENV: str(os.getpid()),
                     TMP_DIR_ENV: str(self._tmp_dir) if self._tmp_dir else "",
                     STACKS_FILE_ENV: str(self.stacks_path)}
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL,
                                         env={**os.environ, **self.env, **watch},
                                         start_new_session=True)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        logger.info("%s at %s (pid %d) ready in %.1f s; log %s", self.name, self.url,
                    self.proc.pid, time.perf_counter() - t0, self.log_path)
        _RUNNING.add(self)
        return self.url

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        with httpx.Client(timeout=2.0) as http:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.name} exited with code {self.proc.returncode} during startup; "
                        f"last lines of {self.log_path}:\n{log_tail(self.log_path)}")
                try:
                    if http.get(self.url + self.health_path).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{self.name} not healthy after {self.startup_timeout:.0f} s; last "
                        f"lines of {self.log_path}:\n{log_tail(self.log_path)}")
                time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after ``stop_grace_s``; remove the
        temporary folder. Idempotent."""
        proc, self.proc = self.proc, None
        atexit.unregister(self.stop)
        _RUNNING.discard(self)
        try:
            if proc is not None and proc.poll() is None:
                self._signal(proc, signal.SIGTERM)
                try:
                    proc.wait(timeout=self.stop_grace_s)
                except subprocess.TimeoutExpired:
                    logger.warning("%s pid %d ignored SIGTERM; killing it", self.name,
                                   proc.pid)
                    self._signal(proc, signal.SIGKILL)
                    proc.wait()
        finally:
            tmp, self._tmp_dir = self._tmp_dir, None
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL the process group at once (fault injection; no grace)."""
        if self.proc is not None and self.proc.poll() is None:
            self._signal(self.proc, signal.SIGKILL)
            self.proc.wait()

    @staticmethod
    def _signal(proc: subprocess.Popen, sig: int) -> None:
        try:  # the server leads its own process group (start_new_session), so pgid == pid
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    def __enter__(self) -> "ServerProcess":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


#: the servers this process started and has not stopped (a stall reports their stacks)
_RUNNING: "weakref.WeakSet[ServerProcess]" = weakref.WeakSet()


def _servers_stacks(path: Path) -> None:
    """A stall's hook: the stacks of every server this process runs that listens for the
    ask (``stacks.txt`` beside its log), appended to the stall's file."""
    servers = [s for s in list(_RUNNING) if s.alive and s.stacks_path is not None]
    if servers:
        collect_stacks(path, [(f"service {s.name} at {s.url}", s.pid, s.stacks_path, "")
                              for s in servers])


add_stall_hook(_servers_stacks)
