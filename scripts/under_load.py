"""Run a command while busy processes keep the CPU cores loaded (``make test-stress``).

    python scripts/under_load.py [--cpus N] -- COMMAND [ARGS...]

Starts ``N`` processes (default: one per core) that spin in a pure-Python loop at normal
priority, runs the command, and stops them however the command ends (exit, failure,
Ctrl-C, SIGTERM). Exits with the command's status. Timing-dependent code that passes
here does not rely on having the machine to itself: the way to hunt flaky tests
(``make test-stress`` runs the default tier like this).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import subprocess
import sys


def _spin() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    x = 0
    while True:
        x = (x * 1_103_515_245 + 12_345) & 0xFFFF_FFFF


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpus", type=int, default=os.cpu_count() or 1,
                   help="busy processes to run alongside (default: one per core)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    ns = p.parse_args(argv)
    cmd = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not cmd:
        p.error("no command given (usage: under_load.py [--cpus N] -- COMMAND ...)")
    if ns.cpus < 0:
        p.error(f"--cpus must be >= 0, got {ns.cpus}")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    ctx = mp.get_context("spawn")
    hogs = [ctx.Process(target=_spin, daemon=True) for _ in range(ns.cpus)]
    for h in hogs:
        h.start()
    print(f"under_load: {ns.cpus} busy processes ({[h.pid for h in hogs]}) while running: "
          f"{' '.join(cmd)}", file=sys.stderr, flush=True)
    child = None
    try:
        child = subprocess.Popen(cmd)
        return child.wait()
    except KeyboardInterrupt:  # the child got the terminal's SIGINT too: let it finish
        if child is not None:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        return 130
    finally:
        if child is not None and child.poll() is None:
            child.terminate()
            child.wait()
        for h in hogs:
            h.terminate()
        for h in hogs:
            h.join()


if __name__ == "__main__":
    sys.exit(main())
