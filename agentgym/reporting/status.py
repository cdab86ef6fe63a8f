"""``agentgym status RUN_DIR``: what a run is doing now, from its files alone (a run on this
machine, or a run directory copied from another): the stage and step from
``heartbeat.json`` (:mod:`agentgym.supervision.watchdog`), how long it has been in that stage and
since its last progress, whether the process still lives, the last metrics line, the last
complete checkpoint, the stalls by site (:mod:`agentgym.supervision.stalls`: where calls hung,
how many episodes each cut, its stack file) and the last stalled stage's stack file."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from agentgym.supervision.stalls import PREFIX, site_summaries
from agentgym.supervision.watchdog import HEARTBEAT, STALLS

#: the metrics shown from the last line, when it has them
SHOWN = ("rollout/reward", "eval/em", "train/loss", "train/grad_norm", "time/step_s")


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def status_lines(run_dir: str | Path, now: float | None = None) -> list[str]:
    """The report, a line each (see the module docstring).

    Raises:
        FileNotFoundError: ``run_dir`` is not a run directory (no heartbeat, no metrics).
    """
    run = Path(run_dir)
    now = time.time() if now is None else now
    beat_file, metrics_file = run / HEARTBEAT, run / "metrics.jsonl"
    if not beat_file.exists() and not metrics_file.exists():
        raise FileNotFoundError(f"{run} is not a run directory: it has neither {HEARTBEAT} nor "
                                f"metrics.jsonl (give the run_dir= of agentgym train)")
    lines = [f"run       {run}"]
    if beat_file.exists():
        beat = json.loads(beat_file.read_text())
        state = beat["state"]
        where = f"pid {beat['pid']} on {beat['host']}"
        if state == "running":
            if beat["host"] == socket.gethostname():
                state += "" if _alive(beat["pid"]) else \
                    " (but the process is gone: killed, or the machine restarted)"
            else:
                state += f" (another host: the heartbeat is {_ago(now - beat['time'])} old)"
        lines.append(f"state     {state}, {where}, heartbeat {_ago(now - beat['time'])} ago")
        role = beat.get("role", "trainer")
        who = "" if role == "trainer" else f"{role}: "  # the cold start's stages
        for st in beat["stages"]:
            lines.append(f"stage     {who}{st['stage']} of step {st['step']} for "
                         f"{_ago(now - st['since'])} (last progress {_ago(now - st['progress_at'])}"
                         f" ago, deadline {st['deadline_s']:g}s) in thread {st['thread']}")
        if not beat["stages"] and beat["state"] == "running":
            lines.append("stage     between stages")
        if beat.get("stall"):
            lines.append(f"stalled   {beat['stall']}")
    else:
        lines.append(f"state     unknown: no {HEARTBEAT} (a run from before heartbeats)")
    if metrics_file.exists():
        text = metrics_file.read_text()
        last = [line for line in text[:text.rfind("\n") + 1].splitlines() if line.strip()]
        if last:
            m = json.loads(last[-1])
            shown = "  ".join(f"{k} {m[k]:.4g}" for k in SHOWN
                              if isinstance(m.get(k), (int, float)))
            lines.append(f"metrics   step {m.get('step')}: {shown}".rstrip())
    ckpts = sorted((p for p in (run / "checkpoints").glob("step_*")
                    if p.is_dir() and p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))
    lines.append(f"checkpoint {ckpts[-1]}" if ckpts else "checkpoint none yet")
    sites = site_summaries(run / STALLS)
    if sites:
        cut = sum(n for _, n, _ in sites)
        lines.append(f"stalls    {len(sites)} site(s) cut {cut} episode(s):")
        lines.extend(f"          {site}: {n} episode(s), {path}" for site, n, path in sites)
    staged = sorted((p for p in (run / STALLS).glob("stall-*.txt")
                     if not p.name.startswith(PREFIX)), key=lambda p: p.stat().st_mtime)
    if staged:
        lines.append(f"stacks    {staged[-1]} ({len(staged)} stalled stage(s))")
    return lines
