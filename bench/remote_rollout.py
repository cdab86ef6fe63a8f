"""Remote vs in-process rollout: the SGLang client against ``agentgym serve`` on loopback.

Same model, prompts, seeds and env (the search env with a real BM25 retriever on
loopback) in every mode:

* ``in-process``: the HF engine in this process (the CPU default), 2 torch threads.
* ``served x1``: one ``agentgym serve`` process (2 torch threads) through
  :class:`agentgym.rollout.engines.sglang.SGLangEngine`: JSON over HTTP per turn.
* ``served x2``: two servers (1 torch thread each), trajectories routed sticky /
  least-loaded by the client.

Also the cost of pushing new weights after a step: in-process ``load_state_dict`` vs
``engine.weight_sync=disk`` (safetensors to a folder + ``/update_weights_from_disk``) vs
``distributed`` (a gloo broadcast group + ``/update_weights_from_distributed``).

    python bench/remote_rollout.py                         # tiny; writes docs/BENCHMARKS.md
    python bench/remote_rollout.py --model smollm2-135m --prompts 4 --n 4

No SGLang server runs on these machines (it needs a CUDA GPU), so no SGLang figure is
reported here.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from agentgym.config import Config  # noqa: E402
from agentgym.data.rows import load_rows  # noqa: E402
from agentgym.rollout.engines.base import push_weights  # noqa: E402
from agentgym.rollout.engines.hf import HFEngine  # noqa: E402
from agentgym.rollout.engines.launcher import launch_serve  # noqa: E402
from agentgym.rollout.engines.sglang import SGLangEngine  # noqa: E402
from agentgym.rollout.manager import GenerationManager  # noqa: E402
from agentgym.models.zoo import load_model, load_tokenizer, resolve_model  # noqa: E402
from agentgym.core.paths import data_dir  # noqa: E402
from agentgym.rollout.runtime import env_factory  # noqa: E402
from agentgym.tools.local_retriever import LocalRetriever  # noqa: E402

from bench.report import write_section  # noqa: E402


def rollout(engine, tok, cfg: Config, rows) -> dict:
    manager = GenerationManager(engine, tok, env_factory(cfg), cfg.rollout, seed=cfg.trainer.seed)
    t0 = time.perf_counter()
    try:
        trajs = asyncio.run(manager.run(rows))
    finally:
        manager.close()
    elapsed = time.perf_counter() - t0
    gen = sum(t.num_sampled for t in trajs)
    return {"seconds": elapsed, "traj_per_s": len(trajs) / elapsed, "tok_per_s": gen / elapsed,
            "turns": sum(t.metrics["turns"] for t in trajs) / len(trajs)}


def push(engine, state_dict, version) -> float:
    t0 = time.perf_counter()
    push_weights(engine, state_dict, version)
    return time.perf_counter() - t0


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48, help="max new tokens per turn")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--syncs", type=int, default=3, help="weight pushes timed per mode")
    ap.add_argument("--no-write", action="store_true", help="print only")
    return ap.parse_args()


def _run_modes(args: argparse.Namespace, path, model, tok, rows
               ) -> tuple[dict[str, list[dict]], dict[str, list[float]]]:
    """Rollouts and weight pushes in each mode (module docstring): name -> each repeat's
    figures, and path -> each push's seconds."""
    results: dict[str, list[dict]] = {}
    syncs: dict[str, list[float]] = {}
    with LocalRetriever(data_dir() / "corpus" / "wiki_passages.jsonl.gz") as retr:
        cfg = Config()
        cfg.env, cfg.retriever.url = "search", retr.url
        cfg.rollout = dataclasses.replace(cfg.rollout, n=args.n, max_tokens_per_turn=args.tokens,
                                          max_concurrency=args.prompts * args.n)

        def measure(name, engine):
            rollout(engine, tok, cfg, rows[:2])  # warm-up
            for _ in range(args.repeats):
                r = rollout(engine, tok, cfg, rows)
                results.setdefault(name, []).append(r)
                print(f"{name:11s} {r['seconds']:6.2f}s {r['traj_per_s']:6.2f} traj/s "
                      f"{r['tok_per_s']:7.0f} tok/s turns {r['turns']:.2f}", flush=True)

        engine = HFEngine(copy.deepcopy(model), tok, max_batch_size=64)
        measure("in-process", engine)
        syncs["in-process"] = [push(engine, model.state_dict(), v + 1) for v in range(args.syncs)]
        engine.close()

        one = launch_serve(str(path), extra_args=["--max-batch-size", "64"])
        try:
            engine = SGLangEngine([one.url], tok)
            measure("served x1", engine)
            syncs["served x1, disk"] = [push(engine, model.state_dict(), v + 1)
                                        for v in range(args.syncs)]
            engine.close()
            engine = SGLangEngine([one.url], tok, weight_sync="distributed")
            syncs["served x1, distributed"] = [push(engine, model.state_dict(), v + 1)
                                               for v in range(args.syncs + 1)][1:]  # w/o setup
            engine.close()
        finally:
            one.stop()

        os.environ["OMP_NUM_THREADS"] = "1"  # each server its own core
        two = [launch_serve(str(path), extra_args=["--max-batch-size", "64"]) for _ in range(2)]
        os.environ.pop("OMP_NUM_THREADS")
        try:
            engine = SGLangEngine([s.url for s in two], tok)
            measure("served x2", engine)
            engine.close()
        finally:
            for s in two:
                s.stop()
    return results, syncs


def _report(args: argparse.Namespace, model, results: dict[str, list[dict]],
            syncs: dict[str, list[float]]) -> list[str]:
    """The section's lines: the setting, each mode's medians, each push path's."""

    def med(name, key):
        return statistics.median(r[key] for r in results[name])

    base = med("in-process", "traj_per_s")
    cmd = "python bench/remote_rollout.py " + " ".join(sys.argv[1:])
    params = sum(p.numel() for p in model.parameters()) / 1e6
    lines = [
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs. Command: `{cmd.strip()}`.",
        f"Model `{args.model}` ({params:.1f}M parameters, fp32). Search env, real BM25 "
        f"retriever on loopback; {args.prompts} prompts x n={args.n}, up to "
        f"{args.tokens} tokens per turn, temperature 1, same seeds in every mode. Median of "
        f"{args.repeats} runs after a warm-up. No SGLang server was run (no GPU here).", "",
        "| engine | trajectories/s | generated tokens/s | vs in-process |",
        "|---|---|---|---|",
    ]
    for name in results:
        lines.append(f"| {name} | {med(name, 'traj_per_s'):.2f} | {med(name, 'tok_per_s'):.0f} | "
                     f"{med(name, 'traj_per_s') / base:.2f}x |")
    lines += ["", "Weight push after a step (median seconds, the engine paused):", "",
              "| path | seconds |", "|---|---|"]
    for name, ts in syncs.items():
        lines.append(f"| {name} | {statistics.median(ts):.3f} |")
    return lines


def main() -> None:
    args = _args()
    torch.set_num_threads(2)
    path = resolve_model(args.model)
    tok = load_tokenizer(path)
    model = load_model(path)
    rows = load_rows("search", "train", args.prompts)
    results, syncs = _run_modes(args, path, model, tok, rows)
    lines = _report(args, model, results, syncs)
    print("\n".join(lines))
    if not args.no_write:
        write_section(f"Remote vs in-process rollout ({args.model}, CPU)", "\n".join(lines))


if __name__ == "__main__":
    main()
