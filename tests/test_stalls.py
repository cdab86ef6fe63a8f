"""No silent hangs (agentgym.supervision.watchdog): a stage past its deadline names itself, writes
every thread's stack, and then does what that stage's failure should do: an env step that
never returns ends its episode as an infrastructure failure (the run trains on without
it); a checkpoint write that never returns ends the run with the stage in the message,
and the resumed run ends as one that never stalled. The faults are injected (named
``…Fault`` / ``blocked_…``); the deadlines are seconds so the tests are quick."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agentgym import envs
from agentgym.supervision.watchdog import EXIT_STALLED, DeadlinesConfig, StageStalled, Watchdog
from agentgym.data.rows import write_jsonl
from toy_envs import STALL_RELEASE, STALLING_MAKES, letter_rows

ROOT = Path(__file__).resolve().parents[1]


def blocked_checkpoint_write(gate: threading.Event) -> None:
    gate.wait()


def test_a_stage_past_its_deadline_raises_in_its_thread_with_every_stack(tmp_path):
    watch = Watchdog(tmp_path, DeadlinesConfig(checkpoint_s=1.0, grace_s=60.0), poll_s=0.1)
    t0 = time.monotonic()
    try:
        with pytest.raises(StageStalled) as stalled:
            with watch.stage("checkpoint", 3):
                blocked_checkpoint_write(threading.Event())
        waited = time.monotonic() - t0
        beat = json.loads((tmp_path / "heartbeat.json").read_text())
    finally:
        watch.close("stalled")
    e = stalled.value
    assert (e.stage, e.step) == ("checkpoint", 3) and "deadlines.checkpoint_s=1" in str(e)
    assert 1.0 <= waited < 31.0  # after its deadline, and well before the grace ran out
    stack = e.stacks.read_text()
    assert e.stacks.parent == tmp_path / "stalls" and "blocked_checkpoint_write" in stack
    assert "Thread MainThread" in stack and "Thread watchdog" in stack
    assert beat["state"] == "stalled" and "checkpoint of step 3" in beat["stall"]
    assert beat["stages"] == []  # it unwound: the stage is over


def test_a_stall_file_holds_the_stacks_of_the_servers_this_process_started(
        tmp_path, tiny_path):
    """A server the run started (``agentgym serve`` here; the local retriever is started
    the same way) writes its threads' stacks into the stall's file when asked."""
    from agentgym.rollout.engines.launcher import launch_serve
    server = launch_serve(str(tiny_path))
    pid = server.pid
    watch = Watchdog(tmp_path, DeadlinesConfig(checkpoint_s=1.0), poll_s=0.1)
    try:
        with pytest.raises(StageStalled) as stalled:
            with watch.stage("checkpoint", 1):
                blocked_checkpoint_write(threading.Event())
        alive_after = server.alive
    finally:
        watch.close("stalled")
        server.stop()
    text = stalled.value.stacks.read_text()
    head = f"# service agentgym serve at {server.url} (pid {pid} on "
    assert head in text and alive_after  # asked for its stacks, not killed by the signal
    theirs = text.split(head)[1]
    assert "most recent call first" in theirs and "serve.py" in theirs


def test_a_long_stage_that_keeps_progressing_is_not_a_stall(tmp_path):
    watch = Watchdog(tmp_path, DeadlinesConfig(eval_s=2.0), poll_s=0.05)
    try:
        with watch.stage("eval", 0):
            end = time.monotonic() + 5.0  # more than twice its deadline, moving all along
            while time.monotonic() < end:
                watch.progress()
                time.sleep(0.05)
            beat = json.loads((tmp_path / "heartbeat.json").read_text())
    finally:
        watch.close()
    assert not (tmp_path / "stalls").exists()
    assert beat["state"] == "running" and beat["stages"][0]["stage"] == "eval"
    assert json.loads((tmp_path / "heartbeat.json").read_text())["state"] == "finished"


def test_a_stall_outside_the_main_thread_ends_the_process_after_its_grace(tmp_path):
    """A fatal stage in a thread no signal can interrupt: the process writes the message
    and exits with EXIT_STALLED once deadlines.grace_s has passed."""
    code = f"""
import threading
from agentgym.supervision.watchdog import DeadlinesConfig, Watchdog
watch = Watchdog({str(tmp_path)!r}, DeadlinesConfig(sync_s=1.0, grace_s=1.0), poll_s=0.1)
def blocked_weight_push():
    threading.Event().wait()
def push():
    with watch.stage("sync", 5):
        blocked_weight_push()
t = threading.Thread(target=push, name="pusher")
t.start()
t.join()
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == EXIT_STALLED, proc.stderr[-2000:]
    assert "the sync of step 5 made no progress" in proc.stderr
    (stack,) = (tmp_path / "stalls").glob("stall-step5-sync-*.txt")
    assert "blocked_weight_push" in stack.read_text() and "Thread pusher" in stack.read_text()


@pytest.fixture
def stalling_env():
    if "agentgym-test/StallingLetter-v0" not in envs.env_ids():
        envs.register_env("agentgym-test/StallingLetter-v0", "toy_envs:StallingLetterEnvFault")
    STALL_RELEASE.clear()
    yield "agentgym-test/StallingLetter-v0"
    STALL_RELEASE.set()  # the blocked env threads end with the test


def _letter_data(tmp_path, env: str, rows: list[dict]) -> Path:
    for r in rows:
        r["env"] = env
    data = tmp_path / "rows.jsonl"
    write_jsonl(data, rows)
    return data


def _train_on_letters(tmp_path, env: str, rows: list[dict], *keys: str) -> dict:
    """One step of two rows, two samples each, in this process; the step's metrics."""
    from agentgym.cli import main
    data = _letter_data(tmp_path, env, rows)
    run = tmp_path / "run"
    assert main(["train", f"env={env}", "model=tiny", f"data={data}",
                 "trainer.total_steps=1", "trainer.prompts_per_step=2", "n=2",
                 "rollout.max_tokens_per_turn=8", "trainer.eval_limit=0",
                 "deadlines.env_step_s=2", f"run_dir={run}", *keys]) == 0
    assert json.loads((run / "heartbeat.json").read_text())["state"] == "finished"
    (step,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return step


@pytest.mark.parametrize("where", ["stall", "stall_reset", "stall_reward"])
def test_an_env_call_that_never_returns_is_an_infra_failure_not_trained_on(
        tmp_path, stalling_env, where):
    """An env step, an env reset, or the reward function (``reward=``, run inside the
    env's last step) that never returns."""
    rows = letter_rows(2)
    rows[0]["extra_info"][where] = True
    reward = ["reward=toy_envs:reward_that_never_returns_fault"] * (where == "stall_reward")
    # four cuts at one site (below): more than deadlines.same_stall_limit's default
    step = _train_on_letters(tmp_path, stalling_env, rows, *reward,
                             "deadlines.same_stall_limit=5")
    # the stalled row's two episodes (each replayed once, stalling again) are left out;
    # the other row's two are trained on
    assert step["rollout/infra_failed"] == 2.0 and step["rollout/infra_dropped"] == 2.0
    call = {"stall": "step", "stall_reset": "reset", "stall_reward": "step"}[where]
    blocked = {"stall_reward": "reward_that_never_returns_fault"}.get(where, "stall_forever")
    (site,) = (tmp_path / "run" / "stalls").glob("stall-site-*.txt")  # one site, four cuts
    text = site.read_text()
    assert f"stall site: stall_forever (" in text and "# episodes cut: 4" in text
    assert text.count(f"env.{call} past deadlines.env_step_s=2") == 4 and blocked in text


def test_an_env_whose_construction_never_returns_is_replayed_on_a_new_one(tmp_path):
    """Two env constructions block forever: their episodes fail (written on the row's
    prompt, never played), are replayed on new envs, and all four are trained on."""
    if "agentgym-test/StallingMakeLetter-v0" not in envs.env_ids():
        envs.register_env("agentgym-test/StallingMakeLetter-v0",
                          "toy_envs:StallingMakeLetterEnvFault")
    STALL_RELEASE.clear()
    STALLING_MAKES[0] = 2
    try:
        step = _train_on_letters(tmp_path, "agentgym-test/StallingMakeLetter-v0",
                                 letter_rows(2))
    finally:
        STALL_RELEASE.set()
    assert STALLING_MAKES[0] == 0
    assert step["rollout/infra_failed"] == 2.0 and step["rollout/infra_dropped"] == 0.0
    (site,) = (tmp_path / "run" / "stalls").glob("stall-site-*.txt")
    text = site.read_text()  # the construction, blocked: one site, two cuts
    assert "# episodes cut: 2" in text and text.count("env.make past") == 2
    assert "in __init__" in text and "stall_forever" in text


def test_a_generation_that_never_returns_is_an_infra_failure_not_trained_on(
        tmp_path, stalling_env):
    from agentgym.cli import main
    from agentgym.rollout.engines.base import ENGINES
    if "stalling-letter-model-fault" not in ENGINES.names():
        ENGINES.register("stalling-letter-model-fault", "fakes:StallingLetterModelFault")
    data = tmp_path / "rows.jsonl"
    write_jsonl(data, letter_rows(2))  # "Write text #0." stalls in the engine
    run = tmp_path / "run"
    assert main(["train", "env=agentgym-test/Letter-v0", "model=tiny", f"data={data}",
                 "engine=stalling-letter-model-fault", "trainer.total_steps=1",
                 "trainer.prompts_per_step=2", "n=2", "rollout.max_tokens_per_turn=8",
                 "trainer.eval_limit=0", "deadlines.turn_s=2", "deadlines.same_stall_limit=5",
                 f"run_dir={run}"]) == 0
    (step,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert step["rollout/infra_failed"] == 2.0 and step["rollout/infra_dropped"] == 2.0
    (site,) = (run / "stalls").glob("stall-site-*.txt")  # the engine: one site, four cuts
    text = site.read_text()
    assert "stall site: generate (the rollout engine)" in text and "# episodes cut: 4" in text
    assert "blocked_engine_step" in text


def test_an_async_producer_whose_groups_stop_finishing_ends_the_run_from_its_own_watch(
        tmp_path, stalling_env, capsys):
    """trainer.mode=async: the group of the stalling row never finishes (its env step
    never returns; deadlines.env_step_s is left at its default). The producer thread's own
    watch writes the stacks (its thread and the blocked step among them) and the stall is
    raised in the trainer's thread: the CLI exits 3 naming the rollout stage."""
    from agentgym.cli import main
    rows = letter_rows(2)
    rows[0]["extra_info"]["stall"] = True
    data = _letter_data(tmp_path, stalling_env, rows)
    run = tmp_path / "run"
    assert main(["train", f"env={stalling_env}", "model=tiny", f"data={data}",
                 "trainer.mode=async", "trainer.total_steps=2", "trainer.prompts_per_step=2",
                 "n=2", "rollout.max_tokens_per_turn=8", "trainer.eval_limit=0",
                 "deadlines.rollout_s=3", f"run_dir={run}"]) == 3
    err = capsys.readouterr().err
    assert "the rollout of step 1 made no progress" in err and "trainer.resume=auto" in err
    texts = [p.read_text() for p in (run / "stalls").glob("stall-step1-rollout-*.txt")]
    assert texts and all("Thread async-rollout" in t and "stall_forever" in t for t in texts)
    assert json.loads((run / "heartbeat.json").read_text())["state"] == "stalled"


def test_status_reads_a_finished_run_and_refuses_a_folder_that_is_none(tmp_path, capsys):
    from agentgym.cli import main
    run = tmp_path / "run"
    data = tmp_path / "toy.jsonl"
    write_jsonl(data, letter_rows(4))
    assert main(["train", "env=agentgym-test/Letter-v0", "model=tiny", f"data={data}",
                 "trainer.total_steps=1", "trainer.prompts_per_step=2", "n=2",
                 "rollout.max_tokens_per_turn=8", "trainer.eval_limit=0",
                 f"run_dir={run}"]) == 0
    capsys.readouterr()
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"state     finished, pid {os.getpid()}" in out
    assert "metrics   step 1: rollout/reward" in out
    assert f"checkpoint {run / 'checkpoints' / 'step_1'}" in out
    assert main(["status", str(tmp_path)]) == 2
    assert "is not a run directory" in capsys.readouterr().err


def _train_args(tmp: Path, run: Path) -> list[str]:
    data = tmp / "toy.jsonl"
    if not data.exists():
        write_jsonl(data, letter_rows(16))
    return ["train", "env=agentgym-test/Letter-v0", "model=tiny", f"data={data}",
            "trainer.total_steps=3", "trainer.prompts_per_step=2", "n=4",
            "rollout.max_tokens_per_turn=8", "trainer.lr=1e-2", "trainer.eval_limit=0",
            "trainer.save_every=1", f"run_dir={run}"]


def _cli(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tests" / "cli_with_faults.py"), *args],
                          cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True,
                          text=True, timeout=900)


def _metrics(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "rollout/drift_"))
             and k not in ("rollout/generate_s", "rollout/env_s")} for r in rows]


@pytest.mark.parametrize("stage, fault, blocked", [
    ("checkpoint", "AGENTGYM_TEST_BLOCK_IN_SAVE", "blocked_checkpoint_write"),
    ("sync", "AGENTGYM_TEST_BLOCK_IN_PUSH", "blocked_weight_push")])
def test_a_checkpoint_write_or_weight_push_that_never_returns_ends_the_run_then_resume_matches(
        tmp_path, stage, fault, blocked):
    """Step 2's checkpoint write, or its push of policy version 2 to the engine, blocks
    forever (cli_with_faults.py)."""
    from agentgym.reporting.status import status_lines
    straight, run = tmp_path / "straight", tmp_path / "run"
    clean = _cli(_train_args(tmp_path, straight))
    assert clean.returncode == 0, clean.stderr[-3000:]
    stalled = _cli(_train_args(tmp_path, run) + [f"deadlines.{stage}_s=3"], env={fault: "2"})
    assert stalled.returncode == 3, stalled.stderr[-3000:]
    assert f"the {stage} of step 2 made no progress" in stalled.stderr
    assert "trainer.resume=auto" in stalled.stderr
    ckpts = run / "checkpoints"
    assert (ckpts / "step_1").is_dir() and not (ckpts / "step_2").exists()
    assert not (ckpts / "step_2.tmp").exists()  # a half-written one is gone
    (stack,) = (run / "stalls").glob(f"stall-step2-{stage}-*.txt")
    assert blocked in stack.read_text()
    report = "\n".join(status_lines(run))
    assert "state     stalled" in report and f"checkpoint {ckpts / 'step_1'}" in report
    resumed = _cli(_train_args(tmp_path, run) + ["trainer.resume=auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _metrics(run) == _metrics(straight)  # steps 1-3, as if it had never stalled


def test_a_rank_that_stops_answering_is_named_and_every_rank_ends(tmp_path):
    """FSDP2 over two gloo ranks; rank 1 is not sent step 2's update, so rank 0 waits in
    its collectives. The update's deadline ends the run naming rank 1, every rank's stack
    (faulthandler's) is in the stall file, and no rank process is left; the resumed run
    ends as one that never stalled."""
    straight, run = tmp_path / "straight", tmp_path / "run"
    fsdp = ["trainer.backend=fsdp", "trainer.nprocs=2"]
    args = _train_args(tmp_path, run) + fsdp + ["deadlines.update_s=10"]
    stalled = _cli(args, env={"AGENTGYM_TEST_SILENT_RANK": "1:2"})
    assert stalled.returncode == 3, stalled.stderr[-3000:]
    assert "the update of step 2 made no progress" in stalled.stderr
    assert "rank 1 (pid" in stalled.stderr and "had not answered" in stalled.stderr
    (stack,) = (run / "stalls").glob("stall-step2-update-*.txt")
    text = stack.read_text()
    assert "# rank 0 (pid" in text and "# rank 1 (pid" in text
    assert "did not answer the call in flight" in text
    rank0 = text.split("# rank 0 (pid")[1].split("# rank 1 (pid")[0]
    assert "train_step" in rank0  # rank 0 is inside the update, waiting on rank 1
    import re
    pids = [int(p) for p in re.findall(r"# rank \d \(pid (\d+)", text)]
    assert len(pids) == 2
    for pid in pids:  # both rank processes were stopped with the run
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert (run / "checkpoints" / "step_1").is_dir()
    resumed = _cli(_train_args(tmp_path, run) + fsdp + ["trainer.resume=auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    clean = _cli(_train_args(tmp_path, straight) + fsdp)
    assert clean.returncode == 0, clean.stderr[-3000:]
    assert _metrics(run) == _metrics(straight)  # steps 1-3, as if it had never stalled


def test_a_ray_rank_that_stops_answering_is_named_and_every_rank_ends(
        tmp_path, retriever_url, monkeypatch):
    """FSDP2 over two rank actors of a local Ray; rank 1's process is stopped (SIGSTOP)
    before step 2's update, so rank 0 waits in its collectives. The update's deadline ends
    the run naming the ranks that had not answered; rank 0's stacks are in the stall
    file; every rank actor is gone."""
    pytest.importorskip("ray")
    import signal

    from agentgym.config import build_config
    from agentgym.core.overrides import parse_overrides
    from agentgym.trainers.loop import train
    from agentgym.trainers.ray_cluster import RayRanks

    calls, stopped = {"train_step": 0}, []
    real_call = RayRanks.call

    def call_with_rank_1_stopped_fault(self, method, args_per_rank):
        if method == "train_step":
            calls[method] += 1
            if calls[method] == 2:
                pid, _ = self.where[1]
                os.kill(pid, signal.SIGSTOP)  # a rank process that stopped answering
                stopped.append(pid)
        return real_call(self, method, args_per_rank)
    monkeypatch.setattr(RayRanks, "call", call_with_rank_1_stopped_fault)
    run = tmp_path / "run"
    cfg = build_config(parse_overrides([
        "env=search", "model=tiny", "trainer.total_steps=3", "trainer.prompts_per_step=2",
        "n=2", "rollout.max_tokens_per_turn=16", "rollout.max_response_tokens=128",
        "trainer.eval_limit=0", "trainer.cold_start=off", "algo.entropy_coef=0.001",
        "backend=fsdp", "trainer.nprocs=2", "ray.address=local", "ray.cpus=0.5",
        "deadlines.update_s=10", f"retriever.url={retriever_url}", f"run_dir={run}"]))
    with pytest.raises(StageStalled) as stalled:
        train(cfg)
    message = str(stalled.value)
    assert "the update of step 2 made no progress" in message
    assert "rank 1 (pid" in message and "had not answered" in message
    (stack,) = (run / "stalls").glob("stall-step2-update-*.txt")
    text = stack.read_text()
    assert "# rank 0 (pid" in text and "# rank 1 (pid" in text
    rank0 = text.split("# rank 0 (pid")[1].split("# rank 1 (pid")[0]
    assert "train_step" in rank0  # rank 0 is inside the update, waiting on rank 1
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and Path(f"/proc/{stopped[0]}").exists():
        time.sleep(0.2)  # ray.kill, then Ray's shutdown, end the stopped actor
    assert not Path(f"/proc/{stopped[0]}").exists()


def test_a_signal_inside_a_deferred_block_reaches_its_handler_when_the_block_ends():
    """``signals_deferred``: a SIGTERM (a handler of the caller's) and a Ctrl-C (Python's
    own) that arrive inside the block reach their handlers after its last line, not in the
    middle; the handlers in place before are back afterwards. A Ctrl-C the process ignores
    (a shell starts a background job with SIGINT ignored, and Python then installs no
    handler of its own) stays ignored. The test sets both dispositions itself: it must not
    depend on how the shell that started pytest left SIGINT."""
    import signal

    from agentgym.supervision.watchdog import signals_deferred
    seen, handled = [], []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: handled.append(seen[:]))
    before_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with signals_deferred():
            signal.raise_signal(signal.SIGTERM)
            seen.extend(range(1000))  # work after the signal, done whole
        assert handled == [list(range(1000))]
        with pytest.raises(KeyboardInterrupt):
            with signals_deferred():
                signal.raise_signal(signal.SIGINT)
                seen.append("the last line")
        assert seen[-1] == "the last line"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with signals_deferred():
            signal.raise_signal(signal.SIGINT)
            seen.append("ignored")
        assert seen[-1] == "ignored"
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)
        signal.signal(signal.SIGINT, before_int)
