"""Retrieval server throughput: batched (AgentGym) vs per-request encoding (Search-R1 style).

    python bench/retriever_bench.py                        # dense, concurrency 1, 8, 32
    python bench/retriever_bench.py --dtype bfloat16 --methods dense bm25

Both servers are ``python -m agentgym.retriever_server`` over the *same* saved index (the shipped
21k-passage corpus, built by ``bench/retriever_recall.py``'s ``ensure_index``) and the same
encoder; the baseline runs with ``--batching off``, which searches every request on its own
in a thread pool, the way Search-R1's ``retrieval_server.py`` does (a sync FastAPI
endpoint calling ``batch_search`` on the request's queries). Each request carries one NQ
question, as the search env sends. The servers run one at a time, each in its own
process; the load generator (httpx, asyncio) runs in this process on the same 2 cores, so
absolute figures include its cost for both servers alike.
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

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import write_section  # noqa: E402
from bench.retriever_recall import ensure_index, load_questions  # noqa: E402
from agentgym.tools.local_retriever import LocalRetriever  # noqa: E402


async def _run(url: str, questions: list[str], n: int, concurrency: int) -> dict:
    latencies: list[float] = []
    errors = 0
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def one(i: int) -> None:
            nonlocal errors
            async with gate:
                t0 = time.perf_counter()
                r = await client.post(url + "/retrieve", json={
                    "queries": [questions[i % len(questions)]], "topk": 3})
                latencies.append(time.perf_counter() - t0)
                errors += r.status_code != 200

        await asyncio.gather(*(one(i) for i in range(min(concurrency, n))))  # warm-up
        latencies.clear()
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
    latencies.sort()
    return {"qps": n / wall, "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "errors": errors, "n": n}


def measure(index_dir: Path, batching: bool, questions: list[str], levels: list[int],
            requests: int) -> dict[int, dict]:
    extra = ["--batching", "on" if batching else "off"]
    out = {}
    with LocalRetriever(index_dir=index_dir, extra_args=extra, startup_timeout=300) as server:
        for c in levels:
            n = max(requests, 8 * c)
            out[c] = asyncio.run(_run(server.url, questions, n, c))
            r = out[c]
            print(f"  {'batched ' if batching else 'baseline'} c={c:3d}: {r['qps']:7.1f} QPS  "
                  f"p50 {r['p50_ms']:7.1f} ms  p99 {r['p99_ms']:7.1f} ms  errors {r['errors']}",
                  flush=True)
        stats = httpx.get(server.url + "/health").json()["batching"]
    if stats:
        out["stats"] = stats
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=["dense"], choices=["dense", "bm25"])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=256, help="timed requests per level "
                    "(at least 8 x concurrency)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    questions = [q for q, _ in load_questions()]
    sections = []
    for method in args.methods:
        index_dir = ensure_index(method, args.dtype)
        print(f"{method}: {index_dir}", flush=True)
        base = measure(index_dir, False, questions, args.concurrency, args.requests)
        ours = measure(index_dir, True, questions, args.concurrency, args.requests)
        lines = ["| concurrency | baseline QPS | batched QPS | QPS ratio | baseline p50 / p99 ms "
                 "| batched p50 / p99 ms | errors |", "|---|---|---|---|---|---|---|"]
        for c in args.concurrency:
            b, o = base[c], ours[c]
            lines.append(f"| {c} | {b['qps']:.1f} | {o['qps']:.1f} | **{o['qps'] / b['qps']:.2f}x**"
                         f" | {b['p50_ms']:.0f} / {b['p99_ms']:.0f} | {o['p50_ms']:.0f} / "
                         f"{o['p99_ms']:.0f} | {b['errors'] + o['errors']} |")
        stats = ours.get("stats", {})
        mean_batch = stats.get("queries", 0) / max(stats.get("batches", 1), 1)
        name = ("dense: all-MiniLM-L6-v2 " + args.dtype + ", faiss flat") if method == "dense" \
            else "BM25 (bm25s)"
        sections.append(f"**{name}** (batched server: {stats.get('batches', 0)} searches for "
                        f"{stats.get('queries', 0)} queries, mean batch {mean_batch:.1f}, largest "
                        f"{stats.get('largest_batch', 0)})\n\n" + "\n".join(lines))
    cmd = "python bench/retriever_bench.py" + \
        (f" --dtype {args.dtype}" if args.dtype != "float32" else "") + \
        (f" --methods {' '.join(args.methods)}" if args.methods != ["dense"] else "")
    body = (f"Machine: {platform.machine()}, {os.cpu_count()} CPUs (server and load generator "
            f"share them). Command: `{cmd}`.\nOne NQ question per request, topk 3, index of the "
            f"shipped 21,012 passages. Baseline: the same server with `--batching off` (each "
            f"request encoded on its own in a thread pool, as Search-R1's server does). At least "
            f"{args.requests} timed requests per level after a warm-up.\n\n"
            + "\n\n".join(sections))
    print(body)
    if not args.no_write:
        write_section("Retriever server: batched vs per-request encoding", body)


if __name__ == "__main__":
    main()
