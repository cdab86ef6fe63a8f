"""A run's directory and its checkpoints: where a run writes (``trainer.run_dir``), the
atomic save (written beside, then renamed; a full disk is a :class:`CheckpointError` that
names the space needed), the rolling keep (``trainer.keep_checkpoints``), and resume from the
newest complete one (weights, optimizer, RNG state and the step). RL training
(:mod:`agentgym.trainers.loop`) and SFT (:mod:`agentgym.trainers.sft`) both use it; the
backends they save come from :mod:`agentgym.trainers.backends.factory`."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from agentgym.config import Config, env_names, to_dict
from agentgym.core.paths import complete_checkpoints, latest_checkpoint  # noqa: F401 - run folders
from agentgym.trainers.backends.distributed import DistributedBackend

logger = logging.getLogger(__name__)


def resolve_run_dir(cfg: Config) -> Path:
    if cfg.run_dir:
        return Path(cfg.run_dir)
    model = Path(cfg.model.path or cfg.model.name).name
    env = "+".join(env_names(cfg.env)).replace(":", "-").replace("/", "-")
    return Path("runs") / f"{env}-{model}-{time.strftime('%Y%m%d-%H%M%S')}"


def start_run(cfg: Config) -> Path:
    """Create the run directory, write the resolved config, seed ``random`` and torch."""
    run_dir = resolve_run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2) + "\n")
    logger.info("run dir %s; config %s", run_dir, json.dumps(to_dict(cfg)))
    random.seed(cfg.trainer.seed)
    torch.manual_seed(cfg.trainer.seed)
    return run_dir


class CheckpointError(OSError):
    """A checkpoint that cannot be written (the disk or the quota filled: ``errno`` is
    ENOSPC or EDQUOT) or read (a file missing, truncated or unreadable).

    An :class:`OSError` because the fault is the storage's, not the config's or the
    code's, so handlers of I/O errors cover it; it is its own type so that the CLI can
    print its message (which names the path and what to do) without a traceback, and
    :func:`resume` can tell a damaged checkpoint from a config mismatch (``ValueError``).
    """


def resume(policy: str, run_dir: Path, backend, critic=None) -> dict[str, Any]:
    """Load the checkpoint ``trainer.resume`` names into ``backend`` (and ``critic``'s
    backend from its ``critic/`` folder); return its ``state.json`` (``{"step": 0}`` when
    there is none).

    * ``never``: nothing.
    * a path: that checkpoint, or a :class:`CheckpointError` naming the file that does
      not load; never another checkpoint.
    * ``auto``: the newest complete checkpoint in ``run_dir`` that loads. One that does
      not is skipped with a WARNING naming the file and the error, and the one before it
      is loaded whole (weights, optimizer, scheduler, RNG), over whatever the failed
      attempt had loaded; a :class:`CheckpointError` when none loads. With a distributed
      backend only :func:`checkpoint_state`'s checks fall back: a rank that fails to load
      stops all ranks, so that error ends the run.
    """
    if policy == "never":
        return {"step": 0}
    if policy != "auto":
        ckpt = Path(policy)
        return _load_into(ckpt, checkpoint_state(ckpt), backend, critic)
    skipped = []
    for ckpt in complete_checkpoints(run_dir):
        loading = False  # checkpoint_state's checks load nothing
        try:
            state = checkpoint_state(ckpt)
            loading = True
            return _load_into(ckpt, state, backend, critic)
        except CheckpointError as e:
            if loading and not _usable_after_failed_load(backend, critic):
                raise CheckpointError(f"{e}; the ranks stopped with it, so this run cannot "
                                      f"load the checkpoint before it: move {ckpt} aside "
                                      f"and run again") from e
            logger.warning("%s; trying the checkpoint before it", e)
            skipped.append(ckpt.name)
    if skipped:
        raise CheckpointError(f"no checkpoint in {run_dir / 'checkpoints'} loads (tried "
                              f"{', '.join(skipped)}; the warnings above say why): move them "
                              f"aside, or set trainer.resume=never or a new run_dir")
    return {"step": 0}


def checkpoint_state(ckpt: Path) -> dict[str, Any]:
    """``ckpt``'s ``state.json``, once every file it lists has the size it had when saved:
    one ``stat`` a file, which finds a missing, truncated or extended file before a
    backend reads it (a checkpoint saved before sizes were recorded is not checked).

    Raises:
        CheckpointError: naming the file that is unreadable, missing or the wrong size.
    """
    f = ckpt / "state.json"
    try:
        state = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {ckpt} is not usable: {f}: {e} (a checkpoint is "
                              f"a checkpoints/step_N folder that save_checkpoint wrote)") from e
    for name, size in state.pop("file_bytes", {}).items():
        got = (ckpt / name).stat().st_size if (ckpt / name).is_file() else None
        if got != size:
            raise CheckpointError(f"checkpoint file {ckpt / name} is "
                                  f"{'missing' if got is None else f'{got} bytes'}; it was "
                                  f"{size} bytes when saved (truncated or overwritten)")
    return state


def _load_into(ckpt: Path, state: dict[str, Any], backend, critic) -> dict[str, Any]:
    """Load ``ckpt`` into the backends and this process's RNGs; return ``state``."""
    if critic is not None and not (ckpt / "critic").is_dir():
        raise ValueError(f"checkpoint {ckpt} has no critic/ folder, so a critic-based "
                         f"algorithm cannot resume from it; start a new run_dir or set "
                         f"trainer.resume=never")
    rng = ckpt / "rng.pt"
    try:
        rngs = torch.load(rng, weights_only=False) if rng.exists() else None
    except Exception as e:  # noqa: BLE001 - bad bytes raise pickle's or torch's errors
        raise CheckpointError(f"cannot read {rng}: {type(e).__name__}: {e}") from e
    try:
        backend.load(ckpt)
        if critic is not None:
            critic.load(ckpt / "critic")
    except (ValueError, CheckpointError):
        raise  # ValueError: the checkpoint does not match the model or config
    except Exception as e:  # noqa: BLE001 - each loader has its own errors for bad bytes
        raise CheckpointError(f"checkpoint {ckpt} does not load: {type(e).__name__}: "
                              f"{e}") from e
    if rngs is not None:
        set_rng_state(rngs)
    logger.info("resumed from %s at step %d", ckpt, state["step"])
    return state


def _usable_after_failed_load(*backends) -> bool:
    """Whether another checkpoint can be loaded into ``backends`` after one failed to:
    not into a distributed backend, which stops all its ranks when one fails."""
    return not any(isinstance(b, DistributedBackend) for b in backends)


def rng_state() -> dict[str, Any]:
    """This process's random generators: Python's, NumPy's and torch's."""
    import numpy as np
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(run_dir: Path, step: int, backend, tokenizer,
                    state: dict[str, Any] | None = None, critic=None, keep: int = 0) -> Path:
    """``run_dir/checkpoints/step_N``: HF weights + tokenizer + the backend's optimizer
    and scheduler state (sharded for fsdp/deepspeed) + the driver's RNG states
    (``rng.pt``) + ``state.json`` (step, data position, policy version, and each file's
    size for :func:`checkpoint_state`), and the critic's in ``critic/`` when there is one.

    Written to ``step_N.tmp`` and renamed into place, so a kill mid-save leaves nothing
    that ``trainer.resume=auto`` would pick up (it only reads ``step_<digits>`` folders).
    With ``keep`` (``trainer.keep_checkpoints``), the complete checkpoints but the newest
    ``keep`` (by step) are removed once this one is in place.

    Raises:
        CheckpointError: the disk or quota filled; ``step_N.tmp`` is removed and the
            earlier checkpoints are as they were.
    """
    final = run_dir / "checkpoints" / f"step_{step}"
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)  # a leftover of a killed save
    try:
        _write_checkpoint(tmp, step, backend, tokenizer, state, critic)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)  # half a checkpoint is of no use
        full = _out_of_space(e, final, backend, critic)
        if full is not None:
            raise full from e
        raise
    if final.exists():  # re-saving a step (after a resume): move the old one aside first
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    logger.info("saved checkpoint %s", final)
    if keep:
        for old in complete_checkpoints(run_dir)[keep:]:
            shutil.rmtree(old, ignore_errors=True)
            logger.info("removed checkpoint %s (trainer.keep_checkpoints=%d)", old, keep)
    return final


def _write_checkpoint(tmp: Path, step: int, backend, tokenizer, state, critic) -> None:
    backend.save(tmp, tokenizer=tokenizer)
    source = Path(getattr(tokenizer, "name_or_path", "") or ".")
    if (source / "preprocessor_config.json").is_file():  # a VL model's image processor
        shutil.copy2(source / "preprocessor_config.json", tmp / "preprocessor_config.json")
    if critic is not None:
        critic.save(tmp / "critic")
    torch.save(rng_state(), tmp / "rng.pt")
    sizes = {p.relative_to(tmp).as_posix(): p.stat().st_size
             for p in sorted(tmp.rglob("*")) if p.is_file()}
    (tmp / "state.json").write_text(  # last: it marks the checkpoint complete
        json.dumps({**(state or {}), "step": step, "file_bytes": sizes}) + "\n")


_MIB = 2 ** 20


def _out_of_space(e: Exception, final: Path, backend, critic) -> CheckpointError | None:
    """The error to raise when the save that raised ``e`` ran out of disk or quota: the
    OS said so (an ``OSError``, or its text: safetensors and the rank processes pass it
    on as text), or less space is free than the checkpoint needs (torch.save then says
    only "unexpected pos"). None otherwise."""
    code = _space_errno(e)
    needed = _checkpoint_bytes(final.parent.parent, backend, critic)
    folder = final.parent
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if code is None and (needed is None or free >= needed):
        return None
    code = code or errno.ENOSPC
    size = f"about {needed / _MIB:.1f} MiB needed" if needed else "size unknown"
    err = CheckpointError(f"{os.strerror(code).lower()} writing checkpoint {final.name} to "
                          f"{final.parent}: {size}, {free / _MIB:.1f} MiB free on that "
                          f"filesystem; free some space, or set run_dir= to a disk with room")
    err.errno = code
    return err


def _space_errno(e: BaseException | None) -> int | None:
    """ENOSPC or EDQUOT when ``e`` or an exception it came from says so."""
    while e is not None:
        for code in (errno.ENOSPC, errno.EDQUOT):
            if getattr(e, "errno", None) == code or os.strerror(code) in str(e):
                return code
        e = e.__cause__ or e.__context__
    return None


def _checkpoint_bytes(run_dir: Path, backend, critic) -> int | None:
    """About what a checkpoint takes: the previous one's size, else the weights and
    optimizer state of in-process backends; None when neither is known (the first
    checkpoint of a distributed backend, whose tensors live in its ranks)."""
    prev = latest_checkpoint(run_dir)
    if prev is not None:
        return sum(p.stat().st_size for p in prev.rglob("*") if p.is_file())
    total = 0
    for b in (backend, critic):
        if b is None:
            continue
        if not hasattr(b, "model") or not hasattr(b, "optimizer"):
            return None
        tensors = [*b.model.state_dict().values(), *(
            v for s in b.optimizer.state.values() for v in s.values() if torch.is_tensor(v))]
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total
