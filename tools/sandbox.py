"""Run untrusted, model-written Python: fast, in parallel, and away from the host.

    sandbox = make_sandbox(cfg.sandbox)            # LocalSandbox (bubblewrap) or E2BSandbox
    r = sandbox.run_sync("import math\\nmath.factorial(20)")
    r.stdout, r.exit_code, r.timed_out            # ('2432902008176640000\\n', 0, False)
    sandbox.run_sync("x = 41", session="ep-7"); sandbox.run_sync("x + 1", session="ep-7")
    sandbox.close_session("ep-7"); sandbox.close()

What :class:`LocalSandbox` protects against (each is a test in ``tests/test_sandbox.py``):

* **The network.** Each execution has its own network namespace (only its own loopback):
  no connection to the host's services on 127.0.0.1 (retriever, Ray, vLLM), no DNS.
* **The host's files.** With bubblewrap the code sees a fresh root with read-only /usr,
  the interpreter's installation and its venv, a private tmpfs scratch dir (``/tmp``, the
  cwd and $HOME) and nothing else: not the project folder, /home, /root, /etc.
* **Privilege.** Code runs as an unprivileged uid with no capabilities and
  ``no_new_privs`` (setuid binaries in /usr do not elevate).
* **Other episodes and processes.** Each execution or session has its own PID, IPC, UTS and
  mount namespaces and its own uid (so one episode's fork bomb cannot use up another's
  process quota); it cannot see or signal the host's processes or another sandbox's.
* **Resource exhaustion.** rlimits on CPU time, address space, file size, processes and
  core dumps; a wall-clock timeout; a byte cap on stdout/stderr; the whole process tree
  (daemonized children included) dies with the execution.
* **Secrets in the environment.** The code gets a fixed minimal environment; nothing is
  inherited from the trainer's.

What it does not protect against:

* Kernel exploits and container escapes (shared kernel; no seccomp filter, no VM), and
  CPU side channels (Spectre-class) — use :class:`E2BSandbox` (a microVM per sandbox)
  where that matters.
* Reading the interpreter's installation and venv (read-only): keep no secrets there.
* Memory across processes: RLIMIT_AS is per process, so one execution may hold up to
  ``max_procs x memory_mb`` plus its scratch tmpfs (``memory_mb``); a hard per-execution
  total needs cgroups, which this machine does not offer (cgroup v1, shared).
* CPU time across processes: RLIMIT_CPU is per process, so forked children each get
  ``cpu_s``; the wall-clock timeout still bounds the whole execution.
* The ``unshare`` fallback (no bubblewrap): the host filesystem stays visible (the
  project folder included) and world-writable paths other than /tmp, /var/tmp, /dev/shm
  and /run/lock stay writable; the network and processes are isolated as with bwrap.

Sessions (``run(code, session=ID)``; ``session=None``, the default, is stateless): one
persistent interpreter per id, each in its own sandbox and uid, until ``close_session(ID)``
or ``close()``. Later cells see earlier variables (and files in the session's /tmp);
processes a cell leaves in the background live as long as the session; RLIMIT_CPU counts
over the session's whole life. A cell is stopped at ``wall_s`` by an alarm inside the
interpreter (its output so far is kept) or, if the alarm cannot interrupt it, killed by the
host ``SESSION_GRACE_S`` later (output lost). A timeout, a MemoryError, the CPU limit or the
interpreter exiting ends the session: that result has ``session_reset=True`` and the next
cell with the id starts in a fresh interpreter. A session cell's output goes to a capture
file, so a flood stops at ``file_size_mb`` (the code gets ``OSError: File too large``)
rather than at ``max_output_bytes``.

The sandbox has no writable /dev/shm (``multiprocessing`` locks fail) and no /etc.

The local backend needs root: it launches bubblewrap without a user namespace and drops
each execution to its own uid. (A user namespace made by root maps the sandbox uid to
root outside, and the kernel then ignores RLIMIT_NPROC; fork bombs would not stop.)

Result semantics (:class:`ExecResult`): ``exit_code`` is the interpreter's status (0, 1
for an uncaught exception, n for ``sys.exit(n)``), ``-N`` if the code died of signal N
(``-24``: CPU limit, SIGXCPU), and None if the sandbox stopped it (wall timeout, output
cap) or never started it (``error``). ``memory_exceeded`` means the code failed with an
uncaught ``MemoryError`` (RLIMIT_AS refused an allocation; numpy's ``_ArrayMemoryError``
counts); a SIGKILL from the kernel's OOM killer shows only as ``exit_code == -9``, as it
cannot be told from the CPU hard limit or the code killing itself. ``truncated`` means
stdout or stderr had more than ``max_output_bytes`` bytes: the local stateless runner then
stops the code at once and keeps the first ``max_output_bytes`` of each stream. As in a
notebook, a trailing expression statement prints its ``repr`` (when not None), in every
mode and backend.
"""

from __future__ import annotations

import abc
import asyncio
import codecs
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
from dataclasses import dataclass

logger = logging.getLogger(__name__)

__all__ = ["Limits", "ExecResult", "Sandbox", "LocalSandbox", "E2BSandbox", "make_sandbox"]


@dataclass(frozen=True)
class Limits:
    """Per-execution limits (fields and defaults mirror ``agentgym.config.SandboxConfig``).

    Attributes:
        cpu_s: CPU seconds per process (RLIMIT_CPU; a session's worker: over its lifetime).
        wall_s: wall-clock seconds per execution or session cell.
        memory_mb: address space per process, MiB (RLIMIT_AS); also the scratch tmpfs size.
        file_size_mb: largest file the code may write, MiB (RLIMIT_FSIZE).
        max_procs: processes and threads of the execution's uid (RLIMIT_NPROC).
        max_output_bytes: bytes kept of stdout and of stderr, each.
    """

    cpu_s: float = 5.0
    wall_s: float = 10.0
    memory_mb: int = 1024
    file_size_mb: int = 16
    max_procs: int = 32
    max_output_bytes: int = 65536

    def __post_init__(self) -> None:
        bad = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if not getattr(self, f.name) > 0}
        if bad:
            raise ValueError(f"sandbox limits must be > 0, got {bad}")

    @classmethod
    def from_config(cls, cfg) -> "Limits":
        """From an ``agentgym.config.SandboxConfig`` (same field names)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})


@dataclass
class ExecResult:
    """What one execution produced. See the module docstring for the exact semantics.

    Attributes:
        stdout, stderr: decoded UTF-8 (invalid bytes replaced), each at most
            ``max_output_bytes`` bytes of the stream.
        exit_code: 0 / 1 / ``sys.exit`` value; ``-N`` for death by signal N; None when the
            sandbox stopped the code (timeout, output cap) or could not run it.
        timed_out: stopped at ``wall_s``.
        memory_exceeded: failed with an uncaught ``MemoryError`` (RLIMIT_AS).
        truncated: stdout or stderr exceeded ``max_output_bytes``.
        duration_s: wall seconds of the execution, sandbox start-up included.
        backend: ``"bwrap"``, ``"unshare"`` or ``"e2b"``.
        error: the sandbox itself failed (could not start, protocol broken), not the code.
        session_reset: this cell ended its session (timeout, memory or CPU limit, the
            worker exited or broke the protocol); the next cell with the same id starts a
            fresh interpreter with no variables.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    memory_exceeded: bool
    truncated: bool
    duration_s: float
    backend: str
    error: str = ""
    session_reset: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def ok(self) -> bool:
        """The code ran to completion with status 0."""
        return self.exit_code == 0 and not self.timed_out and not self.error

    @classmethod
    def failure(cls, error: str, backend: str, duration_s: float = 0.0,
                session_reset: bool = False) -> "ExecResult":
        """A result for an execution the sandbox could not carry out."""
        return cls("", "", None, False, False, False, duration_s, backend, error, session_reset)


def cap_bytes(data: bytes, cap: int, more: bool = False) -> tuple[str, bool]:
    """Decode at most ``cap`` bytes of ``data``; ``(text, truncated)``.

    A multi-byte character cut by the cap is dropped rather than replaced.
    """
    truncated = more or len(data) > cap
    text = codecs.getincrementaldecoder("utf-8")("replace").decode(data[:cap],
                                                                    final=not truncated)
    return text, truncated


def cap_text(text: str, cap: int) -> tuple[str, bool]:
    """:func:`cap_bytes` for text that is already decoded (E2B, session replies)."""
    return cap_bytes(text.encode("utf-8", "replace"), cap)


class Sandbox(abc.ABC):
    """Runs code strings in isolation; thread-safe and usable from any event loop.

    All executions run on a private event-loop thread owned by the sandbox, so the async
    :meth:`run` (awaited on any loop) and :meth:`run_sync` (called from any thread,
    including a loop's executor threads) share one bounded pool of ``max_concurrency``
    executions. ``in_flight`` and ``max_in_flight`` gauge that pool.

    Subclasses set ``backend`` and implement :meth:`_execute`, :meth:`_close_session` and
    :meth:`_shutdown`.
    """

    backend: str = ""

    def __init__(self, limits: Limits, max_concurrency: int) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.limits = limits
        self.max_concurrency = max_concurrency
        self.in_flight = 0
        self.max_in_flight = 0
        self._closed = False
        self._close_lock = threading.Lock()
        self._tasks: set[asyncio.Task] = set()
        self._loop = asyncio.new_event_loop()
        self._sem = asyncio.Semaphore(max_concurrency)
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"{type(self).__name__}-loop")
        self._thread.start()

    # ---- public API -------------------------------------------------------------------
    async def run(self, code: str, session: str | None = None) -> ExecResult:
        """Execute ``code``; with ``session``, in that session's persistent interpreter."""
        return await asyncio.wrap_future(self._submit(code, session))

    def run_sync(self, code: str, session: str | None = None) -> ExecResult:
        """Blocking :meth:`run`, safe from any thread except the sandbox's own loop."""
        return self._submit(code, session).result()

    def close_session(self, session: str) -> None:
        """Kill a session's interpreter and forget its state. Idempotent."""
        if not self._closed:
            self._call(self._close_session(session))

    def close(self) -> None:
        """Kill everything still running and stop the loop thread. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if threading.current_thread() is self._thread:
            raise RuntimeError("Sandbox.close() called from the sandbox's own loop thread")
        try:
            self._call(self._shutdown_all(), timeout=30)
        except (concurrent.futures.TimeoutError, RuntimeError):
            logger.exception("sandbox shutdown did not finish cleanly")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- for subclasses ---------------------------------------------------------------
    @abc.abstractmethod
    async def _execute(self, code: str, session: str | None) -> ExecResult:
        """Run one execution (on the loop thread); acquire a slot with :meth:`_slot`."""

    @abc.abstractmethod
    async def _close_session(self, session: str) -> None:
        """Discard one session (idempotent)."""

    @abc.abstractmethod
    async def _shutdown(self) -> None:
        """Release every session and resource (running executions are already cancelled)."""

    @contextlib.asynccontextmanager
    async def _slot(self):
        """One of the ``max_concurrency`` execution slots."""
        async with self._sem:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                yield
            finally:
                self.in_flight -= 1

    # ---- plumbing ---------------------------------------------------------------------
    def _submit(self, code: str, session: str | None) -> concurrent.futures.Future:
        if threading.current_thread() is self._thread:
            raise RuntimeError("blocking on the sandbox from its own loop thread would deadlock")
        with self._close_lock:  # scheduled before close() schedules the shutdown, or refused
            if self._closed:
                raise RuntimeError("sandbox is closed")
            return asyncio.run_coroutine_threadsafe(self._tracked(code, session), self._loop)

    def _call(self, coro, timeout: float | None = None):
        if threading.current_thread() is self._thread:
            raise RuntimeError("blocking on the sandbox from its own loop thread would deadlock")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _tracked(self, code: str, session: str | None) -> ExecResult:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            return await self._execute(code, session)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a sandbox failure becomes a result
            logger.exception("sandbox execution failed")
            return ExecResult.failure(f"{type(e).__name__}: {e}", self.backend)
        finally:
            self._tasks.discard(task)

    async def _shutdown_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._shutdown()


def make_sandbox(cfg) -> Sandbox:
    """The sandbox an ``agentgym.config.SandboxConfig`` describes (``backend`` local | e2b)."""
    limits = Limits.from_config(cfg)
    if cfg.backend == "local":
        from tools.sandbox_local import LocalSandbox
        return LocalSandbox(limits, isolation=cfg.isolation, max_concurrency=cfg.max_concurrency)
    if cfg.backend == "e2b":
        from tools.sandbox_e2b import E2BSandbox
        return E2BSandbox(limits, max_concurrency=cfg.max_concurrency)
    raise ValueError(f"sandbox.backend={cfg.backend!r}; valid: local, e2b")


def __getattr__(name: str):
    # The backends live in their own modules (which import this one); load them on use.
    if name == "LocalSandbox":
        from tools.sandbox_local import LocalSandbox
        return LocalSandbox
    if name == "E2BSandbox":
        from tools.sandbox_e2b import E2BSandbox
        return E2BSandbox
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
