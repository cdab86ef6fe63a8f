"""Soak: ``agentgym train env=search model=tiny`` for an hour with a fault every few
minutes; steps, restarts, dropped episodes, RSS and open files over time, and what is
left behind at the end.

    python bench/soak.py                       # 60 minutes, a fault every 4 minutes
    python bench/soak.py --minutes 5 --every 1 # a short look

The run is the real CLI in a subprocess (its own process group). The faults, in turn:

* ``retriever-kill``: SIGKILL to the local retriever the run started (its supervisor
  must bring it back on the same port);
* ``retriever-hang``: SIGSTOP to the retriever for 20 s (alive but not answering: its
  health checks fail and the supervisor replaces it);
* ``trainer-kill``: SIGKILL to the training process itself; the soak starts it again with
  ``trainer.resume=auto`` (the retriever, orphaned, ends itself by its parent watch).

Every 5 s it samples the training process tree: RSS (MiB, summed), open file
descriptors and threads. At the end it sends SIGTERM (the clean stop), then lists the
processes of the tree still alive and the ``$TMPDIR/agentgym-*`` folders that were not
there before. Figures go to docs/BENCHMARKS.md ("Soak: an hour of faults"); the samples
to ``runs/soak/samples.csv``.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import machine, write_section  # noqa: E402

FAULTS = ("retriever-kill", "retriever-hang", "trainer-kill")


def train_cmd(run_dir: Path, resume: bool) -> list[str]:
    return [sys.executable, "-m", "agentgym.cli", "train", "env=search", "model=tiny",
            f"run_dir={run_dir}", "trainer.total_steps=1000000", "trainer.prompts_per_step=4",
            "n=4", "rollout.max_tokens_per_turn=32", "rollout.max_response_tokens=512",
            "trainer.eval_limit=0", "trainer.cold_start=off", "trainer.save_every=20",
            "trainer.log_samples=0", f"trainer.resume={'auto' if resume else 'never'}"]


def tree(proc: psutil.Process) -> list[psutil.Process]:
    """The training process and everything it started, its retriever included (the
    retriever leads its own session, so it is found as a child, not by group)."""
    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return []


def retriever(proc: psutil.Process) -> psutil.Process | None:
    for p in tree(proc)[1:]:
        try:
            if "retriever_server" in " ".join(p.cmdline()):
                return p
        except psutil.Error:
            continue
    return None


def sample(proc: psutil.Process) -> tuple[float, int, int]:
    rss = fds = threads = 0
    for p in tree(proc):
        try:
            rss += p.memory_info().rss
            fds += p.num_fds()
            threads += p.num_threads()
        except psutil.Error:
            continue
    return rss / 2**20, fds, threads


def steps_done(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line being written
    return rows


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of ``(t_s, y)`` in y per hour (0 for fewer than 3 points)."""
    if len(points) < 3:
        return 0.0
    ts, ys = [p[0] for p in points], [p[1] for p in points]
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    var = sum((t - mt) ** 2 for t in ts)
    return 3600 * sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var if var else 0.0


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--every", type=float, default=4.0, help="minutes between faults")
    ap.add_argument("--run-dir", default=str(ROOT / "runs" / "soak"))
    ap.add_argument("--no-write", action="store_true", help="do not touch BENCHMARKS.md")
    return ap.parse_args()


def _start(run_dir: Path, resume: bool, env: dict, log) -> psutil.Process:
    """The training run in its own process group, its output appended to ``log``."""
    p = subprocess.Popen(train_cmd(run_dir, resume), stdout=log, stderr=subprocess.STDOUT,
                         env=env, cwd=ROOT, start_new_session=True)
    return psutil.Process(p.pid)


def _latest_ckpt(run_dir: Path) -> int:
    steps = [int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*")
             if p.name[5:].isdigit() and (p / "state.json").exists()]
    return max(steps, default=0)


def _inject(fault: str, proc: psutil.Process, now: float,
            events: list[tuple[float, str, str]]) -> None:
    """Apply ``fault`` to the training tree of ``proc``; record it in ``events``."""
    r = retriever(proc)
    if fault == "retriever-kill" and r is not None:
        os.killpg(r.pid, signal.SIGKILL)
        events.append((now, fault, f"pid {r.pid}"))
    elif fault == "retriever-hang" and r is not None:
        r.send_signal(signal.SIGSTOP)
        events.append((now, fault, f"pid {r.pid} stopped for 20 s"))
        time.sleep(20)
        try:
            r.send_signal(signal.SIGCONT)  # if the supervisor has not replaced it
        except psutil.Error:
            pass
    elif fault == "trainer-kill":
        proc.send_signal(signal.SIGKILL)
        events.append((now, fault, f"pid {proc.pid}"))
    else:
        events.append((now, fault, "skipped: no retriever running"))


def _clean_stop(proc: psutil.Process, seen: set[int]) -> tuple[int | str, list[int]]:
    """SIGTERM to the trainer, as a user's Ctrl-C / a scheduler's stop: its exit code (or
    why there is none), and the processes of ``seen`` still alive 30 s later."""
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=120)
    except psutil.TimeoutExpired:
        code = "still running after 120 s"
    deadline = time.monotonic() + 30
    left = []
    while time.monotonic() < deadline:
        left = [p for p in seen if psutil.pid_exists(p) and
                psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not left:
            break
        time.sleep(0.5)
    return code, left


def main() -> None:
    args = _args()
    run_dir = Path(args.run_dir)
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    run_dir.mkdir(parents=True)
    tmp_before = set(glob.glob(os.path.join(tempfile.gettempdir(), "agentgym-*")))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    log = open(run_dir.parent / "soak.log", "w")
    t0 = time.monotonic()
    proc = _start(run_dir, False, env, log)
    lives: list[dict] = [{"from": 0, "rows": []}]  # each trainer process: resumed from, rows
    samples: list[tuple[float, int, float, int, int]] = []  # t, life, rss, fds, threads
    events: list[tuple[float, str, str]] = []
    seen: set[int] = set()
    life, next_fault, k = 0, args.every * 60, 0
    while time.monotonic() - t0 < args.minutes * 60:
        now = time.monotonic() - t0
        if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
            code = proc.wait() if proc.is_running() else None
            lives[life]["rows"] = steps_done(run_dir)
            lives.append({"from": _latest_ckpt(run_dir), "rows": []})
            events.append((now, "trainer-exit", f"code {code}; resumed from step "
                                                f"{lives[-1]['from']}"))
            proc, life = _start(run_dir, True, env, log), life + 1
        rss, fds, threads = sample(proc)
        seen |= {p.pid for p in tree(proc)}
        samples.append((now, life, rss, fds, threads))
        if now >= next_fault:
            fault = FAULTS[k % len(FAULTS)]
            k += 1
            next_fault += args.every * 60
            _inject(fault, proc, now, events)
        time.sleep(5)  # the sampling interval
    seen |= {p.pid for p in tree(proc)}
    code, left = _clean_stop(proc, seen)
    lives[life]["rows"] = steps_done(run_dir)
    tmp_left = sorted(set(glob.glob(os.path.join(tempfile.gettempdir(), "agentgym-*")))
                      - tmp_before)
    log.close()
    with open(run_dir.parent / "soak_samples.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t_s", "trainer_life", "rss_mib", "fds", "threads"])
        w.writerows(samples)
    stalls = sorted(p.name for p in (run_dir / "stalls").glob("stall-*.txt"))
    report(args, samples, events, code, left, tmp_left, lives, stalls)


def report(args, samples, events, code, left, tmp_left, life_rows, stalls) -> None:
    # each life's own steps (a resumed life starts from its checkpoint's rows)
    own = [[r for r in lf["rows"] if "rollout/reward" in r and r["step"] > lf["from"]]
           for lf in life_rows]
    rows = [r for part in own for r in part]
    last = max((r["step"] for r in rows), default=0)
    restarts = sum(max((r.get("infra/restarts", 0) for r in part), default=0) for part in own)
    dropped = sum(r.get("rollout/infra_dropped", 0) for r in rows)
    failed = sum(r.get("rollout/infra_failed", 0) for r in rows)
    lives = len(life_rows)
    longest = max(range(lives), key=lambda i: sum(1 for s in samples if s[1] == i))
    warm = [s for s in samples if s[1] == longest]
    warm = warm[len(warm) // 5:]  # past the first fifth: model loaded, caches warm
    rss_slope = slope_per_hour([(s[0], s[2]) for s in warm])
    fd_slope = slope_per_hour([(s[0], s[3]) for s in warm])
    windows = []
    for w0 in range(0, int(args.minutes), 10):
        part = [s for s in samples if w0 * 60 <= s[0] < (w0 + 10) * 60]
        if part:
            windows.append(f"| {w0}-{w0 + 10} | {min(s[2] for s in part):.0f} / "
                           f"{statistics.median(s[2] for s in part):.0f} / "
                           f"{max(s[2] for s in part):.0f} | "
                           f"{min(s[3] for s in part)} / {max(s[3] for s in part)} | "
                           f"{max(s[4] for s in part)} |")
    ev = "\n".join(f"| {t / 60:.1f} | {name} | {what} |" for t, name, what in events)
    body = f"""{machine()}. `python bench/soak.py --minutes {args.minutes:g} --every {args.every:g}`:
`agentgym train env=search model=tiny` (4 prompts x 4 samples a step, checkpoints every 20
steps) for {args.minutes:g} minutes, a fault every {args.every:g} minutes in turn
(retriever SIGKILL, retriever SIGSTOP for 20 s, trainer SIGKILL then `trainer.resume=auto`).

- Steps completed: {len(rows)} (last step {last}; steps redone after a resume counted
  again); trainer processes: {lives} (each trainer-kill resumed from its last checkpoint).
- Retriever restarts by its supervisor (summed over trainer lives): {restarts:.0f}.
- Episodes that hit an infrastructure failure: {failed:.0f}; dropped from updates:
  {dropped:.0f} (tiny rarely emits a well-formed `<search>`, so few episodes call the
  retriever at all; the restart path is what this exercises).
- RSS of the training tree over the longest trainer life, past its first fifth:
  {rss_slope:+.1f} MiB/hour (least squares); open descriptors {fd_slope:+.1f}/hour.
- The clean stop (SIGTERM): exit {code}; processes of the tree still alive 30 s later:
  {len(left)} {left if left else ''}; `$TMPDIR/agentgym-*` folders left: {len(tmp_left)}
  {tmp_left if tmp_left else ''}.
- Stalls reported with the default `deadlines.*` (stack files in the run's `stalls/`):
  {len(stalls)} {stalls if stalls else ''}.

| minutes | RSS MiB min / median / max | fds min / max | threads max |
|---|---|---|---|
{chr(10).join(windows)}

| at minute | fault | detail |
|---|---|---|
{ev}
"""
    print(body)
    if not args.no_write:
        write_section("Soak: an hour of faults", body)


if __name__ == "__main__":
    main()
