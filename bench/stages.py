"""What the benchmarks that drive whole ``agentgym`` runs share: stopping a run's process
group, and finding the last checkpoint a run saved (``bench/rl_gain.py``,
``bench/multihop_rl.py``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path


def stop(proc: subprocess.Popen) -> None:
    """Stop ``proc`` and its process group (so the retriever it started goes too): SIGTERM,
    then SIGKILL if it has not exited after 2 minutes."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def last_checkpoint(run: Path) -> tuple[int, Path]:
    """The step and folder of the last complete checkpoint (``state.json`` written) under
    ``RUN/checkpoints``; SystemExit if there is none."""
    steps = [(int(m.group(1)), d) for d in (run / "checkpoints").glob("step_*")
             if (m := re.fullmatch(r"step_(\d+)", d.name)) and (d / "state.json").exists()]
    if not steps:
        raise SystemExit(f"no GRPO checkpoint under {run / 'checkpoints'}: raise the time "
                         f"budget or lower trainer.save_every")
    return max(steps)
