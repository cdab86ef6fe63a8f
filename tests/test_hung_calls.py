"""A hung env call does not hang the run (agentgym.supervision.daemon_pool, agentgym.supervision.stalls):
a call given up on frees its worker (its thread retired and replaced, or its processes
killed), the same stall site cutting ``deadlines.same_stall_limit`` episodes in a row ends
the run at once naming the function and line, and each site has one stack file with its
count. The hangs are injected (tests/hang_faults.py: a reward that sleeps, one that spins
the CPU, one that deadlocks on a lock; agents that never return); deadlines are seconds."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import hang_faults
from sandbox_probes import make  # noqa: F401 (a fixture)
from agentgym.supervision.daemon_pool import DaemonPool, killable_process_group
from agentgym.supervision.watchdog import DeadlinesConfig, Watchdog
from agentgym.data.rows import write_jsonl
from toy_envs import letter_rows

ROOT = Path(__file__).resolve().parents[1]
FAULTS = ROOT / "tests" / "hang_faults.py"


@pytest.fixture
def faults():
    hang_faults.arm()
    yield hang_faults
    hang_faults.release()  # no thread of this process stays spinning or blocked


def _rows(tmp_path: Path, n: int, hang: set[int], env: str = "") -> Path:
    rows = letter_rows(n)
    for i, row in enumerate(rows):
        row["extra_info"]["hang"] = i in hang
        row["env"] = env or row["env"]
    data = tmp_path / "rows.jsonl"
    write_jsonl(data, rows)
    return data


def _train_args(data: Path, run: Path, *keys: str) -> list[str]:
    return ["train", "env=agentgym-test/Letter-v0", "model=tiny", f"data={data}",
            "trainer.total_steps=1", "trainer.prompts_per_step=2", "n=2",
            "rollout.max_tokens_per_turn=8", "trainer.eval_limit=0",
            "deadlines.env_step_s=2", f"run_dir={run}", *keys]


def _ended(pid: int) -> bool:
    """Whether process ``pid`` has exited (gone, or a zombie its parent has not reaped)."""
    try:
        return "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True


def _first_cut_time(site_file: Path) -> float:
    """When the site's first listed cut happened (its line's time stamp)."""
    line = site_file.read_text().splitlines()[2]
    return time.mktime(time.strptime(line[4:23], "%Y-%m-%d %H:%M:%S"))


def test_a_call_given_up_on_frees_its_worker_and_one_with_processes_is_killed():
    """The pool keeps its size: after one call is left stuck, both workers still meet at a
    barrier; a call whose work runs in its own process group is killed, not left behind."""
    pool = DaemonPool(2, thread_name_prefix="test-pool")
    gate = threading.Event()

    def in_a_process():
        proc = subprocess.Popen(["sleep", "1000"], start_new_session=True)
        with killable_process_group(proc.pid):
            return proc.wait()
    try:
        stuck, killable = pool.submit(gate.wait), pool.submit(in_a_process)
        deadline = time.monotonic() + 60
        while not (pool.owns_processes(killable) and pool.running(stuck)):
            assert time.monotonic() < deadline, "the calls did not start"
            time.sleep(0.01)
        assert pool.give_up(stuck) == "abandoned" and pool.give_up(killable) == "killed"
        assert killable.result(timeout=60) == -9  # SIGKILL: its call returned
        assert pool.stuck == 1
        barrier = threading.Barrier(2)
        met = [pool.submit(barrier.wait, 60) for _ in range(2)]
        assert sorted(f.result(timeout=90) for f in met) == [0, 1]  # two workers, both free
    finally:
        gate.set()
        pool.shutdown()
    deadline = time.monotonic() + 60
    while pool.stuck and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.stuck == 0  # the retired thread left once its call returned
    assert not [t for t in threading.enumerate() if t.name.startswith("test-pool")]


def test_a_close_while_the_run_ends_does_not_wait_for_a_worker():
    """Every worker is held by a call not yet past its deadline: a close with a limit
    (an episode ending with the run) gives up after the limit, counted from its
    submission, instead of waiting for a worker to free."""
    from agentgym.rollout.manager import CallStalled, pool_call
    pool, gate = DaemonPool(1, thread_name_prefix="test-busy"), threading.Event()
    try:
        busy = pool.submit(gate.wait)
        with pytest.raises(CallStalled):  # (a TimeoutError here: it waited for a worker)
            asyncio.run(asyncio.wait_for(pool_call(pool, DeadlinesConfig(), "close", "e",
                                                   print, limit=0.5), 60))
        assert not busy.done()  # it still holds the only worker: the close never ran
    finally:
        gate.set()
        pool.shutdown()


@pytest.mark.parametrize("fault", ["reward_that_spins_fault", "reward_that_deadlocks_fault"])
def test_a_reward_that_keeps_hanging_ends_the_run_at_once_naming_its_line(
        tmp_path, faults, capsys, fault):
    """Every episode's reward hangs (the other deadlines at their 3600 s defaults), six
    episodes on two env workers: the third cut at the same site ends the run with the
    stalled stage's exit status, though calls not yet past their deadline hold every
    worker by then."""
    from agentgym.cli import main
    data, run = _rows(tmp_path, 3, {0, 1, 2}), tmp_path / "run"
    assert main(_train_args(data, run, f"reward=hang_faults:{fault}",
                            "trainer.prompts_per_step=3", "rollout.env_workers=2")) == 3
    ended = time.time()
    err = capsys.readouterr().err
    (site_file,) = (run / "stalls").glob("stall-site-*.txt")
    text = site_file.read_text()
    assert f"{fault} ({FAULTS}, line " in err and "hung 3 episodes in a row" in err
    assert "the rollout of step 1" in err and "trainer.resume=auto" in err
    assert f"stall site: {fault} ({FAULTS}, line" in text
    assert ended - _first_cut_time(site_file) < 2 + 30  # env_step_s + 30 s
    assert json.loads((run / "heartbeat.json").read_text())["state"] == "stalled"


def test_a_reward_that_sleeps_ends_the_run_then_resume_continues_after_the_fix(tmp_path):
    """A user's reward module in the working directory (``time.sleep(10_000)``), in a
    process of its own as a user runs it: exit 3 naming hang_reward.py and its line,
    ``agentgym status`` reads the stalls; after the fix, ``trainer.resume=auto`` trains."""
    from agentgym.reporting.status import status_lines
    user = tmp_path / "hang_reward.py"
    user.write_text("import time\n\ndef score(data_source, solution_str, ground_truth, "
                    "extra_info=None):\n    time.sleep(10_000)\n    return 1.0\n")
    data, run = _rows(tmp_path, 2, set()), tmp_path / "run"

    def cli(*keys):
        return subprocess.run([sys.executable, str(ROOT / "tests" / "cli_with_faults.py"),
                               *_train_args(data, run, "reward=hang_reward:score", *keys)],
                              cwd=tmp_path, capture_output=True, text=True, timeout=600)
    stalled = cli()
    ended = time.time()  # the process has exited, its sleeping threads with it
    assert stalled.returncode == 3, stalled.stderr[-3000:]
    assert f"score ({user}, line 4)" in stalled.stderr
    (site_file,) = (run / "stalls").glob("stall-site-*.txt")
    assert ended - _first_cut_time(site_file) < 2 + 30  # env_step_s + 30 s
    report = "\n".join(status_lines(run))
    assert "state     stalled" in report and "stalls    1 site(s) cut" in report
    assert f"score ({user}, line 4): " in report
    user.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return 1.0\n")  # the user's fix
    resumed = cli("trainer.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (step,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert step["rollout/reward"] == 1.0
    assert json.loads((run / "heartbeat.json").read_text())["state"] == "finished"


def test_a_stall_not_repeated_leaves_a_full_pool_and_one_file_with_its_count(
        tmp_path, faults, capsys):
    """One row of three hangs in its reward (its two episodes and their two replays: four
    cuts); with deadlines.same_stall_limit=5 the run trains on the rest. One file for the
    site, counting four; every env worker is free afterwards (all meet at a barrier)."""
    from agentgym.cli import main
    from agentgym.config import build_config
    from agentgym.core.overrides import parse_overrides
    from agentgym.rollout.runtime import build_manager
    data, run = _rows(tmp_path, 3, {0}), tmp_path / "run"
    keys = ["reward=hang_faults:reward_that_deadlocks_fault", "deadlines.same_stall_limit=5",
            "trainer.prompts_per_step=3"]
    assert main(_train_args(data, run, *keys)) == 0
    (site_file,) = (run / "stalls").glob("stall-site-*.txt")
    text = site_file.read_text()
    assert "# episodes cut: 4" in text and text.count("env.step past") == 4
    assert text.count("Thread MainThread") == 1  # the first cut's dump, once
    (step,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert step["rollout/infra_failed"] == 2.0 and step["rollout/infra_dropped"] == 2.0
    capsys.readouterr()
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert "stalls    1 site(s) cut 4 episode(s)" in out
    assert f"reward_that_deadlocks_fault ({FAULTS}, line " in out

    cfg = build_config(parse_overrides([f"data={data}", "env=agentgym-test/Letter-v0",
                                        "model=tiny", "rollout.env_workers=2",
                                        "rollout.max_tokens_per_turn=8", *keys[:2],
                                        "deadlines.env_step_s=2",
                                        "rollout.on_infra_error=drop"]))
    manager, engine, _ = build_manager(cfg)
    watch = Watchdog(tmp_path / "direct", cfg.deadlines)
    try:
        rows = [json.loads(x) for x in data.read_text().splitlines()]
        trajs = engine.run(manager.run(rows, n=1))
        assert [t.metrics["infra_failures"] for t in trajs] == [1.0, 0.0, 0.0]
        barrier = threading.Barrier(2)
        met = [manager._pool.submit(barrier.wait, 60) for _ in range(2)]
        assert sorted(f.result(timeout=90) for f in met) == [0, 1]
    finally:
        watch.close()
        manager.close()
        engine.close()


def test_more_calls_left_in_their_threads_than_max_abandoned_end_the_run(
        tmp_path, faults, capsys):
    """One row of three deadlocks in its reward; the same-site limit is out of reach, but
    the third thread left in a call passes deadlines.max_abandoned=2."""
    from agentgym.cli import main
    data, run = _rows(tmp_path, 3, {0}), tmp_path / "run"
    assert main(_train_args(data, run, "reward=hang_faults:reward_that_deadlocks_fault",
                            "deadlines.same_stall_limit=10", "deadlines.max_abandoned=2",
                            "trainer.prompts_per_step=3")) == 3
    err = capsys.readouterr().err
    assert "3 calls given up on are still running in their threads, more than " \
           "deadlines.max_abandoned=2" in err
    assert f"reward_that_deadlocks_fault ({FAULTS}, line " in err and "reward_process" in err


def test_an_async_run_whose_groups_keep_hanging_ends_with_the_site(tmp_path, faults, capsys):
    from agentgym.cli import main
    data, run = _rows(tmp_path, 2, {0, 1}), tmp_path / "run"
    assert main(_train_args(data, run, "reward=hang_faults:reward_that_spins_fault",
                            "trainer.mode=async", "trainer.total_steps=2")) == 3
    err = capsys.readouterr().err
    assert f"reward_that_spins_fault ({FAULTS}, line " in err and "in a row" in err


@pytest.mark.parametrize("agent", ["agent_that_hangs_fault", "async_agent_that_hangs_fault"])
def test_an_agent_that_never_returns_is_cut_by_its_deadline(tmp_path, faults, tiny_model,
                                                            tiny_tokenizer, agent):
    """env=agent: one episode's program hangs after its first call, the other returns.
    The hung one is cut after deadlines.env_step_s, counted, and recorded by its site."""
    pytest.importorskip("openai")
    from agentgym.config import build_config
    from agentgym.rollout.engines.hf import HFEngine
    from agentgym.serving.agents import AgentManager
    cfg = build_config({"env": "agent", "agent": f"hang_faults:{agent}", "model": "tiny",
                        "deadlines.env_step_s": 2, "rollout.max_tokens_per_turn": 4})
    rows = letter_rows(2)
    rows[0]["extra_info"]["hang"] = True
    engine = HFEngine(tiny_model, tiny_tokenizer)
    watch = Watchdog(tmp_path, cfg.deadlines)
    manager = AgentManager(engine, tiny_tokenizer, cfg)
    try:
        trajs = engine.run(manager.run(rows, n=1))
        stats = manager.take_stats()
    finally:
        watch.close()
        manager.close()
        engine.close()
    assert [t.uid for t in trajs] == ["1"] and stats["agent/stalled"] == 1.0
    (site_file,) = (tmp_path / "stalls").glob("stall-site-*.txt")
    text = site_file.read_text()
    assert f"stall site: {agent} ({FAULTS}, line" in text and "agent past" in text


def test_a_ray_rollout_workers_stalls_reach_the_drivers_run(tmp_path, faults, monkeypatch):
    """A row whose reward hangs on a Ray rollout worker: its site's file, written from the
    worker's cuts, is in the driver's run_dir/stalls, and the run trains on the rest."""
    pytest.importorskip("ray")
    from agentgym.cli import main
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"),
                                                      os.environ.get("PYTHONPATH", "")]))
    data, run = _rows(tmp_path, 3, {0}, env="toy_envs:LetterEnv"), tmp_path / "run"
    args = _train_args(data, run, "reward=hang_faults:reward_that_sleeps_fault",
                       "deadlines.same_stall_limit=5", "trainer.prompts_per_step=3",
                       "ray.address=local", "ray.cpus=0.5")
    # the env by its module (the workers import it; the test's registration is this
    # process's)
    assert main([a if not a.startswith("env=") else "env=toy_envs:LetterEnv"
                 for a in args]) == 0
    (site_file,) = (run / "stalls").glob("stall-site-*.txt")
    text = site_file.read_text()
    assert "# episodes cut: 4" in text and "reward_that_sleeps_fault" in text
    assert "Thread " in text.split("the first cut's whole dump")[1]  # the worker's stacks


@pytest.mark.parametrize("session", [None, "cell"])
def test_an_env_call_waiting_on_a_sandbox_cell_is_killed_not_left_behind(make, session):
    """A code cell that outlasts the env call's deadline (the sandbox's own wall_s is
    longer): giving up on the call kills the cell's process group (a session's worker
    too), so the call returns at once and no thread is left in it."""
    from sandbox_probes import wait_present
    sb = make(wall_s=300)
    pool = DaemonPool(1, thread_name_prefix="test-sandbox")
    try:
        call = pool.submit(sb.run_sync, "import os, time\nos.execv('/bin/sleep', "
                           "['agentgym-hung-cell', '1000'])", session)
        assert wait_present("agentgym-hung-cell")
        assert pool.owns_processes(call)
        assert pool.give_up(call) == "killed"
        result = call.result(timeout=60)  # the cell, killed: its result comes back
        assert not result.ok and pool.stuck == 0
        assert pool.submit(sum, [1, 2]).result(timeout=60) == 3  # the pool works on
    finally:
        pool.shutdown()


def test_a_reward_in_a_process_of_its_own_is_killed_when_it_hangs(tmp_path, faults):
    """reward_process=true: the hanging row's reward runs in a child process, which each
    cut kills (the site file says so, naming the function), leaving no thread behind; the
    other rows' rewards come back from their processes."""
    from agentgym.cli import main
    data, run = _rows(tmp_path, 3, {0}), tmp_path / "run"
    assert main(_train_args(data, run, "reward=hang_faults:reward_that_sleeps_fault",
                            "reward_process=true", "deadlines.same_stall_limit=5",
                            "trainer.prompts_per_step=3")) == 0
    (site_file,) = (run / "stalls").glob("stall-site-*.txt")
    text = site_file.read_text()
    assert f"stall site: reward_that_sleeps_fault ({FAULTS}, line" in text
    assert "# episodes cut: 4" in text and text.count("its processes killed") == 4
    (step,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    # the other rows' four episodes got 0.5 each, from their processes; the two cut, 0
    assert step["rollout/reward"] == pytest.approx(0.5 * 4 / 6)
    deadline = time.monotonic() + 60  # the killed calls' threads return and exit
    while [t for t in threading.enumerate() if t.name.startswith("env_")]:
        assert time.monotonic() < deadline, "a thread was left in a killed reward's call"
        time.sleep(0.05)


def test_a_call_in_a_process_keeps_its_child_answers_errors_and_prints_aside():
    """In a thread of its own, whose child ends with it."""
    from agentgym.supervision.process_call import ProcessCallError, call_in_process
    seen: dict = {}

    def calls():
        child = seen["first"] = call_in_process(os.getpid)
        assert child != os.getpid() and call_in_process(os.getpid) == child  # one, kept
        assert call_in_process(print, "to stderr, not into the answers") is None
        with pytest.raises(ProcessCallError, match="ValueError: invalid literal"):
            call_in_process(int, "x")
        assert call_in_process(sum, [1, 2]) == 3  # the child works on after an error
        os.kill(child, 9)
        deadline = time.monotonic() + 60  # dead (a zombie until its parent reaps it)
        while not _ended(child):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        seen["second"] = call_in_process(os.getpid)  # a new one took its place
        seen["ok"] = True
    caller = threading.Thread(target=calls)
    caller.start()
    caller.join(timeout=120)
    assert seen.get("ok") and seen["second"] not in (seen["first"], os.getpid())
    import gc
    deadline = time.monotonic() + 60  # the thread is gone: its child's stdin closed
    while not _ended(seen["second"]):
        assert time.monotonic() < deadline, "the thread's child outlived it"
        gc.collect()
        time.sleep(0.05)
