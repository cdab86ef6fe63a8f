"""Matrix products on this CPU: fp32 against bf16, on the shapes of smollm2-135m's linear
layers over a 4,096-token micro-batch, alternated in one process, medians.

    python bench/cpu_matmul.py --write

What a CPU without native bf16 gives up: where AMX or AVX512-BF16 computes bf16, the
update's and the SFT's matrix products run several times faster in bf16 than in fp32;
elsewhere bf16 is emulated and the demo runs in fp32 (the Makefile's DEMO_BF16).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import machine, write_section  # noqa: E402

#: (tokens, in, out): q/o projections, k/v, the MLP's up and down, of smollm2-135m
SHAPES = ((4096, 576, 576), (4096, 576, 192), (4096, 576, 1536), (4096, 1536, 576))


def one(a, b, repeats: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="alternated pairs per shape")
    ap.add_argument("--write", action="store_true", help="write docs/BENCHMARKS.md's section")
    a = ap.parse_args()
    import torch
    torch.manual_seed(0)
    rows = []
    for m, k, n in SHAPES:
        ops = {dt: (torch.randn(m, k, dtype=dt), torch.randn(k, n, dtype=dt))
               for dt in (torch.float32, torch.bfloat16)}
        for x, y in ops.values():  # warm-up
            one(x, y, 2)
        times: dict = {dt: [] for dt in ops}
        for i in range(2 * a.repeats):
            dt = (torch.float32, torch.bfloat16)[i % 2]
            times[dt].append(one(*ops[dt], 4))
        fp32, bf16 = (2 * m * k * n / sorted(t)[len(t) // 2] / 1e9 for t in times.values())
        rows.append(f"| {m} x {k} x {n} | {fp32:.3g} | {bf16:.3g} | {bf16 / fp32:.2g}x |")
        print(rows[-1], flush=True)
    body = "\n".join([
        f"Machine: {machine()}, torch threads {torch.get_num_threads()}. Command: `python "
        f"bench/cpu_matmul.py {' '.join(sys.argv[1:])}`. `torch.matmul` of random matrices "
        "(tokens x in) @ (in x out), smollm2-135m's linear layers over a 4,096-token "
        f"micro-batch; alternated {a.repeats} times, medians.", "",
        "| tokens x in x out | fp32 (GFLOP/s) | bf16 (GFLOP/s) | bf16 / fp32 |",
        "|---|---|---|---|", *rows])
    if a.write:  # a CPU that emulates bf16 gets a section of its own beside a native one's
        from agentgym.core.device import cpu_bf16_flags
        write_section("CPU matrix products: fp32 against bf16"
                      + ("" if cpu_bf16_flags() else " (no native bf16)"), body)


if __name__ == "__main__":
    main()
