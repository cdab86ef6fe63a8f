"""The sandbox's contract: :class:`Limits`, :class:`ExecResult` and the :class:`Sandbox` base
class with its asyncio plumbing, plus the output caps. The backends (``sandbox_local``,
``sandbox_e2b``) implement it; :mod:`agentgym.tools.sandbox` is the entry point (``make_sandbox``)
and documents the semantics.
"""

from __future__ import annotations

import abc
import asyncio
import codecs
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import logging
import threading
from dataclasses import dataclass

from agentgym.supervision.daemon_pool import current_call

logger = logging.getLogger(__name__)

__all__ = ["Limits", "ExecResult", "Sandbox", "cap_bytes", "cap_text"]

#: the pool call (an env step, :mod:`agentgym.supervision.daemon_pool`) an execution runs for, on
#: the sandbox's loop: its processes are the call's, killed if the call is given up on
OWNER: contextvars.ContextVar = contextvars.ContextVar("sandbox_owner", default=None)


@dataclass(frozen=True)
class Limits:
    """Per-execution limits (fields and defaults mirror ``agentgym.tools.sandbox.SandboxConfig``).

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
        """From an ``agentgym.tools.sandbox.SandboxConfig`` (same field names)."""
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
            return asyncio.run_coroutine_threadsafe(
                self._tracked(code, session, current_call()), self._loop)

    def _call(self, coro, timeout: float | None = None):
        if threading.current_thread() is self._thread:
            raise RuntimeError("blocking on the sandbox from its own loop thread would deadlock")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _tracked(self, code: str, session: str | None, owner=None) -> ExecResult:
        task = asyncio.current_task()
        self._tasks.add(task)
        OWNER.set(owner)  # this task's context: the processes it starts are the call's
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
