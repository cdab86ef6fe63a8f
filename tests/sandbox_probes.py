"""What the sandbox tests share (tests/test_sandbox.py, tests/test_sandbox_sessions.py,
tests/test_sandbox_backends.py): the limits and fixtures of a LocalSandbox under test, and
probes that look at the host from outside the sandbox (its processes, read from /proc).

A test module uses the fixtures by importing them: ``from sandbox_probes import make,
sandbox`` (each module gets its own module-scoped ``sandbox``)."""

from __future__ import annotations

import collections
import os
import time
from pathlib import Path

import pytest

from agentgym.tools import sandbox_local
from agentgym.tools.sandbox import Limits, LocalSandbox

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
