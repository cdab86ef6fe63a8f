"""This tree's engine against another revision's, paired: ``bench/engine_speed.py`` from
each, interleaved, on the same machine.

A refactor of the engine must not make it slower. Each round runs the base revision's
``bench/engine_speed.py`` and this tree's, one after the other (the order alternates
between rounds, so a machine that drifts in speed favours neither), each in a fresh
process that imports its own tree's ``agentgym``; the figure is ours' tokens/s per
workload, and each round's ratio is this tree's over the base's. The median of the rounds'
ratios is the verdict; the transformers ``generate`` each run also times is a check that
the machine stayed the same (its ratio between the two runs of a round should be near 1).

    python bench/engine_ab.py --base HEAD~1 --rounds 5 -- --batch 16 --episodes 8 \\
        --dtype bfloat16 --layers 8

The base revision is checked out as a git worktree in a temporary folder, removed after.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import machine, write_section  # noqa: E402

ROW = re.compile(r"^\| (?P<shape>[^|]+) \| (?P<workload>[^|]+) \| (?P<ours>[\d,]+) \("
                 r"[^|]*\| (?P<generate>[\d,]+) \(")


def rates(text: str) -> dict[str, tuple[float, float]]:
    """``{workload: (ours tok/s, generate tok/s)}`` from engine_speed's printed table."""
    out = {}
    for line in text.splitlines():
        m = ROW.match(line)
        if m:
            key = f"{m['shape'].strip()}, {m['workload'].strip()}"
            out[key] = (float(m["ours"].replace(",", "")), float(m["generate"].replace(",", "")))
    if not out:
        raise RuntimeError(f"no table in engine_speed's output:\n{text[-2000:]}")
    return out


def speed(tree: Path, bench_args: list[str]) -> dict[str, tuple[float, float]]:
    """One run of ``tree``'s bench/engine_speed.py (its own agentgym), nothing written."""
    cmd = [sys.executable, str(tree / "bench" / "engine_speed.py"), *bench_args, "--out", "none"]
    done = subprocess.run(cmd, cwd=tree, capture_output=True, text=True,
                          env={**__import__("os").environ, "PYTHONPATH": str(tree)})
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return rates(done.stdout)


def table(base_rev: str, rounds: list[dict]) -> str:
    """The rounds' ratios per workload, their median, and generate's drift."""
    lines = ["| workload | this tree / base, per round | median | generate's drift, per round |",
             "|---|---|---|---|"]
    for key in rounds[0]["head"]:
        ratios = [r["head"][key][0] / r["base"][key][0] for r in rounds]
        drift = [r["head"][key][1] / r["base"][key][1] for r in rounds]
        lines.append(f"| {key} | {', '.join(f'{x:.3f}' for x in ratios)} | "
                     f"**{statistics.median(ratios):.3f}** | "
                     f"{', '.join(f'{x:.2f}' for x in drift)} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the revision to compare against")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--title", default="Engine refactor, paired against its base")
    ap.add_argument("--out", default=None, help="'none' writes nothing (default: BENCHMARKS)")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER,
                    help="after --: what each bench/engine_speed.py run gets")
    args = ap.parse_args(argv)
    bench_args = [a for a in args.bench_args if a != "--"]
    rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="engine-ab-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), rev], cwd=ROOT,
                       check=True)
        try:
            for k in range(args.rounds):
                order = ["base", "head"] if k % 2 == 0 else ["head", "base"]
                got = {}
                for which in order:
                    got[which] = speed(base if which == "base" else ROOT, bench_args)
                    print(f"round {k + 1}/{args.rounds} {which}: {got[which]}", flush=True)
                rounds.append(got)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT)
    body = (f"Machine: {machine()}. Command: `python bench/engine_ab.py "
            f"{' '.join(sys.argv[1:])}`; base {rev}, {args.rounds} rounds, the order "
            "alternating.\n\n" + table(rev, rounds) + "\n\nEach ratio is this tree's "
            "engine's tokens/s over the base's in the same round (`bench/engine_speed.py`, "
            "its `ours`); the drift column is the same ratio for transformers' `generate`, "
            "which neither tree changes: how far the machine moved within a round.")
    if args.out != "none":
        write_section(args.title, body)
    print(body)


if __name__ == "__main__":
    main()
