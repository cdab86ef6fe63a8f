"""The packed update's attention on the CPU: bf16 SDPA against the same call in fp32, forward
and backward, on buckets of equal-length segments (smollm2-135m's heads: 9 query, 3 key/value
heads of 64), alternated in one process, medians.

    python bench/packed_attention.py --write

What sets :data:`agentgym.trainers.attention.UPCAST_KEYS`: torch's CPU flash-attention
backward has a large fixed cost per (segment, head) in bf16, so short bf16 buckets that
will be differentiated run in fp32 (the casts included in the fp32 column).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import machine, write_section  # noqa: E402

SHAPES = ((8, 178), (7, 202), (4, 256), (4, 300), (3, 384), (2, 512), (2, 600), (1, 1000))


def one(segments: int, keys: int, upcast: bool) -> float:
    import torch
    import torch.nn.functional as F
    bf = torch.bfloat16
    q = torch.randn(segments, 9, keys, 64, dtype=bf, requires_grad=True)
    k = torch.randn(segments, 3, keys, 64, dtype=bf, requires_grad=True)
    v = torch.randn(segments, 3, keys, 64, dtype=bf, requires_grad=True)
    g = torch.randn(segments, 9, keys, 64, dtype=bf)
    t0 = time.perf_counter()
    if upcast:
        o = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                           enable_gqa=True).to(bf)
    else:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    o.backward(g)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=8, help="alternated pairs per shape")
    ap.add_argument("--write", action="store_true", help="write docs/BENCHMARKS.md's section")
    a = ap.parse_args()
    import torch
    from agentgym.trainers.attention import UPCAST_KEYS
    torch.manual_seed(0)
    rows = []
    for segments, keys in SHAPES:
        for upcast in (False, True):  # warm-up
            one(segments, keys, upcast)
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(2 * a.repeats):
            upcast = i % 2 == 1
            times[upcast].append(one(segments, keys, upcast))
        bf16, fp32 = (sorted(times[u])[len(times[u]) // 2] * 1e3 for u in (False, True))
        which = "fp32" if keys <= UPCAST_KEYS else "bf16"
        rows.append(f"| {segments} x {keys} | {bf16:.1f} | {fp32:.1f} | {bf16 / fp32:.2f}x "
                    f"| {which} |")
        print(rows[-1], flush=True)
    body = "\n".join([
        f"Machine: {machine()}, torch threads {torch.get_num_threads()}. Command: `python "
        f"bench/packed_attention.py {' '.join(sys.argv[1:])}`. One bucket of the packed "
        "update's SDPA (`is_causal`, grouped-query: 9 query and 3 key/value heads of 64), "
        f"forward and backward; bf16 inputs, alternated {a.repeats} times, medians. The fp32 "
        "column casts the inputs up and the output down.", "",
        "| segments x keys | bf16 (ms) | fp32 (ms) | bf16 / fp32 | the update runs |",
        "|---|---|---|---|---|", *rows, "",
        f"`agentgym.trainers.attention.UPCAST_KEYS` = {UPCAST_KEYS}: a bf16 bucket of at most "
        "that many keys runs in fp32 when a backward follows (CPU only)."])
    if a.write:
        write_section("Packed attention on the CPU: bf16 against fp32", body)


if __name__ == "__main__":
    main()
