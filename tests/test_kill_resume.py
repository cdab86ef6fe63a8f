"""A training run killed with SIGKILL (at a random step, or in the middle of saving a
checkpoint) and resumed with ``trainer.resume=auto`` logs the same metrics, step for
step, as an uninterrupted run: single, FSDP2 and DeepSpeed backends, CPU, fixed seeds."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agentgym.data.rows import write_jsonl
from conftest import wait_until
from toy_envs import letter_rows

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
BACKENDS = {"single": [], "fsdp": ["trainer.backend=fsdp", "trainer.nprocs=2"],
            "deepspeed": ["trainer.backend=deepspeed", "trainer.nprocs=2",
                          "trainer.zero_stage=3"]}


def _args(tmp: Path, run: Path, backend: str) -> list[str]:
    data = tmp / "toy.jsonl"
    if not data.exists():
        write_jsonl(data, letter_rows(16))
    return ["train", "env=agentgym-test/Letter-v0", "model=tiny", f"data={data}",
            f"trainer.total_steps={STEPS}", "trainer.prompts_per_step=2", "n=4",
            "rollout.max_tokens_per_turn=8", "trainer.lr=1e-2", "trainer.eval_limit=0",
            "trainer.save_every=1", f"run_dir={run}", *BACKENDS[backend]]


def _start(args: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "tests" / "cli_with_faults.py"), *args],
                            cwd=ROOT, env={**os.environ, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _metrics(run: Path) -> list[dict]:
    f = run / "metrics.jsonl"
    if not f.exists():
        return []
    rows = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    # Compared exactly: everything but timings (clock readings) and the engine/trainer
    # logprob drift, whose 1e-7 noise depends on how the engine happened to batch the
    # requests (left padding; timing-dependent). The drift is bounded instead.
    for r in rows:
        assert r.get("rollout/drift_max", 0.0) < 1e-4, r
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "rollout/drift_"))
             and k not in ("rollout/generate_s", "rollout/env_s")} for r in rows]


def _logged_steps(run: Path) -> list[int]:
    """The steps in ``metrics.jsonl`` so far, read while the run appends to it: the line
    being written may be there only in part (no newline yet), and is not read."""
    f = run / "metrics.jsonl"
    text = f.read_text() if f.exists() else ""
    complete = text[:text.rfind("\n") + 1]
    return [json.loads(x)["step"] for x in complete.splitlines() if x.strip()]


def _finish(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The metrics of an uninterrupted run per backend; the three runs start together
    (their start-up is mostly imports, which the two cores overlap)."""
    tmp = tmp_path_factory.mktemp("straight")
    procs = {b: _start(_args(tmp, tmp / b, b)) for b in BACKENDS}
    for proc in procs.values():
        _finish(proc)
    return {b: _metrics(tmp / b) for b in BACKENDS}


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_sigkill_at_a_random_step_then_resume(tmp_path, uninterrupted, backend):
    k = random.randint(1, STEPS - 1)  # killed once step k is logged: during step k + 1
    run = tmp_path / "run"
    proc = _start(_args(tmp_path, run, backend))

    def reached_k() -> bool:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        return any(step >= k for step in _logged_steps(run))
    wait_until(reached_k, 600, "the run reaching the kill step")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    _finish(_start(_args(tmp_path, run, backend)))  # trainer.resume=auto is the default
    got = _metrics(run)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), f"killed after step {k}"
    assert got == uninterrupted[backend], f"killed after step {k}"


@pytest.mark.parametrize("backend", ["single", pytest.param("fsdp", marks=pytest.mark.slow),
                                     pytest.param("deepspeed", marks=pytest.mark.slow)])
def test_sigkill_during_a_save_then_resume(tmp_path, uninterrupted, backend):
    run = tmp_path / "run"
    proc = _start(_args(tmp_path, run, backend), env={"AGENTGYM_TEST_KILL_IN_SAVE": "2"})
    proc.communicate(timeout=600)
    assert proc.returncode == -signal.SIGKILL
    ckpts = run / "checkpoints"
    assert (ckpts / "step_2.tmp").is_dir() and not (ckpts / "step_2").exists()
    assert not (ckpts / "step_2.tmp" / "state.json").exists()  # not marked complete
    _finish(_start(_args(tmp_path, run, backend)))
    got = _metrics(run)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert got == uninterrupted[backend]
    assert not (ckpts / "step_2.tmp").exists()  # the leftover was replaced


def test_a_set_up_that_fails_after_the_ranks_started_ends_them(tmp_path):
    """``trainer.resume`` naming a checkpoint that is not there fails after the FSDP2 rank
    processes started: the error is raised and the ranks end with it, not with this
    process (a notebook or a sweep calling train() goes on)."""
    import psutil

    from agentgym.config import build_config
    from agentgym.core.overrides import parse_overrides
    from agentgym.trainers.loop import train
    from agentgym.trainers.checkpoints import CheckpointError
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    missing = tmp_path / "no_such_checkpoint"
    cfg = build_config(parse_overrides(_args(tmp_path, tmp_path / "run", "fsdp")[1:]
                                       + [f"trainer.resume={missing}"]))
    with pytest.raises(CheckpointError, match="no_such_checkpoint"):
        train(cfg)

    def ranks_ended() -> bool:
        return not [p for p in psutil.Process().children(recursive=True)
                    if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]
    wait_until(ranks_ended, 60, "the rank processes to end")
