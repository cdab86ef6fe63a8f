"""What ``env=swe``'s workspaces and harness cost, against the alternatives in the same run:

* a workspace made and removed per episode: the overlay (what the env uses) against a plain
  copy of the base (``shutil.copytree``, the only other copy-on-write-free choice on ext4,
  which has no reflinks; a hard-linked tree is refused: a write through a link changes the
  base), on the built-in repository and on a large one (sympy's source tree as a
  repository, about 1,500 files);
* a command's round trip (``true``) and the built-in task's test run (the harness with the
  gold patch);
* whole episodes per minute at 8 and 32 in flight: reset, three commands (read, fix, diff),
  submit and grading, on the built-in tasks.

    python bench/swe_workspace.py            # prints the table
    python bench/swe_workspace.py --write    # and replaces its section of docs/BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import concurrent.futures
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import machine, write_section  # noqa: E402
from agentgym.envs import make_env  # noqa: E402
from agentgym.envs.swe_builtin import builtin_rows  # noqa: E402
from agentgym.envs.swe_grade import (grade, repo_cache, repo_python, swe_root,  # noqa: E402
                                    workspace_root)
from agentgym.envs.swe_rows import find_repo  # noqa: E402
from agentgym.tools.workspace import CommandLimits, Workspace, tree_bytes  # noqa: E402

TITLE = "SWE workspaces and harness: what an episode costs"
FIX = {"clamp-high": "sed -i 's/if x < hi/if x > hi/' minicalc/ops.py",
       "mean-len": "sed -i 's/(len(values) + 1)/len(values)/' minicalc/ops.py"}


def ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.1f} ms ({min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f})"


def large_base(tmp: Path) -> Path:
    """sympy's installed source as a one-commit repository's base."""
    import sympy
    src = tmp / "sympy-repo"
    shutil.copytree(Path(sympy.__file__).parent, src / "sympy",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for args in (["init", "-q"], ["add", "-A"],
                 ["-c", "user.name=b", "-c", "user.email=b@b", "commit", "-qm", "sympy"]):
        subprocess.run(["git", *args], cwd=src, check=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=src, check=True,
                            capture_output=True, text=True).stdout.strip()
    return repo_cache().base("bench/sympy", src, commit)


def make_remove(base: Path, n: int) -> tuple[list[float], list[float], list[float]]:
    """Per episode: overlay workspace (made, first command, removed) and a plain copy."""
    overlay, first, copy = [], [], []
    for _ in range(n):  # in turn, so load on a shared machine hits both alike
        t0 = time.perf_counter()
        ws = Workspace(base, workspace_root())
        t1 = time.perf_counter()
        ws.run("true")
        t2 = time.perf_counter()
        ws.close()
        overlay.append((t1 - t0) + (time.perf_counter() - t2))
        first.append(t2 - t1)
        with tempfile.TemporaryDirectory(dir=workspace_root()) as tmp:
            t0 = time.perf_counter()
            shutil.copytree(base, Path(tmp) / "copy", symlinks=True)
            shutil.rmtree(Path(tmp) / "copy")
            copy.append(time.perf_counter() - t0)
    return overlay, first, copy


def episode(row: dict) -> float:
    env = make_env("swe", max_turns=5)
    env.reset(options={"row": row})
    env.step("```bash\ncat minicalc/ops.py\n```")
    env.step(f"```bash\n{FIX[row['instance_id'].split('minicalc-', 1)[1]]}\n```")
    env.step("```bash\ngit diff --stat\n```")
    _, reward, *_ = env.step("```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```")
    env.close()
    return reward


def per_minute(rows: list[dict], in_flight: int, episodes: int) -> tuple[float, float]:
    work = [rows[i % len(rows)] for i in range(episodes)]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(in_flight) as pool:
        rewards = list(pool.map(episode, work))
    took = time.perf_counter() - t0
    return episodes / took * 60, sum(rewards) / len(rewards)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20, help="workspaces made a way")
    ap.add_argument("--episodes", type=int, default=64, help="episodes per in-flight level")
    ap.add_argument("--write", action="store_true", help="write docs/BENCHMARKS.md's section")
    args = ap.parse_args()
    rows = builtin_rows(swe_root() / "builtin")
    small = repo_cache().base(rows[0]["repo"], find_repo(rows[0], ""), rows[0]["base_commit"])
    with tempfile.TemporaryDirectory() as tmp:
        large = large_base(Path(tmp))
        files = sum(1 for p in large.rglob("*") if p.is_file())
        sizes = {"built-in (minicalc)": small, f"large (sympy, {files} files, "
                 f"{tree_bytes(large) / 2**20:.0f} MiB)": large}
        made = {name: make_remove(base, args.n) for name, base in sizes.items()}
    limits = CommandLimits(wall_s=300, cpu_s=300)
    tests = []
    for _ in range(5):
        g = grade(rows[0], small, rows[0]["patch"], workspace_root(), limits, 300,
                  repo_python(rows[0], "", ["pytest"]))
        assert g.resolved, g
        tests.append(g.test_s)
    rates = {k: per_minute(rows, k, args.episodes) for k in (8, 32)}
    lines = ["| what | overlay (the env's) | plain copy |", "|---|---|---|"]
    for name, (overlay, first, copy) in made.items():
        lines.append(f"| workspace made and removed, {name} | {ms(overlay)} | {ms(copy)} |")
        lines.append(f"| its first command (`true`), {name} | {ms(first)} | |")
    lines.append(f"| the built-in task's test run (harness, gold patch) | {ms(tests)} | |")
    for k, (rate, mean) in rates.items():
        lines.append(f"| whole episodes, {k} in flight (reset, 3 commands, submit, grading) "
                     f"| {rate:.0f} a minute (reward {mean:.2f}) | |")
    body = (f"{machine()}. `python bench/swe_workspace.py` ({args.n} workspaces a way, taken "
            f"in turn; {args.episodes} episodes per in-flight level).\n\n" + "\n".join(lines)
            + "\n\nThe overlay's cost does not grow with the repository (it copies a file "
              "only when the agent writes it), where a copy's grows with every file. A "
              "command's round trip is the launcher's: unshare, the overlay's mount, bwrap, "
              "prlimit, setpriv. The test run is pytest in the repository's own environment "
              "(`swe.packages`: pytest and what it needs, copied once), most of an "
              "episode's time.")
    print(body)
    if args.write:
        write_section(TITLE, body)


if __name__ == "__main__":
    main()
