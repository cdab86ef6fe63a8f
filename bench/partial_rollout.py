"""Partial rollouts against waiting for in-flight generations, asynchronous training.

    python bench/partial_rollout.py                        # toy and search, writes docs/
    python bench/partial_rollout.py --envs toy --steps 10 --no-write

``trainer.mode=async`` with ``rollout.partial=false`` (a weight update waits until every
generation in flight has finished on the old weights) and ``rollout.partial=true`` (they
stop at the next decode step, and continue under the new weights after a re-prefill),
side by side in one run, seed-major so both see the same machine. Envs: the long-tail toy
env of bench/async_vs_sync.py (1-6 turns, log-normal tool latency, 64 tokens a turn) and
search (the shipped corpus and BM25 retriever, 4 turns of up to 64 tokens). Model
``tiny``. Reported per arm: the median step time, trained samples per second, generated
tokens per second of rollout, the staleness of the trained trajectories (by their oldest
token) and of their tokens, the share of trajectories whose tokens span two versions, and
how many requests the updates interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentgym import envs  # noqa: E402
from agentgym.config import build_config  # noqa: E402
from agentgym.data.rows import write_jsonl  # noqa: E402
from bench.async_vs_sync import ENV_ID, rows  # noqa: E402
from bench.report import write_section  # noqa: E402


def run(name: str, overrides: dict, out: Path) -> dict:
    from agentgym.trainers.loop import train
    cfg = build_config({**overrides, "run_dir": str(out / name), "trainer.resume": "never"})
    t0 = time.perf_counter()
    run_dir = train(cfg)
    wall = time.perf_counter() - t0
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "rollout/reward" in m]
    per_step = cfg.trainer.prompts_per_step * cfg.rollout.n
    gen = sum(m.get("rollout/generated_tokens", 0.0) * per_step for m in steps)
    mean = lambda k: statistics.mean(m.get(k, 0.0) for m in steps)  # noqa: E731
    return {"name": name, "wall": wall, "step_s": statistics.median(m["time/step_s"] for m in steps),
            "samples_per_s": per_step * len(steps) / wall, "gen_tok_per_s": gen / wall,
            "staleness": mean("async/staleness_mean"),
            "token_staleness": mean("async/token_staleness_mean"),
            "token_staleness_max": max(m.get("async/token_staleness_max", 0.0) for m in steps),
            "mixed": mean("async/mixed_version_share"),
            "preempted": steps[-1].get("engine/preempted", float("nan")),
            "reward": statistics.mean(m["rollout/reward"] for m in steps[-5:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--envs", nargs="+", default=["toy", "search"], choices=["toy", "search"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--staleness", type=int, default=1)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if ENV_ID not in envs.env_ids():
        envs.register_env(ENV_ID, "bench.async_vs_sync:SlowLetterEnv")
    tmp = tempfile.TemporaryDirectory(prefix="agentgym-partial-bench-")  # gone at exit
    out = Path(tmp.name)
    data = out / "toy.jsonl"
    write_jsonl(data, rows(args.steps * 4 * 2, 0.05))
    common = {"model": "tiny", "trainer.total_steps": args.steps, "trainer.prompts_per_step": 4,
              "rollout.n": 4, "rollout.max_tokens_per_turn": 64, "trainer.lr": 1e-2,
              "trainer.eval_limit": 0, "trainer.save_every": 10 ** 6,
              "trainer.mode": "async", "trainer.max_staleness": args.staleness,
              "trainer.cold_start": "off"}
    bases = {"toy": {**common, "env": ENV_ID, "data": str(data), "rollout.max_turns": 6,
                     "rollout.max_response_tokens": 1024},
             "search": {**common, "env": "search", "rollout.max_turns": 4}}
    results: dict[tuple[str, bool], list[dict]] = {}
    t0 = time.perf_counter()
    for env in args.envs:
        run(f"warm-up {env}", {**bases[env], "trainer.total_steps": 1}, out)
        for seed in [int(s) for s in args.seeds.split(",")]:
            for partial in (False, True):
                r = run(f"{env} partial={partial} seed {seed}",
                        {**bases[env], "rollout.partial": partial, "trainer.seed": seed}, out)
                results.setdefault((env, partial), []).append(r)
                print(f"{r['name']:32s} step {r['step_s']:.2f}s  {r['samples_per_s']:.2f} "
                      f"samples/s  {r['gen_tok_per_s']:.0f} gen tok/s  staleness "
                      f"{r['staleness']:.2f}  token staleness {r['token_staleness']:.2f}  "
                      f"mixed {r['mixed']:.2f}  interrupted {r['preempted']}", flush=True)
    cmd = "python bench/partial_rollout.py " + " ".join(sys.argv[1:])
    lines = [f"Machine: {platform.machine()}, {os.cpu_count()} CPUs. Command: `{cmd.strip()}` "
             f"({time.perf_counter() - t0:.0f} s). `trainer.mode=async`, "
             f"`trainer.max_staleness={args.staleness}`, model `tiny`, {args.steps} steps of 4 "
             f"prompts x 4 samples, 64 tokens a turn, seeds {args.seeds}; each cell the mean "
             "over seeds. Toy: the long-tail env of the async benchmark (1-6 turns, log-normal "
             "tool latency, median 0.05 s); search: the shipped corpus, BM25, 4 turns.", "",
             "| env | rollout.partial | s/step (median) | trained samples/s | vs partial=false "
             "| generated tok/s | staleness (trajectory) | staleness (token) | max token "
             "staleness | trajectories spanning 2 versions | requests interrupted |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    m = lambda rs, k: statistics.mean(r[k] for r in rs)  # noqa: E731
    for (env, partial), rs in results.items():
        base = results[(env, False)]
        gain = statistics.mean(r["samples_per_s"] / b["samples_per_s"] for r, b in zip(rs, base))
        lines.append(f"| {env} | {str(partial).lower()} | {m(rs, 'step_s'):.2f} | "
                     f"{m(rs, 'samples_per_s'):.2f} | {gain:.2f}x | {m(rs, 'gen_tok_per_s'):.0f} | "
                     f"{m(rs, 'staleness'):.2f} | {m(rs, 'token_staleness'):.2f} | "
                     f"{max(r['token_staleness_max'] for r in rs):.0f} | {m(rs, 'mixed'):.2f} | "
                     f"{m(rs, 'preempted'):.0f} |")
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section("Partial rollouts (tiny, CPU)", body)


if __name__ == "__main__":
    main()
