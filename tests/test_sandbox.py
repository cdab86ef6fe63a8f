"""The code sandbox (tools/sandbox*.py) under bubblewrap: what an execution returns, and
one attack or property per test, on real processes.

Each adversarial test checks that the attack is contained, that the host is unaffected
(checked on the host: files, processes, a loopback listener) and that the next execution
still works. The local tests need root and bubblewrap (``apt-get install bubblewrap``).
Concurrency and sessions are in tests/test_sandbox_sessions.py; the unshare fallback, E2B,
construction and the CLI in tests/test_sandbox_backends.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import socket
import sys
import uuid
from pathlib import Path

import pytest
from conftest import wait_until
from sandbox_probes import (ROOT, assert_still_works, most_procs_of_a_sandbox_uid, sleeper_code,
                            wait_gone, wait_present)
from sandbox_probes import make, sandbox  # noqa: F401, F811 (fixtures)

from agentgym.tools import sandbox_local


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
