"""What guarding against hung env calls costs (agentgym.supervision.daemon_pool, stalls,
process_call), against the plain call in the same run:

* a ``reward=`` function called in the env worker's thread (the default) against the same
  function with ``reward_process=true`` (a child interpreter per call, killable), both
  through a :class:`~agentgym.supervision.daemon_pool.DaemonPool` call as an env step makes it;
* the site of a stuck call (:func:`agentgym.supervision.stalls.thread_site`: five samples of its
  stack) against one read of ``sys._current_frames()``.

    python bench/hung_calls.py            # prints the table
    python bench/hung_calls.py --write    # and replaces its section of docs/BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import machine, write_section  # noqa: E402
from agentgym.supervision.daemon_pool import DaemonPool  # noqa: E402
from agentgym.supervision.process_call import call_in_process  # noqa: E402
from agentgym.supervision.stalls import thread_site  # noqa: E402
from agentgym.envs.math_reward import extract_boxed, is_equivalent  # noqa: E402

TITLE = "Hung env calls: what the guards cost"


def math_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """A reward of verl's signature: the boxed answer, checked for equivalence."""
    return float(is_equivalent(extract_boxed(solution_str) or "", str(ground_truth)))


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=40, help="calls per way, taken in turn")
    ap.add_argument("--write", action="store_true", help="write docs/BENCHMARKS.md's section")
    args = ap.parse_args()
    import bench.hung_calls as this  # its function, not __main__'s: the child imports it
    pool = DaemonPool(1, thread_name_prefix="bench")
    reward = (this.math_score, "math", "The answer is \\boxed{42}.", "42", {})
    in_thread = lambda: pool.submit(*reward).result()  # noqa: E731
    in_process = lambda: pool.submit(call_in_process, *reward).result()  # noqa: E731
    first = timed(in_process, 1)[0]  # the thread's child starts, imports the module
    assert in_thread() == in_process()  # the same score either way
    times: dict[str, list[float]] = {"thread": [], "process": []}
    for _ in range(args.calls):  # in turn, so load on a shared machine hits both alike
        times["thread"] += timed(in_thread, 1)
        times["process"] += timed(in_process, 1)
    gate = threading.Event()
    stuck = pool.submit(gate.wait)
    while pool.running(stuck) is None:
        time.sleep(0.01)
    ident = pool.running(stuck).thread.ident
    site_s = timed(lambda: thread_site(ident), 10)
    once_s = timed(lambda: sys._current_frames().get(ident), 10)
    gate.set()
    pool.shutdown()
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    rows = [
        "| what | median | min-max |", "|---|---|---|",
        *(f"| reward `math_score` ({k}) | {med[k]:.2f} ms | "
          f"{min(v) * 1e3:.2f}-{max(v) * 1e3:.2f} ms |" for k, v in times.items()),
        f"| the first in-process call of a thread (its child starts) | {first * 1e3:.0f} ms | |",
        f"| a stuck call's site (5 stack samples) | {statistics.median(site_s) * 1e3:.1f} ms | "
        f"{min(site_s) * 1e3:.1f}-{max(site_s) * 1e3:.1f} ms |",
        f"| one read of the thread's frame | {statistics.median(once_s) * 1e6:.0f} us | |"]
    body = (f"{machine()}. `python bench/hung_calls.py` ({args.calls} calls a way, taken in "
            f"turn, each through a one-thread DaemonPool as an env step makes it).\n\n"
            + "\n".join(rows) + f"\n\nA reward in a process of its own (`reward_process=true`) "
            f"costs {(med['process'] - med['thread']) * 1e3:.0f} us more a call than in the "
            f"worker's thread (the pickles both ways and two pipe writes), once an episode, "
            f"at its end; each env worker thread's first call starts its child "
            f"({first:.1f} s here: an interpreter and the import of the function's module, "
            f"sympy's among them), and so does the next call after a kill. The site of a "
            f"stuck call is read only when a call is cut.")
    print(body)
    if args.write:
        write_section(TITLE, body)


if __name__ == "__main__":
    main()
