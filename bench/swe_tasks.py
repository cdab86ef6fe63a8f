"""The shipped SWE tasks (``data/swe``, made by ``agentgym swe make-tasks``) through the
harness: every task's gold patch and an empty diff graded, as ``agentgym swe validate``
does, with what the harness costs per repository.

    python bench/swe_tasks.py            # prints the table
    python bench/swe_tasks.py --write    # and replaces its section of docs/BENCHMARKS.md

Per repository: tasks, how many are valid (the gold patch resolves, an empty diff does
not), the FAIL_TO_PASS and PASS_TO_PASS tests per task, the gold run's test seconds
(median and max) and the bug kinds; in all, the wall time at ``swe.validate_workers`` rows
at once.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import machine, write_section  # noqa: E402
from agentgym.config import build_config  # noqa: E402
from agentgym.data.rows import load_rows  # noqa: E402
from agentgym.envs.swe_grade import _validate_row  # noqa: E402

TITLE = "The shipped SWE tasks through the harness"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="write docs/BENCHMARKS.md's section")
    a = ap.parse_args()
    cfg = build_config({"env": "swe"})
    rows = {split: load_rows("swe", split, 0, cfg) for split in ("train", "test")}
    t0 = time.perf_counter()
    graded = {}
    with concurrent.futures.ThreadPoolExecutor(cfg.swe.validate_workers) as pool:
        for split, found in rows.items():
            for row, gold, empty in pool.map(lambda r: _validate_row(cfg.swe, r), found):
                graded[row["instance_id"]] = (split, row, gold, empty)
                print(f"{row['instance_id']}: gold {gold.resolved}, empty {empty.resolved} "
                      f"({gold.test_s:.1f} s)", flush=True)
    wall = time.perf_counter() - t0
    by_repo = collections.defaultdict(list)
    for split, row, gold, empty in graded.values():
        by_repo[(split, row["repo"])].append((row, gold, empty))
    lines = ["| split | repository | tasks | valid | F2P per task (mean) | P2P per task (mean) "
             "| gold test run, s (median / max) | bugs |", "|---|---|---|---|---|---|---|---|"]
    for (split, repo), items in sorted(by_repo.items(), key=lambda kv: (kv[0][0] != "train",
                                                                         kv[0][1])):
        valid = sum(g.resolved and not e.resolved and not e.infra for _, g, e in items)
        secs = [g.test_s for _, g, _ in items]
        kinds = collections.Counter(r["mutation"]["kind"] for r, _, _ in items)
        lines.append(
            f"| {split} | {repo} {items[0][0]['version']} | {len(items)} | {valid} | "
            f"{statistics.mean(len(r['FAIL_TO_PASS']) for r, _, _ in items):.1f} | "
            f"{statistics.mean(len(r['PASS_TO_PASS']) for r, _, _ in items):.0f} | "
            f"{statistics.median(secs):.2f} / {max(secs):.2f} | "
            + ", ".join(f"{k} {n}" for k, n in kinds.most_common()) + " |")
    valid = sum(g.resolved and not e.resolved and not e.infra for _, _, g, e in graded.values())
    n = len(graded)
    body = "\n".join([
        f"Machine: {machine()}. Command: `python bench/swe_tasks.py --write`. Each of the "
        f"{n} shipped tasks graded twice (its gold patch, an empty diff), "
        f"{cfg.swe.validate_workers} at a time, in {wall / 60:.1f} min "
        f"({wall / max(n, 1):.2f} s a task). **{valid} of {n} valid** (the gold patch "
        f"resolves, the empty diff does not).\n", *lines])
    print(body)
    if a.write:
        write_section(TITLE, body)
    raise SystemExit(0 if valid == n else 1)


if __name__ == "__main__":
    main()
