"""In-sandbox worker of :mod:`agentgym.tools.sandbox_local`. Standard library only; never imported.

The host starts it inside the sandbox, already as the sandbox's unprivileged uid, as
``python -I -B -u -c <this source> MODE cpu_s=5.0,wall_s=10.0,...`` (the
:class:`~agentgym.tools.sandbox.Limits` fields). It first lowers its own rlimits (a
non-root process cannot raise them again), writes :data:`READY` to its stderr so the host
can tell "the sandbox started" from "the launcher failed", then runs untrusted code:

``run``
    Read the program from stdin until EOF and run it once as ``__main__``, printing to the
    real stdout/stderr (the host streams, caps and times them). Exit status as
    ``python prog.py``: 0, 1 on an uncaught exception (traceback on stderr), n for
    ``sys.exit(n)``.
``session``
    A persistent interpreter (one namespace across cells). Requests and replies are frames
    (:data:`MAGIC`, 4-byte big-endian length, UTF-8 JSON) on private duplicates of the
    original stdin/stdout; the cell's fds 0/1/2 are /dev/null and two memfds, so output of
    the cell and of its subprocesses is captured and cannot corrupt the framing. A cell is
    stopped by SIGALRM after ``wall_s`` and by SIGXCPU at the CPU limit; the reply says so
    and the host then discards the session.

In both modes a trailing expression statement has its ``repr`` printed when it is not
None, as in a notebook. The cell shares this interpreter, so it can tamper with its own
reply; the host re-checks sizes and types and never trusts a reply for more than that.

Imports beyond the interpreter's start-up set are made where needed: each costs a
stateless run start-up time (json, ast, traceback: about 4 ms together).
"""

import _ast
import codecs
import os
import resource
import sys
import types

MAGIC = b"AGSB"
READY = b"\x00agentgym-sandbox-ready\n"
_MAX_REQUEST = 64 << 20


class _Stop(BaseException):
    """Raised into the cell by SIGALRM (wall time) or SIGXCPU (CPU time)."""


def set_limits(lim: dict) -> None:
    cpu = max(1, int(-(-lim["cpu_s"] // 1)))  # ceil; soft < hard: SIGXCPU first, then SIGKILL
    mib = 1 << 20
    for res, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1),
                            (resource.RLIMIT_AS, lim["memory_mb"] * mib, lim["memory_mb"] * mib),
                            (resource.RLIMIT_FSIZE, lim["file_size_mb"] * mib,
                             lim["file_size_mb"] * mib),
                            (resource.RLIMIT_NPROC, lim["max_procs"], lim["max_procs"]),
                            (resource.RLIMIT_CORE, 0, 0)):
        resource.setrlimit(res, (soft, hard))


def fresh_main() -> dict:
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    sys.argv = [""]
    return main.__dict__


def execute(src: str, ns: dict, filename: str) -> None:
    """Run ``src`` in ``ns``; print the repr of a trailing expression (if not None)."""
    tree = compile(src, filename, "exec", _ast.PyCF_ONLY_AST)  # _ast: cheaper than ast
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], _ast.Expr) else None
    exec(compile(tree, filename, "exec"), ns)
    if last is not None:
        value = eval(compile(_ast.Expression(last.value), filename, "eval"), ns)
        if value is not None:
            print(repr(value))


def print_user_traceback(exc: BaseException, src: str, filename: str) -> None:
    """The traceback without this worker's own frames (the user sees only their code)."""
    import linecache
    import traceback

    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    tb = exc.__traceback__
    while tb is not None and not tb.tb_frame.f_code.co_filename.startswith("<cell"):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb, file=sys.stderr)


def exit_status(exc: SystemExit) -> int:
    """What the interpreter would exit with for ``raise exc`` (printing a message as it does)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def run_once() -> None:
    src = sys.stdin.buffer.read().decode("utf-8", "replace")
    ns = fresh_main()
    try:
        execute(src, ns, "<cell>")
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - report like the interpreter, status 1
        if isinstance(e, MemoryError):
            ns.clear()  # free the code's objects, or printing the traceback may fail too
        print_user_traceback(e, src, "<cell>")
        sys.exit(1)  # a normal exit: atexit handlers run, as for an uncaught exception


def read_exact(fd: int, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def read_frame(fd: int) -> dict:
    import json
    head = read_exact(fd, 8)
    n = int.from_bytes(head[4:], "big")
    if head[:4] != MAGIC or n > _MAX_REQUEST:
        raise EOFError
    return json.loads(read_exact(fd, n))


def write_frame(fd: int, obj: dict) -> None:
    import json
    body = json.dumps(obj, ensure_ascii=False).encode("utf-8", "replace")
    data = memoryview(MAGIC + len(body).to_bytes(4, "big") + body)
    while data:
        data = data[os.write(fd, data):]


def grab(fd: int, cap: int) -> tuple[str, bool]:
    """The first ``cap`` bytes written to memfd ``fd`` (decoded), and whether there were more."""
    size = os.fstat(fd).st_size
    data = os.pread(fd, cap, 0)
    text = codecs.getincrementaldecoder("utf-8")("replace").decode(data, final=size <= cap)
    return text, size > cap


def _raise_stop(signum, _frame):
    raise _Stop(signum)


def run_cell(src: str, ns: dict, n: int, lim: dict, streams: tuple) -> dict:
    import linecache
    import signal
    out_fd, err_fd, stdout, stderr = streams
    filename = f"<cell {n}>"  # kept in linecache: later tracebacks through it show source
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    for fd, target in ((out_fd, 1), (err_fd, 2)):  # re-point fds the last cell may have moved
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.dup2(fd, target)
    sys.stdout, sys.stderr = stdout, stderr
    reply = {"exit_code": 0, "timed_out": False, "memory_error": False}
    try:
        signal.signal(signal.SIGALRM, _raise_stop)
        signal.signal(signal.SIGXCPU, _raise_stop)
        signal.setitimer(signal.ITIMER_REAL, lim["wall_s"])
        try:
            execute(src, ns, filename)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Stop as e:
        if e.args[0] == signal.SIGXCPU:
            reply["exit_code"] = -signal.SIGXCPU
            print("CPU time limit exceeded", file=sys.stderr)
        else:
            reply.update(exit_code=None, timed_out=True)
    except SystemExit as e:
        reply["exit_code"] = exit_status(e)
    except BaseException as e:  # noqa: BLE001 - the cell's error is its result
        reply.update(exit_code=1, memory_error=isinstance(e, MemoryError))
        if reply["memory_error"]:
            ns.clear()  # the session ends anyway; free memory to report the error
        try:
            print_user_traceback(e, src, filename)
        except MemoryError:
            print(f"{type(e).__name__}", file=sys.stderr)
    for f in (stdout, stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    cap = lim["max_output_bytes"]
    reply["stdout"], reply["stdout_truncated"] = grab(out_fd, cap)
    reply["stderr"], reply["stderr_truncated"] = grab(err_fd, cap)
    return reply


def serve(lim: dict) -> None:
    proto_in, proto_out = os.dup(0), os.dup(1)  # non-inheritable: subprocesses don't get them
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    out_fd, err_fd = os.memfd_create("stdout"), os.memfd_create("stderr")
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    streams = (out_fd, err_fd, sys.stdout, sys.stderr)  # -u: these write straight to fds 1, 2
    ns = fresh_main()
    n = 0
    while True:
        try:
            request = read_frame(proto_in)
        except (EOFError, ValueError):
            os._exit(0)
        n += 1
        write_frame(proto_out, run_cell(str(request["code"]), ns, n, lim, streams))


def main() -> None:
    mode = sys.argv[1]
    lim = {k: float(v) for k, v in (kv.split("=") for kv in sys.argv[2].split(","))}
    for k in ("memory_mb", "file_size_mb", "max_procs", "max_output_bytes"):
        lim[k] = int(lim[k])
    set_limits(lim)
    os.write(2, READY)
    if mode == "session":
        serve(lim)
    else:
        run_once()


if __name__ == "__main__":
    main()
