"""A function called in a process of its own, which a caller that gives up on it can kill:
:func:`call_in_process` (``reward_process=true`` runs a ``reward=`` function this way).

A thread stuck in a call cannot be stopped, so a user's function that may hang (a reward
that loops, a checker that waits on something that never comes) runs in a child
interpreter instead. Each thread that calls keeps one child (started at its first call, in
a session of its own), which gets ``sys.path``, the function and its arguments pickled on
its stdin (a function pickles by reference: the child imports its module, once) and
answers its result or its error, pickled, on its stdout (what the function prints goes to
stderr). Inside a :class:`~agentgym.supervision.daemon_pool.DaemonPool` call (an env call of a
rollout), the child's process group belongs to the call while it works
(:func:`~agentgym.supervision.daemon_pool.killable_process_group`): past the call's deadline it is
killed with everything it started, the call returns at once with
:class:`ProcessCallError` instead of leaving its thread behind, and the thread's next call
starts a new child. A child ends when its thread does, or its parent (its stdin closes).
What a call costs is in docs/BENCHMARKS.md ("Hung env calls: what the guards cost").

    python -m agentgym.supervision.process_call   # the child's side (a loop over stdin)
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import weakref

from agentgym.supervision.daemon_pool import current_call, killable_process_group

_local = threading.local()


class ProcessCallError(RuntimeError):
    """The function raised in its process (the message carries the error), or the process
    ended without an answer (killed, or it exited)."""


class _Child:
    """A thread's child interpreter; its stdin closes (and it exits) when this is dropped."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "agentgym.supervision.process_call"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     start_new_session=True)
        weakref.finalize(self, _close, self.proc)


def _close(proc: subprocess.Popen) -> None:
    for stream in (proc.stdin, proc.stdout):
        try:
            stream.close()
        except OSError:
            pass


def call_in_process(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in this thread's child interpreter (see the module
    docstring); its return value. Raises :class:`ProcessCallError`."""
    name = getattr(fn, "__qualname__", repr(fn))
    blob = pickle.dumps((fn, args, kwargs))
    child = getattr(_local, "child", None)
    if child is None or child.proc.poll() is not None:
        child = _local.child = _Child()
    call = current_call()
    if call is not None:
        call.delegate = fn
    try:
        with killable_process_group(child.proc.pid):
            try:
                pickle.dump((list(sys.path), blob), child.proc.stdin)
                child.proc.stdin.flush()
                ok, value = pickle.load(child.proc.stdout)
            except (EOFError, OSError, pickle.UnpicklingError):
                _local.child = None
                status = child.proc.wait()
                how = "was killed (SIGKILL)" if status == -9 else f"exited with status {status}"
                raise ProcessCallError(f"{name} in its own process {how} before answering") \
                    from None
    finally:
        if call is not None:
            call.delegate = None
    if not ok:
        raise ProcessCallError(f"{name} raised in its own process: {value}")
    return value


def _main() -> None:
    calls = sys.stdin.buffer
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what the functions print goes to stderr, not into the answers
    while True:
        try:
            paths, blob = pickle.load(calls)
        except EOFError:  # the thread (or the process) that called is gone
            return
        sys.path[:] = paths + [p for p in sys.path if p not in paths]
        try:
            fn, args, kwargs = pickle.loads(blob)
            answer = (True, fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - the caller's to see
            answer = (False, f"{type(e).__name__}: {e}")
        try:
            data = pickle.dumps(answer)
        except Exception as e:  # noqa: BLE001 - a result that does not pickle
            data = pickle.dumps((False, f"its result does not pickle: {e}"))
        answers.write(data)
        answers.flush()


if __name__ == "__main__":
    _main()
