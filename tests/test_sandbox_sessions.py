"""The code sandbox (tools/sandbox*.py) under bubblewrap: concurrent executions (bounded,
unmixed, from threads and event loops) and sessions (state kept across cells, isolated from
other sessions, reset by a timeout, a memory error or the interpreter exiting). Needs root
and bubblewrap, like tests/test_sandbox.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import uuid

from sandbox_probes import sleeper_code, wait_gone, wait_present
from sandbox_probes import make, sandbox  # noqa: F401, F811 (fixtures)

from agentgym.tools import sandbox_local


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
