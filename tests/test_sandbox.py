"""The code sandbox (tools/sandbox*.py): one attack or property per test, on real processes.

Each adversarial test checks that the attack is contained, that the host is unaffected
(checked on the host: files, processes, a loopback listener) and that the next execution
still works. The local tests need root and bubblewrap (``apt-get install bubblewrap``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import io
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from agentgym.cli import main as cli_main
from agentgym.tools.sandbox import SandboxConfig
from conftest import wait_until
from agentgym.tools import sandbox_local
from agentgym.tools.sandbox import E2BSandbox, ExecResult, Limits, LocalSandbox, make_sandbox

ROOT = Path(__file__).resolve().parents[1]
IS_ROOT = os.geteuid() == 0
HAS_BWRAP = IS_ROOT and Path("/usr/bin/bwrap").exists()
needs_root = pytest.mark.skipif(not IS_ROOT, reason="LocalSandbox needs root")
needs_bwrap = pytest.mark.skipif(not HAS_BWRAP, reason="needs root and bubblewrap "
                                                       "(apt-get install bubblewrap)")
LIMITS = dict(cpu_s=5, wall_s=5, memory_mb=512, file_size_mb=4, max_procs=16,
              max_output_bytes=4096)


@pytest.fixture(scope="module")
def sandbox():
    if not HAS_BWRAP:
        pytest.skip("needs root and bubblewrap")
    sb = LocalSandbox(Limits(**LIMITS), isolation="bwrap", max_concurrency=4)
    yield sb
    sb.close()


@pytest.fixture
def make():
    """A LocalSandbox with some limits changed (closed after the test)."""
    boxes = []

    def _make(isolation: str = "bwrap", max_concurrency: int = 4, **changes) -> LocalSandbox:
        sb = LocalSandbox(Limits(**{**LIMITS, **changes}), isolation=isolation,
                          max_concurrency=max_concurrency)
        boxes.append(sb)
        return sb

    yield _make
    for sb in boxes:
        sb.close()


def assert_still_works(sb) -> None:
    r = sb.run_sync("print(6 * 7)")
    assert r.ok and r.stdout == "42\n", r


def host_pids_with(marker: str) -> list[int]:
    """Host processes whose argv contains ``marker`` (read from /proc, outside the sandbox)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if marker.encode() in (d / "cmdline").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


def most_procs_of_a_sandbox_uid() -> int:
    """The most host processes running as one sandbox uid (zombies too): the count that
    RLIMIT_NPROC (max_procs) caps."""
    counts = collections.Counter()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                uid = int((d / "status").read_text().split("\nUid:")[1].split()[0])
            except (OSError, IndexError):  # gone meanwhile
                continue
            if uid >= sandbox_local.UID_BASE:
                counts[uid] += 1
    return max(counts.values(), default=0)


def wait_gone(marker: str, timeout: float = 30.0) -> list[int]:
    """Poll until no host process carries ``marker``; the survivors after ``timeout``
    (killed processes leave /proc a moment after the kill: the wait is for that)."""
    deadline = time.monotonic() + timeout
    while (pids := host_pids_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


def wait_present(marker: str, timeout: float = 60.0) -> list[int]:
    """Poll until a host process carries ``marker`` (an exec in the sandbox may lag)."""
    deadline = time.monotonic() + timeout
    while not (pids := host_pids_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return pids


def sleeper_code(marker: str, double_fork: bool = False) -> str:
    """Code that leaves a ``sleep 1000`` process named ``marker`` (argv[0])."""
    spawn = f"os.execv('/bin/sleep', [{marker!r}, '1000'])"
    if not double_fork:
        return f"import os\nif os.fork() == 0:\n    {spawn}\nprint('spawned')"
    return ("import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        {spawn}\n    os._exit(0)\nos.wait()\nprint('spawned')")


# ---- basic semantics --------------------------------------------------------------------
def test_runs_code_and_captures_both_streams(sandbox):
    r = sandbox.run_sync("import sys\nprint('out')\nprint('err', file=sys.stderr)")
    assert (r.stdout, r.stderr, r.exit_code, r.ok, r.backend) == ("out\n", "err\n", 0, True,
                                                                  "bwrap")


def test_exit_status_and_traceback_of_failing_code(sandbox):
    assert sandbox.run_sync("import sys; sys.exit(3)").exit_code == 3
    r = sandbox.run_sync("x = 1\nraise ValueError('boom')")
    assert r.exit_code == 1 and not r.ok
    assert 'File "<cell>", line 2' in r.stderr and r.stderr.endswith("ValueError: boom\n")


def test_trailing_expression_prints_its_repr(sandbox):
    assert sandbox.run_sync("x = 6\nx * 7").stdout == "42\n"
    assert sandbox.run_sync("None").stdout == ""


def test_stateless_by_default(sandbox):
    sandbox.run_sync("leftover = 1\nopen('/tmp/leftover', 'w').write('x')")
    r = sandbox.run_sync("import os\n"
                         "print('leftover' in globals(), os.path.exists('/tmp/leftover'))")
    assert r.stdout == "False False\n"


def test_numpy_and_sympy_import_inside(sandbox):
    r = sandbox.run_sync("import numpy as np, sympy as sp\n"
                         "print(int(np.arange(10).sum()), sp.factorint(360))")
    assert r.ok and r.stdout == "45 {2: 3, 3: 2, 5: 1}\n", r


# ---- adversarial ----------------------------------------------------------------------
def test_cannot_connect_to_host_loopback(sandbox):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        r = sandbox.run_sync(f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', "
                             f"{port}), timeout=2)\n    print('CONNECTED')\nexcept OSError as e:\n"
                             f"    print('blocked', type(e).__name__)")
        assert r.stdout.startswith("blocked"), r
        with pytest.raises(BlockingIOError):  # nothing reached the host's listener
            listener.accept()
    finally:
        listener.close()
    assert_still_works(sandbox)


def test_dns_resolution_fails(sandbox):
    r = sandbox.run_sync("import socket\ntry:\n    print(socket.getaddrinfo('pypi.org', 443))\n"
                         "except OSError as e:\n    print('blocked', type(e).__name__)")
    assert r.stdout.startswith("blocked"), r
    assert_still_works(sandbox)


def test_cannot_read_host_files(sandbox):
    token = uuid.uuid4().hex
    planted = [ROOT / f".sandbox-probe-{token}", Path.home() / f".sandbox-probe-{token}"]
    for p in planted:
        p.write_text(token)
    targets = [*map(str, planted), "/etc/shadow", "/etc/passwd", str(ROOT / "pyproject.toml")]
    try:
        r = sandbox.run_sync(f"for p in {targets!r}:\n    try:\n        open(p).read()\n"
                             f"        print('READ', p)\n    except OSError as e:\n"
                             f"        print('denied', type(e).__name__)")
    finally:
        for p in planted:
            p.unlink()
    assert r.stdout.count("denied") == len(targets) and "READ" not in r.stdout, r
    assert token not in r.stdout + r.stderr
    assert_still_works(sandbox)


def test_cannot_write_host_paths(sandbox):
    name = f"sandbox-probe-{uuid.uuid4().hex}"
    dirs = ["/etc", "/usr", "/usr/local", str(ROOT), sys.prefix, sys.base_prefix,
            str(Path.home()), "/"]
    paths = [os.path.join(d, name) for d in dirs]
    r = sandbox.run_sync(f"for p in {paths!r}:\n    try:\n        open(p, 'w').write('x')\n"
                         f"        print('WROTE', p)\n    except OSError as e:\n"
                         f"        print('denied', type(e).__name__)")
    assert r.stdout.count("denied") == len(paths) and "WROTE" not in r.stdout, r
    assert not [p for p in paths if os.path.exists(p)]
    assert_still_works(sandbox)


def test_fork_bomb_is_stopped_by_max_procs(make):
    sb = make(max_procs=12)
    marker = f"agentgym-forkbomb-{uuid.uuid4().hex}"
    r = sb.run_sync("import os\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
                    f"            os.execv('/bin/sleep', [{marker!r}, '1000'])\n        n += 1\n"
                    "except OSError as e:\n    print(n, type(e).__name__)")
    forks, error = r.stdout.split()
    assert 0 < int(forks) < 12 and error == "BlockingIOError", r
    assert not r.timed_out
    assert wait_gone(marker) == []  # the sleeping children died with the sandbox
    assert_still_works(sb)


def test_fork_bomb_does_not_starve_a_concurrent_execution(make):
    # Each execution has its own uid, so RLIMIT_NPROC (counted per uid) is its own.
    sb = make(max_procs=16, wall_s=2, cpu_s=60, max_concurrency=2)
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    other = ("import os, time\nn = 0\nfor _ in range(8):\n    if os.fork() == 0:\n"
             "        time.sleep(0.5)\n        os._exit(0)\n    n += 1\nprint('forked', n)")

    def bomb_at_quota() -> bool:  # its uid holds max_procs processes: its forks fail now
        return most_procs_of_a_sandbox_uid() >= sb.limits.max_procs

    async def main():
        bombing = asyncio.ensure_future(sb.run(bomb))
        await asyncio.to_thread(wait_until, bomb_at_quota, 60, "the bomb using up its quota")
        return await asyncio.gather(bombing, sb.run(other))

    bombed, r = asyncio.run(main())
    assert bombed.timed_out and bombed.duration_s < 2 + 3, bombed
    assert r.ok and r.stdout == "forked 8\n", r
    assert_still_works(sb)


def test_memory_bomb_sets_memory_exceeded(make):
    sb = make(memory_mb=256)
    r = sb.run_sync("chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))")
    assert r.memory_exceeded and r.exit_code == 1 and not r.timed_out, r
    assert_still_works(sb)


def test_numpy_allocation_failure_counts_as_memory(make):
    sb = make(memory_mb=512)
    r = sb.run_sync("import numpy as np\nnp.ones((1 << 31,))")  # 16 GiB
    assert r.memory_exceeded and "MemoryError" in r.stderr, r


def test_infinite_loop_times_out(make):
    sb = make(wall_s=1.5, cpu_s=60)
    r = sb.run_sync("print('started', flush=True)\nwhile True:\n    pass")
    assert r.timed_out and r.exit_code is None and not r.ok, r
    assert r.stdout == "started\n"  # output before the kill is kept
    assert r.duration_s < 1.5 + 3
    assert_still_works(sb)


def test_cpu_time_limit_kills_busy_code(make):
    sb = make(cpu_s=1, wall_s=30)
    r = sb.run_sync("while True:\n    pass")
    assert r.exit_code == -signal.SIGXCPU and not r.timed_out, r
    assert r.duration_s < 30  # stopped by the CPU limit, not the wall clock
    assert_still_works(sb)


def test_output_flood_is_cut_and_stopped(make):
    sb = make(max_output_bytes=4096, wall_s=30)
    r = sb.run_sync("while True:\n    print('x' * 1000)")
    assert r.truncated and not r.timed_out and r.exit_code is None, r
    assert 0 < len(r.stdout) <= 4096 and set(r.stdout) <= {"x", "\n"}
    assert r.duration_s < 30  # stopped when the cap was passed
    assert_still_works(sb)


def test_invalid_utf8_output_is_replaced_not_fatal(sandbox):
    r = sandbox.run_sync("import sys\n_ = sys.stdout.buffer.write(b'ok \\xff\\xfe end\\n')")
    assert r.ok and r.stdout == "ok \ufffd\ufffd end\n", r


def test_daemonized_process_does_not_outlive_the_call(sandbox):
    marker = f"agentgym-daemon-{uuid.uuid4().hex}"
    r = sandbox.run_sync(sleeper_code(marker, double_fork=True))
    assert r.ok and r.stdout == "spawned\n" and not r.timed_out, r
    assert wait_gone(marker) == []
    assert_still_works(sandbox)


def test_signals_cannot_reach_the_host(sandbox):
    r = sandbox.run_sync(
        "import os, signal\n"
        "for target in (os.getppid(), 1, -1):\n"
        "    try:\n        os.kill(target, signal.SIGKILL)\n        print('sent', target)\n"
        "    except OSError as e:\n        print('refused', target, type(e).__name__)\n"
        "print('still here')")
    assert r.stdout.endswith("still here\n") and "refused" in r.stdout, r
    assert_still_works(sandbox)  # this (host) process and the sandbox both survived


def test_environment_secrets_are_not_inherited(sandbox, monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("AGENTGYM_TEST_SECRET", secret)
    r = sandbox.run_sync("import json, os\nprint(json.dumps(dict(os.environ)))")
    env = json.loads(r.stdout)
    assert "AGENTGYM_TEST_SECRET" not in env and secret not in r.stdout
    # PWD (and OLDPWD under unshare's sh) are set by the launcher's chdir
    assert set(env) - {"PWD"} <= set(sandbox_local.ENV) and env["HOME"] == "/tmp"
    assert_still_works(sandbox)


def test_file_size_limit(make):
    sb = make(file_size_mb=1)
    r = sb.run_sync("open('/tmp/small', 'wb').write(bytes(512 << 10))\nprint('small ok')\n"
                    "try:\n    open('/tmp/big', 'wb').write(bytes(2 << 20))\n"
                    "except OSError as e:\n    print('big', e.errno)")
    assert r.stdout == "small ok\nbig 27\n", r  # 27: EFBIG
    assert_still_works(sb)


def test_runs_unprivileged(sandbox):
    r = sandbox.run_sync("import os\nstatus = dict(l.split(':\\t') for l in "
                         "open('/proc/self/status').read().splitlines() if ':\\t' in l)\n"
                         "print(os.getuid(), os.getgid(), os.getgroups(), status['CapEff'], "
                         "status['NoNewPrivs'])")
    uid, gid, groups, cap_eff, nnp = r.stdout.split()
    assert int(uid) >= sandbox_local.UID_BASE and int(gid) == int(uid), r
    assert (groups, int(cap_eff, 16), nnp) == ("[]", 0, "1")


def test_sandbox_start_failure_is_an_error_not_a_code_failure(make):
    sb = make()
    # Fault injection: a bind of a missing path makes bwrap fail before any code runs.
    sb._prefix = [sb._prefix[0], "--ro-bind", "/nonexistent-agentgym", "/x", *sb._prefix[1:]]
    for session in (None, "s"):
        r = sb.run_sync("print(1)", session=session)
        assert r.error.startswith("sandbox failed to start") and "bwrap" in r.error, r
        assert r.exit_code is None and not r.ok


def test_close_kills_running_executions(make):
    sb = make(wall_s=60, cpu_s=60)
    marker = f"agentgym-close-{uuid.uuid4().hex}"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(sb.run_sync, f"import os\nos.execv('/bin/sleep', [{marker!r}, '60'])")
        assert wait_present(marker), "the execution never started"
        sb.close()
        with pytest.raises(concurrent.futures.CancelledError):
            fut.result(timeout=10)
    assert wait_gone(marker) == []
    with pytest.raises(RuntimeError, match="closed"):
        sb.run_sync("print(1)")


def test_cancelling_an_awaited_run_kills_it(make):
    sb = make(wall_s=60, cpu_s=60)
    marker = f"agentgym-cancel-{uuid.uuid4().hex}"

    async def main():
        task = asyncio.ensure_future(
            sb.run(f"import os\nos.execv('/bin/sleep', [{marker!r}, '60'])"))
        await asyncio.to_thread(wait_present, marker)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert wait_gone(marker) == []
    # the awaiting task sees the cancellation at once; the sandbox's loop releases the
    # slot only after it has reaped the killed execution
    wait_until(lambda: sb.in_flight == 0, 60, "the cancelled run's slot being released")
    assert_still_works(sb)


# ---- concurrency ----------------------------------------------------------------------
def test_concurrent_runs_are_bounded_and_unmixed(make):
    sb = make(max_concurrency=4)

    async def main():
        codes = [f"import time\ntime.sleep(0.15)\nprint('token-{i}', sum(range({i} * 1000)))"
                 for i in range(24)]
        return await asyncio.gather(*(sb.run(c) for c in codes))

    results = asyncio.run(main())
    assert [r.stdout for r in results] == [f"token-{i} {sum(range(i * 1000))}\n"
                                           for i in range(24)]
    assert sb.max_in_flight == 4 and sb.in_flight == 0


def test_run_sync_from_many_threads(sandbox):
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda i: sandbox.run_sync(f"print({i} ** 2)"), range(24)))
    assert [r.stdout for r in results] == [f"{i ** 2}\n" for i in range(24)]


def test_run_sync_inside_an_event_loops_executor(sandbox):
    async def main():
        loop = asyncio.get_running_loop()
        blocking = [loop.run_in_executor(None, sandbox.run_sync, f"print({i})") for i in range(4)]
        awaited = [sandbox.run(f"print({i + 4})") for i in range(4)]
        return await asyncio.gather(*blocking, *awaited)

    assert [r.stdout for r in asyncio.run(main())] == [f"{i}\n" for i in range(8)]


# ---- sessions -------------------------------------------------------------------------
def test_session_keeps_variables_across_cells(sandbox):
    sid = f"ep-{uuid.uuid4().hex}"
    try:
        assert sandbox.run_sync("x = 41\ndef f(y):\n    return y + x", session=sid).ok
        r = sandbox.run_sync("f(1)", session=sid)
        assert r.stdout == "42\n" and not r.session_reset, r
    finally:
        sandbox.close_session(sid)


def test_sessions_are_isolated_from_each_other(sandbox):
    a, b = f"a-{uuid.uuid4().hex}", f"b-{uuid.uuid4().hex}"
    try:
        sandbox.run_sync("x = 1\nopen('/tmp/mine', 'w').write('a')", session=a)
        r = sandbox.run_sync("import os\nprint('x' in globals(), os.path.exists('/tmp/mine'))",
                             session=b)
        assert r.stdout == "False False\n", r
    finally:
        sandbox.close_session(a)
        sandbox.close_session(b)


def test_session_cell_timeout_resets_the_session(make):
    sb = make(wall_s=1.5, cpu_s=60)
    sb.run_sync("x = 1", session="s")
    r = sb.run_sync("print('partial')\nwhile True:\n    pass", session="s")
    assert r.timed_out and r.session_reset and r.stdout == "partial\n", r
    r = sb.run_sync("print('x' in globals())", session="s")
    assert r.ok and r.stdout == "False\n" and not r.session_reset, r


def test_session_cell_that_blocks_the_alarm_is_killed_by_the_host(make):
    sb = make(wall_s=1.0, cpu_s=60)
    r = sb.run_sync("import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
                    "while True:\n    pass", session="s")
    assert r.timed_out and r.session_reset and r.exit_code is None, r
    assert r.duration_s < 1.0 + sandbox_local.SESSION_GRACE_S + 3
    assert sb.run_sync("print('fresh')", session="s").stdout == "fresh\n"


def test_session_memory_error_resets_the_session(make):
    sb = make(memory_mb=256)
    sb.run_sync("x = 1", session="s")
    r = sb.run_sync("chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))",
                    session="s")
    assert r.memory_exceeded and r.session_reset and r.exit_code == 1, r
    assert sb.run_sync("print('x' in globals())", session="s").stdout == "False\n"


def test_session_output_flood_is_capped(make):
    sb = make(max_output_bytes=4096, file_size_mb=1, wall_s=30)
    r = sb.run_sync("while True:\n    print('x' * 1000)", session="s")
    assert r.truncated and 0 < len(r.stdout) <= 4096 and not r.timed_out, r
    assert r.duration_s < 30  # stopped by the file-size limit on the capture, not the clock
    assert sb.run_sync("print('next')", session="s").stdout == "next\n"


def test_session_captures_subprocess_output(sandbox):
    sid = f"sub-{uuid.uuid4().hex}"
    try:
        r = sandbox.run_sync("import subprocess\nsubprocess.run(['echo', 'from child'])\n"
                             "print('from cell')", session=sid)
        assert r.stdout == "from child\nfrom cell\n", r
    finally:
        sandbox.close_session(sid)


def test_worker_exit_ends_the_session(sandbox):
    sid = f"exit-{uuid.uuid4().hex}"
    sandbox.run_sync("x = 1", session=sid)
    r = sandbox.run_sync("import os\nos._exit(3)", session=sid)
    assert r.exit_code == 3 and r.session_reset and not r.error, r
    assert sandbox.run_sync("print('x' in globals())", session=sid).stdout == "False\n"
    sandbox.close_session(sid)


def test_close_session_forgets_state_and_is_idempotent(sandbox):
    marker = f"agentgym-session-{uuid.uuid4().hex}"
    sandbox.run_sync("kept = 1\n" + sleeper_code(marker), session="c")
    assert wait_present(marker)  # a session's background process lives with the session
    sandbox.close_session("c")
    sandbox.close_session("c")
    sandbox.close_session("never-opened")
    assert wait_gone(marker) == []
    assert sandbox.run_sync("print('kept' in globals())", session="c").stdout == "False\n"
    sandbox.close_session("c")


# ---- construction, fallback -------------------------------------------------------------
def _no_bwrap(monkeypatch):
    real = sandbox_local.shutil.which
    monkeypatch.setattr(sandbox_local.shutil, "which",
                        lambda name: None if name == "bwrap" else real(name))


@needs_root
def test_missing_bwrap_fails_fast_with_the_fix(monkeypatch):
    _no_bwrap(monkeypatch)  # a fake, to inject the fault "bwrap is not installed"
    with pytest.raises(ValueError, match="apt-get install bubblewrap"):
        LocalSandbox(isolation="bwrap")


@needs_root
def test_auto_falls_back_to_unshare_with_a_warning(monkeypatch, caplog):
    _no_bwrap(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="agentgym.tools.sandbox_local"):
        sb = LocalSandbox(Limits(**LIMITS), isolation="auto")
    try:
        assert sb.backend == "unshare" and "FILESYSTEM stays visible" in caplog.text
        assert sb.run_sync("print(1)").stdout == "1\n"
    finally:
        sb.close()


@needs_root
def test_unshare_blocks_network(make):
    sb = make(isolation="unshare")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    try:
        r = sb.run_sync(f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', "
                        f"{listener.getsockname()[1]}), timeout=2)\n    print('CONNECTED')\n"
                        f"except OSError as e:\n    print('blocked', type(e).__name__)")
        assert r.backend == "unshare" and r.stdout.startswith("blocked"), r
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
    assert_still_works(sb)


@needs_root
def test_unshare_clears_environment_and_drops_root(make, monkeypatch):
    monkeypatch.setenv("AGENTGYM_TEST_SECRET", "s3cret")
    sb = make(isolation="unshare")
    r = sb.run_sync("import json, os\nprint(os.getuid(), json.dumps(dict(os.environ)))")
    uid, env = r.stdout.split(" ", 1)
    assert int(uid) >= sandbox_local.UID_BASE
    assert set(json.loads(env)) - {"PWD", "OLDPWD"} <= set(sandbox_local.ENV)
    assert "s3cret" not in env


@needs_root
def test_unshare_has_private_tmp(make):
    sb = make(isolation="unshare")
    name = f"/tmp/sandbox-probe-{uuid.uuid4().hex}"
    r = sb.run_sync(f"open({name!r}, 'w').write('x')\nprint('wrote')")
    assert r.stdout == "wrote\n" and not os.path.exists(name), r


@needs_root
def test_unshare_is_weaker_host_files_stay_readable(make):
    # Documented weakness of the fallback: no filesystem isolation beyond the tmpfs dirs.
    sb = make(isolation="unshare")
    # (a checkout under /tmp is itself behind the fallback's private /tmp: probe /opt then)
    where = Path("/opt") if str(ROOT).startswith(("/tmp/", "/var/tmp/")) else ROOT
    probe = where / f".sandbox-probe-{uuid.uuid4().hex}"
    probe.write_text("visible")
    try:
        r = sb.run_sync(f"print(open({str(probe)!r}).read())")
    finally:
        probe.unlink()
    assert r.ok and r.stdout == "visible\n", r


# ---- config and construction ------------------------------------------------------------
@needs_bwrap
def test_explicit_interpreter_is_bound_read_only():
    sb = LocalSandbox(Limits(**LIMITS), python=os.path.join(sys.prefix, "bin", "python"))
    try:
        r = sb.run_sync("import sys, numpy\nprint(sys.prefix)\n"
                        "open(sys.prefix + '/probe', 'w')")
        assert r.stdout == f"{sys.prefix}\n" and "Read-only file system" in r.stderr, r
    finally:
        sb.close()


@needs_root
def test_unrunnable_interpreter_fails_fast():
    with pytest.raises(ValueError, match="cannot be run"):
        LocalSandbox(python="/nonexistent/python")



def test_limits_reject_non_positive_values():
    with pytest.raises(ValueError, match="wall_s"):
        Limits(wall_s=0)


@needs_bwrap
def test_make_sandbox_from_config():
    sb = make_sandbox(SandboxConfig(wall_s=3.0, memory_mb=300, max_concurrency=2))
    try:
        assert isinstance(sb, LocalSandbox) and sb.max_concurrency == 2
        assert sb.limits == Limits(wall_s=3.0, memory_mb=300)
        assert sb.run_sync("print('hi')").stdout == "hi\n"
    finally:
        sb.close()


# ---- E2B --------------------------------------------------------------------------------
def test_e2b_without_key_fails_fast(monkeypatch):
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    with pytest.raises(ValueError, match="E2B_API_KEY.*sandbox.backend=local"):
        E2BSandbox()
    with pytest.raises(ValueError, match="E2B_API_KEY"):
        make_sandbox(SandboxConfig(backend="e2b"))


def test_e2b_with_key_constructs_without_network(monkeypatch):
    pytest.importorskip("e2b_code_interpreter")
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    sb = E2BSandbox(api_key="e2b_test_not_a_real_key")
    sb.close()
    sb.close()
    assert sb.backend == "e2b"


def test_e2b_maps_a_successful_execution():
    pytest.importorskip("e2b_code_interpreter")
    from e2b_code_interpreter.models import Execution, Logs, Result

    from agentgym.tools.sandbox_e2b import execution_to_result
    ex = Execution(results=[Result(text="42", is_main_result=True)],
                   logs=Logs(stdout=["a\n", "b\n"], stderr=["warn\n"]), execution_count=1)
    r = execution_to_result(ex, Limits(), 0.5)
    assert (r.stdout, r.stderr, r.exit_code, r.ok, r.backend) == ("a\nb\n42\n", "warn\n", 0,
                                                                  True, "e2b")


def test_e2b_maps_an_error_with_its_traceback():
    pytest.importorskip("e2b_code_interpreter")
    from e2b_code_interpreter.models import Execution, ExecutionError, Logs

    from agentgym.tools.sandbox_e2b import execution_to_result
    tb = "\x1b[0;31mZeroDivisionError\x1b[0m: division by zero"
    ex = Execution(logs=Logs(stdout=["before\n"]),
                   error=ExecutionError("ZeroDivisionError", "division by zero", tb))
    r = execution_to_result(ex, Limits(), 0.1)
    assert r.exit_code == 1 and not r.ok and not r.memory_exceeded
    assert r.stdout == "before\n" and r.stderr == "ZeroDivisionError: division by zero\n"


def test_e2b_maps_memory_error():
    pytest.importorskip("e2b_code_interpreter")
    from e2b_code_interpreter.models import Execution, ExecutionError

    from agentgym.tools.sandbox_e2b import execution_to_result
    ex = Execution(error=ExecutionError("MemoryError", "", "MemoryError"))
    assert execution_to_result(ex, Limits(), 0.1).memory_exceeded


def test_e2b_output_is_capped_like_local():
    pytest.importorskip("e2b_code_interpreter")
    from e2b_code_interpreter.models import Execution, Logs

    from agentgym.tools.sandbox_e2b import execution_to_result
    ex = Execution(logs=Logs(stdout=["é" * 100]))  # 200 bytes of 2-byte characters
    r = execution_to_result(ex, Limits(max_output_bytes=51), 0.1)
    assert r.truncated and r.stdout == "é" * 25  # the character cut by the cap is dropped


# ---- CLI --------------------------------------------------------------------------------
@needs_bwrap
def test_cli_sandbox_exec_file(tmp_path, capsys):
    code = tmp_path / "cell.py"
    code.write_text("print('from file')\n1 / 0\n")
    assert cli_main(["sandbox", "exec", "--file", str(code), "sandbox.wall_s=5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stdout"] == "from file\n" and out["exit_code"] == 1
    assert "ZeroDivisionError" in out["stderr"] and out["backend"] == "bwrap"


@needs_bwrap
def test_cli_sandbox_exec_stdin(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("x = 20\nx + 22\n"))
    assert cli_main(["sandbox", "exec", "-", "--session", "cli"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stdout"] == "42\n" and out["exit_code"] == 0 and out["error"] == ""


def test_cli_sandbox_rejects_other_overrides(capsys):
    assert cli_main(["sandbox", "exec", "--file", "x.py", "model=tiny"]) == 2
    assert "only sandbox.* overrides" in capsys.readouterr().err


def test_cli_sandbox_rejects_bad_values(capsys):
    assert cli_main(["sandbox", "exec", "--file", "x.py", "sandbox.wall_s=-1"]) == 2
    assert "wall_s" in capsys.readouterr().err


def test_cli_sandbox_usage_error():
    assert cli_main(["sandbox", "run"]) == 2


def test_result_dict_round_trip():
    r = ExecResult("o", "e", 0, False, False, False, 0.1, "bwrap")
    assert ExecResult(**r.to_dict()) == r and r.ok
    assert not ExecResult.failure("x", "bwrap").ok


def test_no_thread_left_behind_by_failed_construction(monkeypatch):
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    before = threading.active_count()
    with pytest.raises(ValueError):
        E2BSandbox()
    assert threading.active_count() == before
