"""The E2B backend of :mod:`agentgym.tools.sandbox`: each sandbox is a Firecracker microVM in
E2B's cloud.

Needs ``pip install e2b-code-interpreter`` and ``E2B_API_KEY``. Isolation is the VM's: a
separate kernel, so kernel exploits and side channels on this host are out of reach.

* Stateless runs get a fresh E2B sandbox each (created, used once, killed), so episodes
  never share a filesystem or kernel state; that costs a VM start per run (E2B quotes
  ~150 ms, plus the round trip).
* A session gets one E2B sandbox for its lifetime; its Jupyter kernel keeps variables
  across cells. A cell that times out kills the sandbox (``session_reset``), as locally.
* Limits: ``wall_s`` bounds each execution and ``max_output_bytes`` caps stdout/stderr
  exactly as the local backend does; CPU, memory, file-size and process limits are those
  of the E2B template (not set from :class:`~agentgym.tools.sandbox.Limits`).
* As in a notebook, the value of a trailing expression is shown: its text is appended to
  stdout. An exception gives exit code 1 and its traceback (colours stripped) on stderr.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time

from agentgym.tools.sandbox_base import ExecResult, Limits, Sandbox, cap_text

logger = logging.getLogger(__name__)

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def execution_to_result(execution, limits: Limits, duration_s: float) -> ExecResult:
    """Map an ``e2b_code_interpreter.Execution`` to an :class:`ExecResult` (pure).

    Args:
        execution: the ``Execution`` that ``run_code`` returned.
        limits: ``max_output_bytes`` is applied to stdout and stderr.
        duration_s: measured wall time of the call.
    """
    stdout = "".join(execution.logs.stdout)
    main = execution.text  # the trailing expression's value, if any
    if main is not None:
        stdout += main if main.endswith("\n") else main + "\n"
    stderr = "".join(execution.logs.stderr)
    error = execution.error
    if error is not None:
        trace = _ANSI.sub("", error.traceback or f"{error.name}: {error.value}")
        stderr += trace if trace.endswith("\n") else trace + "\n"
    cap = limits.max_output_bytes
    stdout, t_out = cap_text(stdout, cap)
    stderr, t_err = cap_text(stderr, cap)
    memory = error is not None and error.name.rsplit(".", 1)[-1].endswith("MemoryError")
    return ExecResult(stdout, stderr, 1 if error is not None else 0, False, memory,
                      t_out or t_err, duration_s, "e2b")


class E2BSandbox(Sandbox):
    """Executions in E2B cloud sandboxes (see the module docstring for the semantics).

    Args:
        limits: ``wall_s`` and ``max_output_bytes`` are applied; the rest is the template's.
        api_key: E2B API key; default ``$E2B_API_KEY``.
        max_concurrency: executions running at once.
        template: E2B template id; default the code-interpreter template.
        lifetime_s: E2B's own timeout for each sandbox (a backstop if we never kill it).

    Raises:
        ValueError: no API key, or e2b-code-interpreter not installed.
    """

    backend = "e2b"

    def __init__(self, limits: Limits = Limits(), api_key: str | None = None,
                 max_concurrency: int = 4, template: str | None = None,
                 lifetime_s: int = 3600) -> None:
        key = api_key or os.environ.get("E2B_API_KEY")
        if not key:
            raise ValueError("E2BSandbox needs an E2B API key: set E2B_API_KEY (or pass "
                             "api_key=), or use sandbox.backend=local")
        try:
            from e2b_code_interpreter import AsyncSandbox
        except ImportError as e:
            raise ValueError("sandbox.backend=e2b needs `pip install e2b-code-interpreter`, "
                             "or use sandbox.backend=local") from e
        self._cls, self._key = AsyncSandbox, key
        self._template, self._lifetime_s = template, lifetime_s
        self._sessions: dict = {}
        self._session_locks: dict[str, asyncio.Lock] = {}
        super().__init__(limits, max_concurrency)

    async def _create(self):
        return await self._cls.create(template=self._template, timeout=self._lifetime_s,
                                      api_key=self._key)

    async def _execute(self, code: str, session: str | None) -> ExecResult:
        if session is None:
            async with self._slot():
                box = await self._create()
                try:
                    result, _ = await self._run_in(box, code)
                    result.session_reset = False  # no session to reset
                    return result
                finally:
                    await self._kill(box)
        lock = self._session_locks.setdefault(session, asyncio.Lock())
        async with lock, self._slot():
            box = self._sessions.get(session)
            if box is None:
                box = self._sessions[session] = await self._create()
            result, broken = await self._run_in(box, code)
            if broken:
                self._sessions.pop(session, None)
                await self._kill(box)
            return result

    async def _run_in(self, box, code: str) -> tuple[ExecResult, bool]:
        """One ``run_code``; ``(result, the sandbox must be discarded)``."""
        from e2b_code_interpreter import TimeoutException
        t0 = time.perf_counter()
        try:
            execution = await box.run_code(code, timeout=self.limits.wall_s)
        except TimeoutException:
            return ExecResult("", "", None, True, False, False, time.perf_counter() - t0,
                              self.backend, session_reset=True), True
        except Exception as e:  # noqa: BLE001 - network or service failure: not the code's
            logger.warning("E2B run_code failed: %s", e)
            return ExecResult.failure(f"E2B: {type(e).__name__}: {e}", self.backend,
                                      time.perf_counter() - t0, True), True
        return execution_to_result(execution, self.limits, time.perf_counter() - t0), False

    async def _kill(self, box) -> None:
        try:
            await box.kill()
        except Exception as e:  # noqa: BLE001 - E2B's own timeout reclaims it anyway
            logger.warning("could not kill E2B sandbox %s: %s", getattr(box, "sandbox_id", "?"), e)

    async def _close_session(self, session: str) -> None:
        box = self._sessions.pop(session, None)
        if box is not None:
            await self._kill(box)
        lock = self._session_locks.get(session)
        if lock is not None and not lock.locked():
            del self._session_locks[session]

    async def _shutdown(self) -> None:
        for session in list(self._sessions):
            await self._close_session(session)
