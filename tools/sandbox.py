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

from dataclasses import dataclass

from agentgym.core.registry import check_choices
from agentgym.tools.sandbox_base import ExecResult, Limits, Sandbox, cap_bytes, cap_text
from agentgym.tools.sandbox_e2b import E2BSandbox
from agentgym.tools.sandbox_local import LocalSandbox

__all__ = ["Limits", "ExecResult", "Sandbox", "LocalSandbox", "E2BSandbox", "make_sandbox",
           "SandboxConfig", "cap_bytes", "cap_text"]


@dataclass
class SandboxConfig:
    """Where and under which limits model-written code runs (``agentgym.tools.sandbox``)."""

    backend: str = "local"  # local (bubblewrap / unshare on this machine) | e2b (needs E2B_API_KEY)
    isolation: str = "auto"  # local only: auto (bwrap, else unshare, logged) | bwrap | unshare
    cpu_s: float = 5.0  # CPU seconds per execution
    wall_s: float = 10.0  # wall-clock seconds per execution
    memory_mb: int = 1024  # address space per execution
    file_size_mb: int = 16  # largest file it may write
    max_procs: int = 32  # processes/threads of the sandbox user
    max_output_bytes: int = 65536  # stdout and stderr each, beyond which output is cut
    max_concurrency: int = 4  # executions running at once
    stateful: bool = False  # code env: later cells of an episode see earlier variables

    def __post_init__(self) -> None:
        check_choices("sandbox", self, {"backend": ("local", "e2b"),
                                        "isolation": ("auto", "bwrap", "unshare")})
        for name in ("cpu_s", "wall_s", "memory_mb", "file_size_mb", "max_procs",
                     "max_output_bytes", "max_concurrency"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sandbox.{name} must be > 0, got {getattr(self, name)}")


def make_sandbox(cfg) -> Sandbox:
    """The sandbox a :class:`SandboxConfig` describes (``backend`` local | e2b)."""
    limits = Limits.from_config(cfg)
    if cfg.backend == "local":
        return LocalSandbox(limits, isolation=cfg.isolation, max_concurrency=cfg.max_concurrency)
    if cfg.backend == "e2b":
        return E2BSandbox(limits, max_concurrency=cfg.max_concurrency)
    raise ValueError(f"sandbox.backend={cfg.backend!r}; valid: local, e2b")


def __getattr__(name: str):
    # The backends live in their own modules; load them (and their dependencies) on use.
    if name == "LocalSandbox":
        return LocalSandbox
    if name == "E2BSandbox":
        return E2BSandbox
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
