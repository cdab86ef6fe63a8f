"""The fault suite's checkpoints: what a run resumes from after a kill, a full disk or a
damaged file (issue 33). Every test injects one fault into real components.

The CLI runs in a subprocess as tests/test_kill_resume.py runs it, whose helpers these
tests reuse; a real full disk is a small tmpfs, which needs root (skipped otherwise): a
SIGKILL half-way through a save, a disk that fills during one, and a damaged checkpoint
file. After each the run resumes from the newest checkpoint that is whole, or stops with
an error that names the path and what to do. A ``metrics.jsonl`` line cut by a kill is
dropped on resume. The services' faults are in tests/test_faults.py."""

from __future__ import annotations

import errno
import logging
import random
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from test_kill_resume import _args, _metrics, _start

from agentgym.models.zoo import load_model
from agentgym.trainers.backends.single import SingleBackend
from agentgym.trainers.checkpoints import (CheckpointError, checkpoint_state, latest_checkpoint,
                                           resume, rng_state, save_checkpoint, set_rng_state)


def test_a_metrics_line_cut_by_a_kill_is_dropped_on_resume(tmp_path):
    from agentgym.reporting.metrics import MetricsLogger
    run = tmp_path / "run"
    log = MetricsLogger(run)
    log.log(1, {"rollout/reward": 0.5})
    log.log(2, {"rollout/reward": 0.25})
    log.close()
    with open(run / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"step": 3, "rollout/rew')  # SIGKILL in the middle of step 3's line
    again = MetricsLogger(run, resume_step=2)  # the resume from checkpoint step 2
    assert [r["step"] for r in again.history()] == [1, 2]
    again.close()
    (run / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not JSON"):
        MetricsLogger(run, resume_step=3)  # a broken line mid-file is not a cut: say so


# ---- checkpoints ------------------------------------------------------------------------
def _backend(tiny_path) -> SingleBackend:
    return SingleBackend(load_model(tiny_path), lr=1e-2)


def _weights(backend: SingleBackend) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in backend.model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _contents(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garble(path: Path) -> None:
    """The same number of bytes, none of them right (so the size check passes)."""
    path.write_bytes(random.Random(0).randbytes(path.stat().st_size))


def _run(tmp: Path, run: Path, *overrides: str, backend: str = "single"
         ) -> subprocess.CompletedProcess:
    proc = _start(_args(tmp, run, backend) + list(overrides))
    _, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", err)


@pytest.fixture
def keep_rng():
    """resume() sets this process's RNGs from the checkpoint; put them back after."""
    saved = rng_state()
    yield
    set_rng_state(saved)


@pytest.fixture
def tmpfs():
    """``mount(folder, size_bytes)``: a tmpfs of that size at ``folder`` (a disk that
    really fills), unmounted at teardown; ``mount.resize(folder, size_bytes)``."""
    mounted: list[Path] = []

    def call(*args: str) -> None:
        try:
            r = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=60)
        except FileNotFoundError:
            pytest.skip("no mount command: a real full disk needs a tmpfs mount")
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs (needs root): {r.stderr.strip()}")

    def mount(folder: Path, size: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        call("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder))
        mounted.append(folder)

    mount.resize = lambda folder, size: call("-o", f"remount,size={size}", str(folder))
    yield mount
    for folder in reversed(mounted):
        subprocess.run(["umount", str(folder)], check=True, timeout=60)


# --- 1. SIGKILL half-way through writing a checkpoint --------------------------------

def test_sigkill_mid_save_leaves_the_previous_checkpoint_to_resume(tmp_path, tiny_path,
                                                                    keep_rng):
    run, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    # killed after the backend wrote step 2's weights and optimizer state
    # (tests/cli_with_faults.py), before state.json and the rename
    proc = _start(_args(tmp_path, run, "single"), env={"AGENTGYM_TEST_KILL_IN_SAVE": "2"})
    proc.communicate(timeout=600)
    assert proc.returncode == -signal.SIGKILL
    assert (ckpts / "step_2.tmp" / "model.safetensors").is_file()  # half-way indeed
    assert not (ckpts / "step_2.tmp" / "state.json").exists()
    assert latest_checkpoint(run) == ckpts / "step_1"
    backend = _backend(tiny_path)
    assert resume("auto", run, backend)["step"] == 1  # the previous checkpoint loads
    on_disk = SingleBackend(load_model(ckpts / "step_1"))
    assert _same(_weights(backend), _weights(on_disk))

    done = _run(tmp_path, run, "log_level=INFO")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {ckpts / 'step_1'} at step 1" in done.stderr
    assert [r["step"] for r in _metrics(run)] == [1, 2, 3]
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_1", "step_2", "step_3"]


# --- 2. the disk fills during a checkpoint -------------------------------------------

@pytest.mark.parametrize("backend", ["single", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_disk_full_during_a_save_stops_with_a_clear_error(tmp_path, tmpfs, tiny_path,
                                                         keep_rng, backend):
    run, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    tmpfs(ckpts, 64 * 2**20)
    first = _run(tmp_path, run, "trainer.total_steps=1", backend=backend)
    assert first.returncode == 0, first.stderr[-3000:]
    step_1 = _contents(ckpts / "step_1")
    size = sum(map(len, step_1.values()))
    tmpfs.resize(ckpts, shutil.disk_usage(ckpts).used + size // 2)  # half a checkpoint free

    second = _run(tmp_path, run, "trainer.total_steps=2", backend=backend)
    assert second.returncode == 2, second.stderr[-3000:]
    assert "Traceback" not in second.stderr
    # the CLI's one-line error (after a progress bar's carriage return, maybe)
    error = re.search(r"agentgym train: error: (.*)", second.stderr).group(1)
    assert error.startswith(f"no space left on device writing checkpoint step_2 to {ckpts}: "
                            ), error
    needed, free = map(float, re.search(r"about ([\d.]+) MiB needed, ([\d.]+) MiB free",
                                        error).groups())
    assert needed > free and abs(needed - size / 2**20) < 0.1, error
    assert "run_dir=" in error
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_1"]  # step_2.tmp removed
    assert _contents(ckpts / "step_1") == step_1
    if backend == "single":  # (an fsdp checkpoint loads into fsdp ranks only)
        assert resume("auto", run, _backend(tiny_path))["step"] == 1


def test_disk_full_at_the_first_save(tmp_path, tmpfs, tiny_path, tiny_tokenizer):
    run = tmp_path / "run"
    tmpfs(run / "checkpoints", 64 * 2**10)  # not even the weights fit
    backend = _backend(tiny_path)
    with pytest.raises(CheckpointError, match=r"no space left on device writing checkpoint "
                       r"step_1 to .*: about 0\.\d MiB needed") as e:
        save_checkpoint(run, 1, backend, tiny_tokenizer)
    assert e.value.errno == errno.ENOSPC
    assert list((run / "checkpoints").iterdir()) == []


# --- 3. a damaged checkpoint file -----------------------------------------------------

@pytest.mark.parametrize("backend, file", [
    ("single", "model.safetensors"),
    pytest.param("fsdp", "fsdp/__0_0.distcp", marks=pytest.mark.slow)])
def test_damaged_latest_checkpoint_auto_resumes_from_the_one_before(tmp_path, backend, file):
    run, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    first = _run(tmp_path, run, "trainer.total_steps=2", backend=backend)
    assert first.returncode == 0, first.stderr[-3000:]
    bad = ckpts / "step_2" / file  # a file this backend's load reads
    _truncate(bad)

    done = _run(tmp_path, run, "log_level=INFO", backend=backend)  # resume=auto, 3 steps
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(rf"WARNING agentgym\.trainers\.checkpoints: checkpoint file "
                     rf"{re.escape(str(bad))} is \d+ "
                     rf"bytes; it was \d+ bytes when saved", done.stderr), done.stderr[-3000:]
    assert f"resumed from {ckpts / 'step_1'} at step 1" in done.stderr
    assert [r["step"] for r in _metrics(run)] == [1, 2, 3]
    assert checkpoint_state(ckpts / "step_2")["step"] == 2  # saved again, whole


@pytest.fixture
def two_checkpoints(tmp_path, tiny_path, tiny_tokenizer):
    """``run_dir/checkpoints/step_1`` and ``step_2`` with different weights (and a real
    optimizer state); returns the run dir and each step's weights."""
    backend = _backend(tiny_path)
    weights = {}
    for step in (1, 2):
        with torch.no_grad():
            for p in backend.model.parameters():
                p.grad = torch.full_like(p, 0.1 * step)
        backend.optimizer.step()
        save_checkpoint(tmp_path / "run", step, backend, tiny_tokenizer)
        weights[step] = _weights(backend)
    assert not _same(weights[1], weights[2])
    return tmp_path / "run", weights


def test_fallback_after_a_partial_load_loads_the_older_checkpoint_whole(
        two_checkpoints, tiny_path, keep_rng, caplog):
    run, weights = two_checkpoints
    bad = run / "checkpoints" / "step_2" / "trainer_state.pt"
    _garble(bad)  # read after the weights: the backend has loaded step 2's weights by then
    backend = _backend(tiny_path)
    with caplog.at_level(logging.INFO, logger="agentgym.trainers.checkpoints"):
        assert resume("auto", run, backend)["step"] == 1
    warning, = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert f"cannot read {bad}: " in warning.getMessage()
    assert _same(_weights(backend), weights[1])
    assert backend.optimizer.state_dict()["state"][0]["step"] == 1  # step 1's optimizer


def test_explicit_resume_path_never_falls_back(two_checkpoints, tiny_path, keep_rng):
    run, _ = two_checkpoints
    bad = run / "checkpoints" / "step_2" / "model.safetensors"
    _garble(bad)
    with pytest.raises(CheckpointError, match=f"cannot read {re.escape(str(bad))}: "
                       f"SafetensorError"):
        resume(str(bad.parent), run, _backend(tiny_path))


def test_no_checkpoint_loads_is_an_error(two_checkpoints, tiny_path, keep_rng, caplog):
    run, _ = two_checkpoints
    _truncate(run / "checkpoints" / "step_2" / "model.safetensors")
    (run / "checkpoints" / "step_1" / "rng.pt").unlink()
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* loads \(tried step_2, "
                       r"step_1;.*trainer.resume=never"):
        resume("auto", run, _backend(tiny_path))
    ckpts = run / "checkpoints"
    assert [r.getMessage().split(" is ")[0] for r in caplog.records
            if r.levelno == logging.WARNING] == [
        f"checkpoint file {ckpts / 'step_2' / 'model.safetensors'}",
        f"checkpoint file {ckpts / 'step_1' / 'rng.pt'}"]


def test_keep_checkpoints_removes_the_oldest_by_step_and_resume_takes_the_newest(
        tmp_path, tiny_path, tiny_tokenizer, keep_rng):
    """``trainer.keep_checkpoints=2``: after each save only the two newest by step remain
    (step_10 is newer than step_9, which a sort of the names would get wrong), and a folder
    that is not a complete checkpoint is not touched."""
    run = tmp_path / "run"
    backend = _backend(tiny_path)
    stray = run / "checkpoints" / "step_1.tmp"
    stray.mkdir(parents=True)
    kept = []
    for step in (8, 9, 10, 11):
        save_checkpoint(run, step, backend, tiny_tokenizer, keep=2)
        kept.append(sorted(p.name for p in (run / "checkpoints").iterdir()))
    assert kept == [["step_1.tmp", "step_8"], ["step_1.tmp", "step_8", "step_9"],
                    ["step_1.tmp", "step_10", "step_9"], ["step_1.tmp", "step_10", "step_11"]]
    assert resume("auto", run, _backend(tiny_path))["step"] == 11


def test_keep_checkpoints_is_refused_below_zero():
    from agentgym.config import build_config
    with pytest.raises(ValueError, match="trainer.keep_checkpoints must be >= 0, got -1"):
        build_config({"trainer.keep_checkpoints": -1})
