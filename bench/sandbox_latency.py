"""Code sandbox cost: per-execution latency and throughput of ``print(1)``.

Modes, all through asyncio subprocesses on this machine, same interpreter:

* ``bare``: ``python -c 'print(1)'`` fork+exec, no isolation (the floor).
* ``bwrap`` / ``unshare``: a stateless :class:`agentgym.tools.sandbox.LocalSandbox` execution
  (namespaces, setpriv to a fresh uid, rlimits, the in-sandbox worker, output capture).
* ``session``: a cell in a warm session (the interpreter is already running).

Throughput runs the same executions with ``c`` in flight at once (LocalSandbox's
``max_concurrency`` = c; bare: a semaphore of c).

    python bench/sandbox_latency.py              # prints the table
    python bench/sandbox_latency.py --write      # and replaces its section of docs/BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import write_section  # noqa: E402
from agentgym.tools.sandbox import LocalSandbox  # noqa: E402

TITLE = "Code sandbox: per-execution latency and throughput"
NOTES = ("Reading: a stateless execution pays namespaces and mounts (bwrap), `setpriv` to a "
         "fresh uid and the in-sandbox worker (rlimits, code read from stdin); both the floor "
         "and the sandbox pay the interpreter's `site` start-up, most of it in this venv the "
         "editable install's `.pth` finder (`python -X importtime`). The sandbox runs "
         "`python -I -B -u`: `-S` would skip that cost but also `.pth` processing, which some "
         "packages need. A warm session cell costs no process start at all. With 2 cores, "
         "throughput stops growing beyond 2 in flight for both.")
CODE = "print(1)"


async def bare_once() -> None:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", CODE,
                                                stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    assert out == b"1\n", out


async def interleaved(runners: dict, n: int) -> dict[str, list[float]]:
    """``n`` sequential latencies (s) per mode, modes taken in turn so that load changes on
    a shared machine hit every mode alike."""
    times = {mode: [] for mode in runners}
    for _ in range(n):
        for mode, run in runners.items():
            t0 = time.perf_counter()
            await run()
            times[mode].append(time.perf_counter() - t0)
    return times


async def throughput(run, n: int, concurrency: int) -> float:
    """Executions per second for ``n`` calls with ``concurrency`` in flight."""
    sem = asyncio.Semaphore(concurrency)

    async def one():
        async with sem:
            await run()

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return n / (time.perf_counter() - t0)


def sandbox_runner(sb: LocalSandbox, session: str | None = None):
    async def run():
        r = await sb.run(CODE, session=session)
        assert r.ok and r.stdout == "1\n", r
    return run


def p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[98]


async def measure(args) -> tuple[dict, dict]:
    with LocalSandbox(isolation="bwrap", max_concurrency=1) as bw, \
            LocalSandbox(isolation="unshare", max_concurrency=1) as un:
        runners = {"bare": bare_once, "bwrap": sandbox_runner(bw), "unshare": sandbox_runner(un),
                   "session": sandbox_runner(bw, session="bench")}
        await interleaved(runners, 5)  # warm-up; starts the session's interpreter
        latency = await interleaved(runners, args.runs)
    tput = {}
    for c in args.concurrency:
        with LocalSandbox(isolation="bwrap", max_concurrency=c) as sb:
            reps = {"bare": [], "bwrap": []}
            for _ in range(args.repeats):  # alternate, keep the median
                reps["bare"].append(await throughput(bare_once, args.runs, c))
                reps["bwrap"].append(await throughput(sandbox_runner(sb), args.runs, c))
        for mode, xs in reps.items():
            tput[(mode, c)] = statistics.median(xs)
    return latency, tput


def render(latency: dict, tput: dict, args, load: tuple) -> str:
    floor = statistics.median(latency["bare"])
    labels = {"bare": "bare `python -c` (floor)", "bwrap": "LocalSandbox, bwrap",
              "unshare": "LocalSandbox, unshare fallback", "session": "session cell (warm)"}
    lines = [f"Machine: {platform.machine()}, {os.cpu_count()} CPUs (`nproc`), Python "
             f"{platform.python_version()}, {platform.system()} {platform.release()}; "
             f"load average {load[0]:.2f} at start (the machine is shared; figures are noisy). "
             f"Command: `python bench/sandbox_latency.py --write`. Code: `{CODE}`, "
             f"{args.runs} executions per row; latency: sequential, the modes taken in turn; "
             f"throughput: median of {args.repeats} alternating repeats.", "",
             "| mode | median ms | p99 ms | median / floor | median - floor, ms |",
             "|---|---|---|---|---|"]
    for mode, xs in latency.items():
        med = statistics.median(xs)
        lines.append(f"| {labels[mode]} | {med * 1e3:.1f} | {p99(xs) * 1e3:.1f} | "
                     f"{med / floor:.2f}x | {(med - floor) * 1e3:+.1f} |")
    lines += ["", f"Throughput, executions/s ({args.runs} executions, `c` in flight):", "",
              "| concurrency | bare | LocalSandbox (bwrap) | bwrap / bare |", "|---|---|---|---|"]
    for c in args.concurrency:
        b, s = tput[("bare", c)], tput[("bwrap", c)]
        lines.append(f"| {c} | {b:.0f} | {s:.0f} | {s / b:.2f}x |")
    lines += ["", NOTES]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=200, help="executions per row")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 8])
    p.add_argument("--repeats", type=int, default=3, help="throughput: median of this many")
    p.add_argument("--write", action="store_true", help=f"replace '## {TITLE}' in BENCHMARKS.md")
    args = p.parse_args()
    load = os.getloadavg()
    latency, tput = asyncio.run(measure(args))
    body = render(latency, tput, args, load)
    print(body)
    if args.write:
        write_section(TITLE, body)
        print(f"\nwrote '## {TITLE}' to docs/BENCHMARKS.md")


if __name__ == "__main__":
    main()
