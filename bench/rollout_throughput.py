"""Rollout throughput: per-trajectory async manager vs a lockstep baseline.

Both modes use the same engine, model, prompts, seeds and tool-latency draws. Every env
step makes a real retrieval call (local BM25 server on loopback) after a simulated tool
latency drawn from a log-normal distribution (long-tailed: a few calls are much slower).

* ``async``: AgentGym's GenerationManager — each trajectory is its own task; the engine
  batches whatever requests are waiting.
* ``lockstep``: the same manager with two barriers around generation, so every turn
  all live trajectories generate together, the batch completes, then all tool calls run
  and the next turn waits for the slowest one (how Search-R1's manager advances).

    python bench/rollout_throughput.py                      # tiny model, writes docs/BENCHMARKS.md
    python bench/rollout_throughput.py --model smollm2-135m --prompts 8 --n 4

Figures are trajectories/s and generated tokens/s; the ratio async/lockstep is reported.

``--engines`` compares engines instead, at the ``make demo`` settings (the search env with
its local BM25 retriever, smollm2-135m, bf16 rollout copy, 4 prompts x n=4, 4 turns of up
to 128 tokens): today's default engine (continuous batching over the prefix cache)
against the static-batch engine without a cache (``engine.continuous_batching=false
engine.prefix_cache=false``, the engine before both existed), alternated on the same
prompts and seeds in one run:

    python bench/rollout_throughput.py --engines --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentgym.config import RolloutConfig  # noqa: E402
from agentgym.data.rows import load_rows  # noqa: E402
from agentgym.rollout.engines.hf import HFEngine  # noqa: E402
from agentgym.rollout.manager import GenerationManager  # noqa: E402
from agentgym.models.zoo import load_model, load_tokenizer, resolve_model  # noqa: E402
from agentgym.core.paths import data_dir  # noqa: E402
from agentgym.envs.base import AgentEnv  # noqa: E402
from agentgym.tools.local_retriever import LocalRetriever  # noqa: E402
from agentgym.tools.retriever import RetrieverClient, format_docs  # noqa: E402

from bench.report import write_section  # noqa: E402


class ToolLatencyEnv(AgentEnv):
    """Each step: sleep a log-normal tool latency, then a real retrieval with the action."""

    observation_format = "inline"
    stop_strings = ("</search>",)

    def __init__(self, client: RetrieverClient, median_s: float, sigma: float, max_turns: int):
        super().__init__(max_turns=max_turns)
        self.client, self.median_s, self.sigma = client, median_s, sigma

    def _reset(self, row):
        return [dict(m) for m in row["prompt"]], {}

    def _step(self, action, last_turn):
        time.sleep(self.median_s * float(np.exp(self.sigma * self.np_random.standard_normal())))
        docs = self.client.retrieve([action[:200] or "empty"])[0]
        self.count("tool_calls")
        return [{"role": "tool", "content": f"\n<information>{format_docs(docs)}</information>\n"}
                ], 0.0, False, {}


class _Barrier:
    """Reusable async barrier whose party count shrinks as trajectories finish."""

    def __init__(self, parties: int):
        self.parties, self.count, self.generation = parties, 0, 0
        self.cond = asyncio.Condition()

    async def wait(self):
        async with self.cond:
            gen = self.generation
            self.count += 1
            if self.count >= self.parties:
                self._release()
            else:
                await self.cond.wait_for(lambda: self.generation != gen)

    async def leave(self):
        async with self.cond:
            self.parties -= 1
            if self.count and self.count >= self.parties:
                self._release()

    def _release(self):
        self.count, self.generation = 0, self.generation + 1
        self.cond.notify_all()


class LockstepEngine:
    """Wraps an engine so all live trajectories generate turn by turn together."""

    def __init__(self, inner, parties: int):
        self.inner, self.policy_version = inner, inner.policy_version
        self.before, self.after = _Barrier(parties), _Barrier(parties)

    async def generate(self, prompt_ids, sampling, images=None, session_id=None):
        await self.before.wait()
        out = await self.inner.generate(prompt_ids, sampling)
        await self.after.wait()  # the batch returns only when all its rows are done
        return out

    async def leave(self):
        await self.before.leave()
        await self.after.leave()


def run_mode(mode, model, tok, url, rows, args) -> dict:
    engine = HFEngine(model, tok, max_batch_size=len(rows) * args.n, batch_wait_s=0.02,
                      seed=args.seed)
    total = len(rows) * args.n
    cfg = RolloutConfig(n=args.n, max_turns=args.turns, max_tokens_per_turn=args.tokens,
                        max_response_tokens=4096, temperature=1.0, max_concurrency=total,
                        env_workers=total, max_prompt_tokens=4096)
    client = RetrieverClient(url, topk=2, timeout=30)
    front = LockstepEngine(engine, total) if mode == "lockstep" else engine
    mgr = GenerationManager(front, tok, lambda: ToolLatencyEnv(client, args.latency_median,
                                                               args.latency_sigma, args.turns),
                            cfg, seed=args.seed)

    def done(_traj):
        if mode == "lockstep":
            asyncio.get_running_loop().create_task(front.leave())

    t0 = time.perf_counter()
    trajs = asyncio.run(mgr.run(rows, on_done=done))
    elapsed = time.perf_counter() - t0
    mgr.close()
    engine.close()
    client.close()
    gen = sum(t.num_sampled for t in trajs)
    return {"mode": mode, "seconds": elapsed, "traj_per_s": len(trajs) / elapsed,
            "tok_per_s": gen / elapsed, "generated": gen,
            # continuous batching: one token per live row per decode step
            "decode_steps": engine.stats["decode_steps"], "max_rows": engine.stats["max_rows"],
            "mean_rows": gen / max(engine.stats["decode_steps"], 1),
            "env_s": float(np.mean([t.metrics["env_s"] for t in trajs]))}


def machine_line() -> str:
    """The machine and this run's command, for the section written to BENCHMARKS.md."""
    import os

    import torch
    cmd = "python bench/rollout_throughput.py " + " ".join(sys.argv[1:])
    return (f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch threads "
            f"{torch.get_num_threads()}, CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}. Command: `{cmd.strip()}`.")


ENGINE_MODES = {"static, no cache": {"engine.continuous_batching": False,
                                     "engine.prefix_cache": False},
                "continuous + prefix cache": {}}


def run_engine_mode(name: str, rows: list[dict], args) -> dict:
    """One rollout of ``rows`` through the training path's own manager and engine."""
    from agentgym.config import build_config
    from agentgym.rollout.runtime import engine_for, env_factory
    cfg = build_config({"env": "search", "model": args.model, "engine.dtype": args.dtype,
                        "rollout.n": args.n, "rollout.max_turns": args.turns,
                        "rollout.max_tokens_per_turn": args.tokens,
                        "trainer.seed": args.seed, **ENGINE_MODES[name]})
    path = resolve_model(args.model)
    tok = load_tokenizer(path)
    engine = engine_for(cfg, path, tok)
    mgr = GenerationManager(engine, tok, env_factory(cfg), cfg.rollout, seed=args.seed)
    t0 = time.perf_counter()
    trajs = asyncio.run(mgr.run(rows, n=args.n))
    elapsed = time.perf_counter() - t0
    mgr.close()
    engine.close()
    gen = sum(t.num_sampled for t in trajs)
    s = engine.stats
    return {"mode": name, "seconds": elapsed, "traj_per_s": len(trajs) / elapsed,
            "tok_per_s": gen / elapsed, "generated": gen,
            "prefill_per_gen": s["prefilled_tokens"] / max(gen, 1),
            "cached_per_gen": s["cached_tokens"] / max(gen, 1)}


def engines_main(args) -> None:
    import random
    rows = load_rows("search", "train", None)
    random.Random(args.seed).shuffle(rows)
    results = []
    run_engine_mode("continuous + prefix cache", rows[:2], args)  # warm-up (and retriever)
    for rep in range(args.repeats):
        batch = rows[rep * args.prompts:(rep + 1) * args.prompts]
        for name in ENGINE_MODES:
            r = run_engine_mode(name, batch, args)
            results.append(r)
            print(f"{name:26s} {r['seconds']:6.1f}s  {r['traj_per_s']:5.2f} traj/s  "
                  f"{r['tok_per_s']:6.1f} gen tok/s  prefilled/generated "
                  f"{r['prefill_per_gen']:.2f}  cached/generated {r['cached_per_gen']:.2f}",
                  flush=True)

    def med(mode, key):
        return float(np.median([r[key] for r in results if r["mode"] == mode]))
    old, new = ENGINE_MODES  # run in this order in every repeat
    ratio = med(new, "tok_per_s") / med(old, "tok_per_s")
    pairs = [b["tok_per_s"] / a["tok_per_s"] for a, b in zip(results[0::2], results[1::2])]
    print(f"generated tokens/s, new / old: {ratio:.2f}x of the medians, "
          f"{float(np.median(pairs)):.2f}x median of the pairs (per pair: "
          f"{', '.join(f'{p:.2f}' for p in pairs)})")
    lines = [
        machine_line(),
        f"The `make demo` rollout: env `search` (local BM25 retriever), `{args.model}` with a "
        f"{args.dtype} rollout copy, {args.prompts} prompts x n={args.n}, up to {args.turns} "
        f"turns of {args.tokens} sampled tokens, temperature 1. Each repeat takes the next "
        f"{args.prompts} shuffled training prompts and runs both engines on them with the same "
        f"seeds, old engine first. Median of {args.repeats} repeats.", "",
        "| engine | trajectories/s | generated tokens/s | prefilled / generated tokens "
        "| reused from cache / generated |",
        "|---|---|---|---|---|",
    ]
    for mode in ENGINE_MODES:
        lines.append(f"| {mode} | {med(mode, 'traj_per_s'):.2f} | {med(mode, 'tok_per_s'):.1f} "
                     f"| {med(mode, 'prefill_per_gen'):.2f} | {med(mode, 'cached_per_gen'):.2f} |")
    lines += ["", f"**Generated tokens/s, continuous + prefix cache / static: {ratio:.2f}x** "
              f"(ratio of the medians; per repeat: {', '.join(f'{p:.2f}x' for p in pairs)}, "
              f"median {float(np.median(pairs)):.2f}x)."]
    if not args.no_write:
        write_section(f"Rollout engine: prefix cache and continuous batching ({args.model})",
                      "\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", action="store_true",
                    help="compare engines at the make demo settings (see the docstring)")
    ap.add_argument("--dtype", default="bfloat16", help="--engines: rollout copy's dtype")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48, help="max new tokens per turn")
    ap.add_argument("--latency-median", type=float, default=0.15)
    ap.add_argument("--latency-sigma", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    if args.engines:
        for key, demo in (("model", "smollm2-135m"), ("prompts", 4), ("tokens", 128)):
            if getattr(args, key) == ap.get_default(key):
                setattr(args, key, demo)
        return engines_main(args)

    path = resolve_model(args.model)
    model, tok = load_model(path), load_tokenizer(path)
    rows = load_rows("search", "train", args.prompts)
    results = []
    with LocalRetriever(data_dir() / "corpus" / "wiki_passages.jsonl.gz") as retr:
        run_mode("async", model, tok, retr.url, rows[:2], args)  # warm-up
        for _ in range(args.repeats):
            for mode in ("lockstep", "async"):
                r = run_mode(mode, model, tok, retr.url, rows, args)
                results.append(r)
                print(f"{mode:9s} {r['seconds']:6.2f}s  {r['traj_per_s']:6.2f} traj/s  "
                      f"{r['tok_per_s']:7.0f} tok/s  decode steps {r['decode_steps']:4d} "
                      f"(rows: mean {r['mean_rows']:.1f}, most {r['max_rows']})", flush=True)

    def med(mode, key):
        return float(np.median([r[key] for r in results if r["mode"] == mode]))

    ratio = med("async", "traj_per_s") / med("lockstep", "traj_per_s")
    print(f"async / lockstep trajectories/s: {ratio:.2f}x")
    lines = [
        machine_line(),
        f"Model `{args.model}`, {args.prompts} prompts x n={args.n} = {args.prompts * args.n} "
        f"trajectories, {args.turns} turns of up to {args.tokens} sampled tokens, temperature 1. "
        f"Each env step: log-normal tool latency (median {args.latency_median}s, "
        f"sigma {args.latency_sigma}) then a real BM25 retrieval on loopback. "
        f"Median of {args.repeats} runs per mode.", "",
        "| mode | trajectories/s | generated tokens/s | decode steps | generated tokens per "
        "decode step | most rows decoded together |",
        "|---|---|---|---|---|---|",
    ]
    for mode in ("lockstep", "async"):
        lines.append(f"| {mode} | {med(mode, 'traj_per_s'):.2f} | {med(mode, 'tok_per_s'):.0f} | "
                     f"{med(mode, 'decode_steps'):.0f} | {med(mode, 'mean_rows'):.1f} | "
                     f"{med(mode, 'max_rows'):.0f} |")
    lines += ["", f"**async / lockstep: {ratio:.2f}x trajectories/s.**"]
    if not args.no_write:
        write_section(f"Rollout throughput ({args.model})", "\n".join(lines))


if __name__ == "__main__":
    main()
