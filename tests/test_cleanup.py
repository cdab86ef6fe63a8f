"""Nothing outlives what started it: the local retriever and ``agentgym serve`` (each a
ServerProcess) end with their process and take their temporary folders
(``$TMPDIR/agentgym-*``) with them, whether stopped cleanly, killed from outside, or
when the process that started them gets SIGTERM or SIGINT.

Every test points TMPDIR at a folder of its own, so "nothing left" is exact: no
``agentgym-*`` entry in it, and no live process that inherited it.
"""

from __future__ import annotations

import gzip
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from agentgym.rollout.engines.launcher import launch_serve
from agentgym.core.paths import data_dir
from conftest import wait_until
from agentgym.tools.local_retriever import LocalRetriever

ROOT = Path(__file__).resolve().parents[1]
CORPUS = data_dir() / "corpus" / "wiki_passages.jsonl.gz"


def _leftovers(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("agentgym-"))


def _live_with_tmpdir(tmp: Path) -> list[int]:
    """Pids of live processes whose environment has TMPDIR=tmp (the ones we started)."""
    needle = f"TMPDIR={tmp}".encode() + b"\0"
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes() + b"\0":
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":  # a zombie is dead, only not reaped yet
                    pids.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return pids


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "small.jsonl"
    with gzip.open(CORPUS, "rt", encoding="utf-8") as src:
        path.write_text("".join(itertools.islice(src, 200)), encoding="utf-8")
    return path


def test_servers_stopped_or_killed_leave_nothing(private_tmp, small_corpus, tiny_path,
                                                 tmp_path):
    retriever = LocalRetriever(small_corpus, index_dir=tmp_path / "ix")
    retriever.start()
    serve = launch_serve(str(tiny_path))
    try:
        # while they run, their folders are where the test looks
        assert len(_leftovers(private_tmp)) == 2 and retriever.log_path.exists()
        assert set(_live_with_tmpdir(private_tmp)) >= {retriever.pid, serve.pid}
        os.kill(serve.pid, signal.SIGTERM)  # killed from outside: stop() still cleans up
        wait_until(lambda: not serve.alive, 60, "agentgym serve exiting on SIGTERM")
    finally:
        serve.stop()
        retriever.stop()
    assert _leftovers(private_tmp) == []
    assert _live_with_tmpdir(private_tmp) == []
    retriever.start()  # a second start gets a fresh folder, and stop takes it again
    assert "loaded BM25 index" in retriever.log_path.read_text()
    retriever.stop()
    assert _leftovers(private_tmp) == [] and _live_with_tmpdir(private_tmp) == []


DRIVER = textwrap.dedent("""
    import signal, sys, threading
    # as when started from a terminal: a shell's background jobs (and so possibly this
    # test's runner) inherit SIGINT ignored, and Python then installs no Ctrl-C handler
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from agentgym.rollout.engines.launcher import launch_serve
    from agentgym.tools.local_retriever import LocalRetriever
    retriever = LocalRetriever(sys.argv[1], index_dir=sys.argv[2])
    retriever.start()
    serve = launch_serve(sys.argv[3])
    print("ready", retriever.pid, serve.pid, flush=True)
    threading.Event().wait()  # until a signal ends this process
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_a_signalled_process_takes_its_servers_along(private_tmp, small_corpus, tiny_path,
                                                     tmp_path, sig):
    """A script that started both servers and is then sent SIGTERM (which by default
    skips exit handlers) or SIGINT (Ctrl-C, which its servers never see: they lead their
    own sessions) stops them and removes their folders on the way out. SIGKILL (the OOM
    killer's) runs nothing in the script: the servers notice their parent is gone
    (``watch_parent``), remove their folders and stop."""
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(small_corpus),
                             str(tmp_path / "ix"), str(tiny_path)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = proc.stdout.readline()  # blocks until ready, or EOF if the driver died
        assert line.startswith("ready"), f"driver failed: {line!r} {proc.stderr.read()}"
        servers = [int(x) for x in line.split()[1:]]
        assert len(_leftovers(private_tmp)) == 2
        assert set(_live_with_tmpdir(private_tmp)) >= set(servers)
        proc.send_signal(sig)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == (128 + signal.SIGTERM if sig == signal.SIGTERM else -sig)
    if sig == signal.SIGKILL:  # the servers' own watch, polling each second
        wait_until(lambda: not _live_with_tmpdir(private_tmp), 60, "the orphaned servers' exit")
    assert _leftovers(private_tmp) == []
    assert _live_with_tmpdir(private_tmp) == []


def test_a_terminated_training_run_leaves_nothing(private_tmp, tmp_path):
    """`agentgym rollout env=search` starts the local retriever from an env thread;
    SIGTERM in the middle of the rollouts ends the command, the server and its folder."""
    err = tmp_path / "stderr.log"  # a file, not a pipe nobody reads while it runs
    with open(err, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "agentgym.cli", "rollout", "env=search",
                                 "model=tiny", "limit=1000", "n=2",
                                 f"out={tmp_path / 'out.jsonl'}"],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=f,
                                env={**os.environ, "PYTHONPATH": str(ROOT),
                                     "PYTHONFAULTHANDLER": "1"})
    tail = lambda: err.read_text(errors="replace")[-6000:]  # noqa: E731

    def serving() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the rollout ended early ({proc.returncode}): {tail()}")
        logs = list(private_tmp.glob("agentgym-retriever-server-*/server.log"))
        return bool(logs) and "Application startup complete" in logs[0].read_text()

    try:
        wait_until(serving, 300, "the local retriever serving")
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:  # where it hangs: every thread's stack (faulthandler)
            proc.send_signal(signal.SIGABRT)
            proc.wait(timeout=60)
            raise AssertionError(f"no exit 120 s after SIGTERM; its threads:\n{tail()}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, tail()
    assert _leftovers(private_tmp) == []
    assert _live_with_tmpdir(private_tmp) == []
