"""Where the engine's steps run on the CPU: its own thread, or the trainer's (``Engine.run``).

A training step on the CPU is a rollout, then an update on the main thread. With the
engine stepping on its own thread, two threads run parallel torch ops and libgomp keeps two
OpenMP teams on two cores: it then cuts its spin-wait and every parallel op pays a thread
wake-up, in the engine *and* in the update (docs/decisions/engine.md, "Two OpenMP teams").
:meth:`HFEngine.run <agentgym.rollout.engines.hf.HFEngine.run>` runs the steps on the
calling thread instead (the event loop moves to a helper thread). This measures both, as a
training step does them: a rollout of ``--batch`` requests of ``--new`` sampled tokens
(smollm2-135m's shape, random weights, fp32), then ``--updates`` AdamW steps of a second
copy of the model on 8 x 160 tokens; ``--reps`` such steps per process.

Each mode runs in its own process (once a second team exists a process cannot go back),
the processes alternated A-B-A-B ``--pairs`` times; the first step of each process is a
warm-up, left out. Medians over the rest.

    python bench/engine_thread.py            # writes docs/BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import machine, write_section  # noqa: E402

MODES = {"own thread": "asyncio.run", "trainer's thread": "engine.run"}


def one_process(mode: str, args) -> list[dict]:
    """``--reps`` training-like steps in this process, the engine driven by ``mode``."""
    import torch

    import bench.engine_speed as es
    from agentgym.core.types import SamplingParams
    model = es.random_model("smollm2-135m", torch.float32, "cpu", args.layers)
    trainer = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-6)
    engine = es.our_engine(model, args.batch)
    batch = es.prompts(args.batch, model.config.vocab_size)
    ids = torch.randint(100, model.config.vocab_size, (8, 160),
                        generator=torch.Generator().manual_seed(0))

    async def rollout():
        return await asyncio.gather(*(engine.generate(p, SamplingParams(
            max_new_tokens=args.new, temperature=1.0, seed=k)) for k, p in enumerate(batch)))
    steps = []
    try:
        for _ in range(args.reps):
            engine.flush_cache()
            t0 = time.perf_counter()
            (engine.run if mode == "engine.run" else asyncio.run)(rollout())
            t1 = time.perf_counter()
            for _ in range(args.updates):
                trainer(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
            steps.append({"rollout": t1 - t0, "update": time.perf_counter() - t1})
    finally:
        engine.close()
    return steps


def table(results: dict[str, list[dict]]) -> str:
    med = {name: {k: statistics.median(s[k] for s in steps) for k in ("rollout", "update")}
           for name, steps in results.items()}
    own, ours = med["own thread"], med["trainer's thread"]
    lines = ["| engine steps on | rollout (s) | update (s) | rollout + update (s) | steps |",
             "|---|---|---|---|---|"]
    for name, m in med.items():
        lines.append(f"| {name} (`{MODES[name]}`) | {m['rollout']:.2f} | {m['update']:.2f} | "
                     f"{m['rollout'] + m['update']:.2f} | {len(results[name])} |")
    speed = {k: own[k] / ours[k] for k in ("rollout", "update")}
    both = (own["rollout"] + own["update"]) / (ours["rollout"] + ours["update"])
    return ("\n".join(lines) + f"\n\nThe trainer's thread / own thread (above 1: faster on the "
            f"trainer's thread): rollout **{speed['rollout']:.2f}x**, update "
            f"**{speed['update']:.2f}x**, the two together **{both:.2f}x**.")


def main(argv=None) -> str | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--updates", type=int, default=2)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--layers", type=int, default=0, help="fewer layers than the shape's "
                    "(0: its own; a quick check of the benchmark itself)")
    ap.add_argument("--out", default=None, help="page to write (default docs/BENCHMARKS.md); "
                    "'none' writes nothing")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(one_process(args.child, args)))
        return
    own = [f"--{k}={getattr(args, k)}" for k in ("batch", "new", "updates", "reps", "pairs",
                                                  "layers")]
    results: dict[str, list[dict]] = {name: [] for name in MODES}
    for pair in range(args.pairs):
        for name, mode in (MODES.items() if pair % 2 == 0 else reversed(MODES.items())):
            out = subprocess.run([sys.executable, __file__, *own, "--child", mode],
                                 check=True, capture_output=True, text=True).stdout
            steps = json.loads(out.strip().splitlines()[-1])[1:]  # the first: a warm-up
            results[name] += steps
            print(f"{name}: " + ", ".join(f"{s['rollout']:.2f} + {s['update']:.2f} s"
                                          for s in steps), flush=True)
    import torch
    command = "python bench/engine_thread.py " + " ".join(own)
    body = (f"Machine: {machine()}; torch {torch.__version__}, one process per run. Command: "
            f"`{command.strip()}`. smollm2-135m's shape (random weights, fp32): a rollout of "
            f"{args.batch} requests x {args.new} sampled tokens, then {args.updates} AdamW "
            f"steps of a second copy on 8 x 160 tokens; {args.reps} such steps per process "
            f"(the first left out), {args.pairs} processes per mode, alternated; medians.\n\n"
            + table(results))
    if args.out != "none":
        write_section("Engine steps on the trainer's thread (CPU)", body,
                      Path(args.out) if args.out else ROOT / "docs" / "BENCHMARKS.md")
    print(body)
    return body


if __name__ == "__main__":
    main()
