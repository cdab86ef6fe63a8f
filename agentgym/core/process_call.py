"""A function called in a process of its own, which a caller that gives up on it can kill:
:func:`call_in_process` (``reward_process=true`` runs a ``reward=`` function this way).

A thread stuck in a call cannot be stopped, so a user's function that may hang (a reward
that loops, a checker that waits on something that never comes) runs in a child
interpreter instead: in a session of its own, given ``sys.path`` and then the function and
its arguments pickled on stdin (a function pickles by reference: the child imports its
module), answering its result or its error, pickled, on a pipe of its own (what the
function prints goes to stderr). Inside a :class:`~agentgym.core.daemon_pool.DaemonPool`
call (an env call of a rollout), the child's process group belongs to the call
(:func:`~agentgym.core.daemon_pool.killable_process_group`): past the call's deadline it
is killed with everything it started, and the call returns at once with
:class:`ProcessCallError`, instead of leaving its thread behind.

Each call starts a fresh interpreter (what it costs is in docs/BENCHMARKS.md, "Hung env
calls"), so this is for calls that are few and may hang, not for hot paths.

    python -m agentgym.core.process_call   # the child's side (reads stdin, fd 3 or stdout)
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

from agentgym.core.daemon_pool import current_call, killable_process_group


class ProcessCallError(RuntimeError):
    """The function raised in its process (the message carries the error), or the process
    ended without an answer (killed, or it exited)."""


def call_in_process(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a child interpreter (see the module docstring); its
    return value. Raises :class:`ProcessCallError`."""
    read, write = os.pipe()
    payload = pickle.dumps(list(sys.path)) + pickle.dumps((fn, args, kwargs))
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentgym.core.process_call", str(write)],
            stdin=subprocess.PIPE, stdout=sys.stderr.fileno() if _has_fd(sys.stderr) else None,
            pass_fds=(write,), start_new_session=True)
    finally:
        os.close(write)
    name = getattr(fn, "__qualname__", repr(fn))
    call = current_call()
    if call is not None:
        call.delegate = fn
    try:
        with os.fdopen(read, "rb") as answers, killable_process_group(proc.pid):
            try:
                proc.stdin.write(payload)
                proc.stdin.close()
            except BrokenPipeError:
                pass
            answer = answers.read()
            status = proc.wait()
    finally:
        if call is not None:
            call.delegate = None
    if not answer:
        how = "was killed (SIGKILL)" if status == -9 else f"exited with status {status}"
        raise ProcessCallError(f"{name} in its own process {how} before answering")
    ok, value = pickle.loads(answer)
    if not ok:
        raise ProcessCallError(f"{name} raised in its own process: {value}")
    return value


def _has_fd(stream) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    return True


def _main(fd: int) -> None:
    paths = pickle.load(sys.stdin.buffer)
    sys.path[:] = paths + [p for p in sys.path if p not in paths]
    out = os.fdopen(fd, "wb")
    try:
        fn, args, kwargs = pickle.load(sys.stdin.buffer)
        answer = (True, fn(*args, **kwargs))
    except BaseException as e:  # noqa: BLE001 - the caller's to see
        answer = (False, f"{type(e).__name__}: {e}")
    try:
        data = pickle.dumps(answer)
    except Exception as e:  # noqa: BLE001 - a result that does not pickle
        data = pickle.dumps((False, f"its result does not pickle: {e}"))
    out.write(data)
    out.close()


if __name__ == "__main__":
    _main(int(sys.argv[1]))
