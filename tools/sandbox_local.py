"""The local backend of :mod:`agentgym.tools.sandbox`: bubblewrap (or ``unshare``) plus rlimits.

One execution, as root on the host::

    bwrap --unshare-{ipc,pid,net,uts,cgroup-try} --die-with-parent --new-session
          --ro-bind /usr /usr  (+ /bin /lib /lib64 /sbin symlinks)  --proc /proc --dev /dev
          --perms 1777 --size 64M --tmpfs /dev/shm
          --perms 1777 --size <memory_mb> --tmpfs /tmp  --ro-bind <python prefixes>
          --chdir /tmp
      setpriv --reuid=U --regid=U --clear-groups --inh-caps=-all --bounding-set=-all
              --no-new-privs
        python -I -B -u -c <tools/_sandbox_worker.py> run cpu_s=5.0,...   # code on stdin

``U`` is a uid drawn at random from ``[UID_BASE, UID_BASE + UID_SPAN)`` and held by one
execution or session at a time, so RLIMIT_NPROC (counted per uid) is per sandbox. No user
namespace: one made by root maps the sandbox uid to 0 outside, which exempts it from
RLIMIT_NPROC. The worker lowers its own rlimits before touching user code.

The launcher (bwrap, or ``setpriv --pdeathsig`` + ``unshare``) leads its own process
group with a fixed minimal environment; the sandbox's PID namespace dies with the
launcher's child, so SIGKILL to that group ends every process of the execution, daemons
included. Outputs are read incrementally: a stateless run is stopped as soon as stdout or
stderr passes ``max_output_bytes`` or at ``wall_s``. Sessions keep one worker per id
(framed protocol, see the worker's docstring).

``python -I`` keeps site-packages (numpy, sympy import) while ignoring ``PYTHON*``
variables and the cwd on ``sys.path``; ``-B -u`` replace the environment variables ``-I``
ignores (no .pyc writes, unbuffered output so a killed run keeps what it printed).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path

from agentgym.tools.sandbox_base import OWNER, ExecResult, Limits, Sandbox, cap_bytes, cap_text

logger = logging.getLogger(__name__)

WORKER_SOURCE = (Path(__file__).with_name("_sandbox_worker.py")).read_text()
READY = b"\x00agentgym-sandbox-ready\n"  # must match _sandbox_worker.READY
MAGIC = b"AGSB"
_HEADER = struct.Struct(">4sI")
UID_BASE, UID_SPAN = 1_600_000_000, 1 << 24
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp",
       "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1",
       "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
KILL_GRACE_S = 5.0  # after SIGKILL, how long to wait for the pipes to close
SESSION_GRACE_S = 2.0  # beyond wall_s, before the host kills a cell the worker didn't stop
# unshare fallback: private tmpfs on the world-writable dirs. An interpreter installed under
# one of them (e.g. a checkout in /tmp) is first bind-mounted aside into the private
# /dev/shm and bound back after the tmpfs would have hidden it.
# Arguments: size_mb, interpreter paths..., "--", command...
_UNSHARE_SCRIPT = (
    'size=$1; shift; keep=""; while [ "$1" != "--" ]; do keep="$keep $1"; shift; done; shift; '
    'tmpfs() { mount -t tmpfs -o size="$size"m,mode=1777,nosuid,nodev agentgym "$1"; }; '
    'tmpfs /dev/shm || exit 1; i=0; for k in $keep; do mkdir -p /dev/shm/.keep/$i && '
    'mount --rbind "$k" /dev/shm/.keep/$i || exit 1; i=$((i+1)); done; '
    'for d in /tmp /var/tmp /run/lock; do if [ -d "$d" ]; then tmpfs "$d" || exit 1; fi; done; '
    'i=0; for k in $keep; do if [ ! -e "$k" ]; then mkdir -p "$k" && '
    'mount --rbind /dev/shm/.keep/$i "$k" || exit 1; fi; i=$((i+1)); done; '
    'cd /tmp && exec "$@"')

_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()


def _take_uid() -> int:
    with _uid_lock:
        while True:
            uid = UID_BASE + secrets.randbelow(UID_SPAN)
            if uid not in _uids_in_use:
                _uids_in_use.add(uid)
                return uid


def _give_uid(uid: int) -> None:
    with _uid_lock:
        _uids_in_use.discard(uid)


def _kill_groups(pgids: set[int]) -> None:
    for pgid in list(pgids):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _python_paths(python: str | None) -> tuple[str, list[str]]:
    """The interpreter to run and the directories it needs (read-only binds)."""
    if python is None:
        exe, prefixes = sys.executable, [sys.prefix, sys.base_prefix]
    else:
        try:
            probe = subprocess.run([python, "-I", "-c", "import json, sys; print(json.dumps("
                                    "[sys.executable, sys.prefix, sys.base_prefix]))"],
                                   capture_output=True, text=True, timeout=60)
        except OSError as e:
            raise ValueError(f"python={python!r} cannot be run: {e}") from e
        if probe.returncode != 0:
            raise ValueError(f"python={python!r} does not run: {probe.stderr.strip()[-300:]}")
        exe, *prefixes = json.loads(probe.stdout)
    # both spellings: the venv may be reached through a symlink
    roots = sorted({f(p) for p in prefixes for f in (os.path.realpath, os.path.abspath)})
    if "/" in roots:
        raise ValueError(f"the interpreter {exe} lives at /; binding it would expose the host")
    binds = [r for r in roots if r != "/usr" and not r.startswith("/usr/")
             and not any(r.startswith(o + "/") for o in roots)]
    real = os.path.realpath(exe)
    if not any(real == b or real.startswith(b + "/") for b in binds + ["/usr"]):
        raise ValueError(f"the interpreter {exe} resolves to {real}, outside {binds}")
    return exe, binds


SHM_MB = 64  # the sandbox's own /dev/shm, in MiB


def _bwrap_args(bwrap: str, binds: list[str], scratch_mb: int) -> list[str]:
    args = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session",
            "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64"):
        path = "/" + top
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    args += ["--proc", "/proc", "--dev", "/dev",
             # POSIX semaphores and shared memory (multiprocessing's locks) live here: the
             # host's /dev/shm is root's, so a small one of the sandbox's own
             "--perms", "1777", "--size", str(SHM_MB << 20), "--tmpfs", "/dev/shm",
             # --tmpfs /tmp before any bind under /tmp, or it would hide the bind
             "--perms", "1777", "--size", str(scratch_mb << 20), "--tmpfs", "/tmp"]
    made = {"/", "/tmp", "/usr", "/proc", "/dev"}
    for bind in binds:
        parts = Path(bind).parts
        for i in range(2, len(parts)):  # bwrap would make missing parents 0700
            parent = str(Path(*parts[:i]))
            if parent not in made:
                made.add(parent)
                args += ["--perms", "0755", "--dir", parent]
        args += ["--ro-bind", bind, bind]
    return args + ["--chdir", "/tmp"]


def _exit_code(rc: int, backend: str) -> int:
    # bwrap reports a child killed by signal N as 128 + N; unshare re-raises it (-N).
    if backend == "bwrap" and 128 < rc < 128 + 65:
        return -(rc - 128)
    return rc


def _memory_error(exit_code: int | None, stderr: str) -> bool:
    lines = [line for line in stderr.splitlines() if line.strip()]
    if exit_code != 1 or not lines:
        return False
    name = lines[-1].split(":", 1)[0].strip()
    return name.rsplit(".", 1)[-1].endswith("MemoryError")


@dataclass
class _Capped:
    """The first ``cap`` bytes of a stream; the rest is counted and dropped."""

    cap: int
    data: bytearray = field(default_factory=bytearray)
    more: bool = False


async def _drain(stream: asyncio.StreamReader, buf: _Capped, overflow: asyncio.Event) -> None:
    while chunk := await stream.read(1 << 16):
        room = buf.cap - len(buf.data)
        buf.data += chunk[:max(room, 0)]
        if len(chunk) > room:
            buf.more = True
            overflow.set()


async def _feed(stdin: asyncio.StreamWriter, data: bytes) -> None:
    try:
        stdin.write(data)
        await stdin.drain()
        stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the code exited (or was killed) before reading all of its input


@dataclass
class _Session:
    proc: asyncio.subprocess.Process
    uid: int
    diag: _Capped  # the worker's original stderr: launcher errors, the READY marker
    diag_task: asyncio.Task
    cells: int = 0


class LocalSandbox(Sandbox):
    """Executions on this machine under bubblewrap (``unshare`` fallback) and rlimits.

    Args:
        limits: per-execution limits.
        isolation: ``"bwrap"``, ``"unshare"`` (weaker: the host filesystem stays visible;
            logged), or ``"auto"`` (bwrap if installed, else unshare with a warning).
        max_concurrency: executions running at once (a bounded pool).
        python: interpreter to run the code with; default this one. Its installation and
            venv are bound read-only into the sandbox.
        max_sessions: live session interpreters at most; a new session beyond that is
            refused with an ``error`` result (close finished episodes' sessions).

    Raises:
        ValueError: not root, bwrap requested but missing, or setpriv/unshare missing.
    """

    def __init__(self, limits: Limits = Limits(), isolation: str = "auto",
                 max_concurrency: int = 4, python: str | None = None,
                 max_sessions: int = 256) -> None:
        if isolation not in ("auto", "bwrap", "unshare"):
            raise ValueError(f"isolation={isolation!r}; valid: auto, bwrap, unshare")
        if os.geteuid() != 0:
            raise ValueError("LocalSandbox must run as root (it drops every execution to its "
                             "own unprivileged uid); run as root or use sandbox.backend=e2b")
        self.backend = self._pick_backend(isolation)
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            raise ValueError("setpriv not found; install util-linux (apt-get install util-linux)")
        self._python, binds = _python_paths(python)
        self._drop = [setpriv, "--clear-groups", "--inh-caps=-all", "--bounding-set=-all",
                      "--no-new-privs"]
        if self.backend == "bwrap":
            self._prefix = _bwrap_args(shutil.which("bwrap"), binds, limits.memory_mb)
        else:
            self._prefix = [setpriv, "--pdeathsig=KILL", "--", shutil.which("unshare"),
                            "--net", "--pid", "--mount", "--ipc", "--uts", "--fork",
                            "--kill-child", "--mount-proc", "--propagation", "private", "--",
                            "/bin/sh", "-c", _UNSHARE_SCRIPT, "sh", str(limits.memory_mb),
                            *binds, "--"]
        self._limits_arg = ",".join(f"{k}={v}" for k, v in asdict(limits).items())
        self.max_sessions = max_sessions
        self._sessions: dict[str, _Session] = {}
        self._session_locks: dict[str, asyncio.Lock] = {}
        self._pgids: set[int] = set()
        super().__init__(limits, max_concurrency)
        # Kill what is left if the object is collected or the interpreter exits.
        self._finalizer = weakref.finalize(self, _kill_groups, self._pgids)

    @staticmethod
    def _pick_backend(isolation: str) -> str:
        has_bwrap = shutil.which("bwrap") is not None
        if isolation == "bwrap" and not has_bwrap:
            raise ValueError("isolation='bwrap' but bwrap is not installed; "
                             "apt-get install bubblewrap (or use sandbox.isolation=unshare)")
        if isolation == "bwrap" or (isolation == "auto" and has_bwrap):
            return "bwrap"
        if shutil.which("unshare") is None:
            raise ValueError("neither bwrap nor unshare found; apt-get install bubblewrap")
        why = "bubblewrap not found, falling back to" if isolation == "auto" else "using"
        logger.warning("code sandbox: %s unshare: network, "
                       "PIDs and IPC are isolated but the host FILESYSTEM stays visible "
                       "(the project folder included) and only /tmp, /var/tmp, /dev/shm, "
                       "/run/lock are private; apt-get install bubblewrap", why)
        return "unshare"

    # ---- process handling -------------------------------------------------------------
    def _argv(self, uid: int, mode: str) -> list[str]:
        return [*self._prefix, *self._drop, f"--reuid={uid}", f"--regid={uid}",
                self._python, "-I", "-B", "-u", "-c", WORKER_SOURCE, mode, self._limits_arg]

    async def _spawn(self, uid: int, mode: str) -> asyncio.subprocess.Process:
        pipe = asyncio.subprocess.PIPE
        proc = await asyncio.create_subprocess_exec(
            *self._argv(uid, mode), stdin=pipe, stdout=pipe, stderr=pipe, env=ENV, cwd="/",
            start_new_session=True)
        self._pgids.add(proc.pid)
        if mode == "run" and (owner := OWNER.get()) is not None:
            owner.own(proc.pid)  # an env call given up on kills it (agentgym.supervision.daemon_pool)
        return proc

    async def _reap(self, proc: asyncio.subprocess.Process, *tasks: asyncio.Task) -> None:
        """SIGKILL the launcher's group (the PID namespace dies with it); wait for it.

        An exited launcher is not signalled: its PID namespace is already gone, and its
        group id may since belong to another process.
        """
        if proc.returncode is None:
            _kill_groups({proc.pid})
        if (owner := OWNER.get()) is not None:
            owner.disown(proc.pid)
        try:
            await asyncio.wait_for(asyncio.gather(proc.wait(), *tasks, return_exceptions=True),
                                   KILL_GRACE_S)
        except asyncio.TimeoutError:
            logger.error("sandbox pid %d: pipes still open %.0fs after SIGKILL", proc.pid,
                         KILL_GRACE_S)
            for t in tasks:
                t.cancel()
        self._pgids.discard(proc.pid)

    # ---- stateless --------------------------------------------------------------------
    async def _execute(self, code: str, session: str | None) -> ExecResult:
        if session is not None:
            return await self._run_cell(session, code)
        async with self._slot():
            uid = _take_uid()
            try:
                return await self._run_once(code, uid)
            finally:
                _give_uid(uid)

    async def _run_once(self, code: str, uid: int) -> ExecResult:
        lim, t0 = self.limits, time.perf_counter()
        proc = await self._spawn(uid, "run")
        out, err = _Capped(lim.max_output_bytes), _Capped(lim.max_output_bytes + len(READY))
        overflow = asyncio.Event()
        feeder = asyncio.create_task(_feed(proc.stdin, code.encode("utf-8", "replace")))
        readers = [asyncio.create_task(_drain(proc.stdout, out, overflow)),
                   asyncio.create_task(_drain(proc.stderr, err, overflow))]
        finished = asyncio.ensure_future(asyncio.gather(*readers, proc.wait()))
        stop = asyncio.create_task(overflow.wait())
        stopped_by_us = False
        try:
            done, _ = await asyncio.wait({finished, stop}, timeout=lim.wall_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            stopped_by_us = finished not in done
        finally:
            stop.cancel()
            feeder.cancel()
            await self._reap(proc, *readers)  # also on normal exit: nothing may outlive it
        duration = time.perf_counter() - t0
        timed_out = stopped_by_us and not overflow.is_set()
        started = err.data.startswith(READY)
        if not started:
            text = bytes(err.data).decode("utf-8", "replace").strip()
            return ExecResult.failure(f"sandbox failed to start (launcher status "
                                      f"{proc.returncode}): {text[-2000:]}", self.backend,
                                      duration)
        stdout, t_out = cap_bytes(bytes(out.data), lim.max_output_bytes, out.more)
        stderr, t_err = cap_bytes(bytes(err.data[len(READY):]), lim.max_output_bytes, err.more)
        exit_code = None if stopped_by_us else _exit_code(proc.returncode, self.backend)
        return ExecResult(stdout, stderr, exit_code, timed_out, _memory_error(exit_code, stderr),
                          t_out or t_err, duration, self.backend)

    # ---- sessions ---------------------------------------------------------------------
    async def _run_cell(self, sid: str, code: str) -> ExecResult:
        lock = self._session_locks.setdefault(sid, asyncio.Lock())
        async with lock, self._slot():
            t0 = time.perf_counter()
            sess = self._sessions.get(sid)
            if sess is None:
                if len(self._sessions) >= self.max_sessions:
                    return ExecResult.failure(
                        f"too many live sessions ({len(self._sessions)}, max_sessions="
                        f"{self.max_sessions}); close_session() the finished ones", self.backend)
                sess = await self._spawn_session(sid)
            owner = OWNER.get()  # the env call this cell runs for may kill its worker
            if owner is not None:
                owner.own(sess.proc.pid)
            try:
                reply = await asyncio.wait_for(self._roundtrip(sess, code),
                                               self.limits.wall_s + SESSION_GRACE_S)
                result = self._reply_result(reply, time.perf_counter() - t0)
            except asyncio.TimeoutError:
                result = ExecResult("", "", None, True, False, False,
                                    time.perf_counter() - t0, self.backend, session_reset=True)
            except (asyncio.IncompleteReadError, BrokenPipeError, ConnectionResetError):
                result = await self._worker_gone(sess, time.perf_counter() - t0)
            except (ValueError, TypeError, KeyError, struct.error) as e:
                result = ExecResult.failure(f"session worker broke the protocol ({e}); the cell "
                                            "may have written to the worker's private pipe",
                                            self.backend, time.perf_counter() - t0, True)
            finally:
                if owner is not None:
                    owner.disown(sess.proc.pid)
            if result.session_reset:
                await self._kill_session(sid, sess)
            else:
                sess.cells += 1
            return result

    async def _spawn_session(self, sid: str) -> _Session:
        uid = _take_uid()
        try:
            proc = await self._spawn(uid, "session")
        except BaseException:
            _give_uid(uid)
            raise
        diag = _Capped(4096)
        sess = _Session(proc, uid, diag, asyncio.create_task(
            _drain(proc.stderr, diag, asyncio.Event())))
        self._sessions[sid] = sess
        return sess

    async def _roundtrip(self, sess: _Session, code: str) -> dict:
        body = json.dumps({"code": code}).encode("utf-8", "replace")
        sess.proc.stdin.write(_HEADER.pack(MAGIC, len(body)) + body)
        await sess.proc.stdin.drain()
        magic, n = _HEADER.unpack(await sess.proc.stdout.readexactly(_HEADER.size))
        if magic != MAGIC or n > 12 * self.limits.max_output_bytes + 4096:
            raise ValueError(f"bad frame header {magic!r}, length {n}")
        reply = json.loads(await sess.proc.stdout.readexactly(n))
        if not isinstance(reply, dict):
            raise TypeError(f"reply is a {type(reply).__name__}")
        return reply

    def _reply_result(self, reply: dict, duration: float) -> ExecResult:
        """Re-check a worker's reply: it shares its interpreter with the cell."""
        cap = self.limits.max_output_bytes
        stdout, t_out = cap_text(str(reply["stdout"]), cap)
        stderr, t_err = cap_text(str(reply["stderr"]), cap)
        exit_code = reply["exit_code"]
        if exit_code is not None and not isinstance(exit_code, int):
            raise TypeError(f"exit_code {exit_code!r}")
        timed_out, memory = bool(reply["timed_out"]), bool(reply["memory_error"])
        truncated = t_out or t_err or bool(reply["stdout_truncated"] or reply["stderr_truncated"])
        reset = timed_out or memory or exit_code == -signal.SIGXCPU
        return ExecResult(stdout, stderr, exit_code, timed_out, memory, truncated, duration,
                          self.backend, session_reset=reset)

    async def _worker_gone(self, sess: _Session, duration: float) -> ExecResult:
        """The worker closed its pipe mid-cell: it exited, died, or never started."""
        try:
            rc = await asyncio.wait_for(sess.proc.wait(), KILL_GRACE_S)
        except asyncio.TimeoutError:
            rc = None
        await asyncio.wait([sess.diag_task], timeout=1.0)
        if not sess.diag.data.startswith(READY):
            text = bytes(sess.diag.data).decode("utf-8", "replace").strip()
            return ExecResult.failure(f"sandbox failed to start (launcher status {rc}): "
                                      f"{text[-2000:]}", self.backend, duration, True)
        exit_code = None if rc is None else _exit_code(rc, self.backend)
        return ExecResult("", "", exit_code, False, False, False, duration, self.backend,
                          session_reset=True)

    async def _kill_session(self, sid: str, sess: _Session | None = None) -> None:
        """Kill ``sess`` (default: the live session ``sid``) and forget it if still live."""
        sess = sess or self._sessions.get(sid)
        if sess is None:
            return
        if self._sessions.get(sid) is sess:
            del self._sessions[sid]
        await self._reap(sess.proc, sess.diag_task)
        _give_uid(sess.uid)

    async def _close_session(self, session: str) -> None:
        # Not under the session's lock: a running cell is killed (it reports session_reset).
        await self._kill_session(session)
        lock = self._session_locks.get(session)
        if lock is not None and not lock.locked():
            del self._session_locks[session]

    async def _shutdown(self) -> None:
        for sid in list(self._sessions):
            await self._kill_session(sid)
        _kill_groups(self._pgids)
