"""Training backends on this machine: optimizer-step time and weight-sync time.

    python bench/backends_step.py                                  # smollm2-135m, writes docs/
    python bench/backends_step.py --model tiny --steps 5 --no-write

Every backend takes the same optimizer steps of the GRPO policy loss on the same
synthetic multi-turn batches (``--seqs`` sequences of ``--tokens`` tokens, 3/4 of them
sampled), fp32, AdamW: ``single`` (one process, all cores) against ``fsdp`` (FSDP2)
and ``deepspeed`` ZeRO-1/2/3, each over ``--nprocs`` rank processes sharing the cores
(``cores / nprocs`` threads each). The first step is a warm-up, left out; medians over
the rest. Weight sync is what the recipe does after each step: the full state dict to
the driver (``backend.state_dict()``: gathered on rank 0 and sent over the loopback
socket for the sharded backends) and loaded into a rollout engine's copy of the model.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from agentgym.config import build_config  # noqa: E402
from agentgym.models.zoo import load_model, load_tokenizer, resolve_model  # noqa: E402
from agentgym.core.types import Trajectory  # noqa: E402
from bench.report import write_section  # noqa: E402
from agentgym.trainers.backends.base import ModelSpec  # noqa: E402
from agentgym.trainers.batch import collate  # noqa: E402
from agentgym.trainers.phases import make_loss_fn  # noqa: E402

CONFIGS = [("single", {}), ("fsdp", {}), ("deepspeed ZeRO-1", {"zero_stage": 1}),
           ("deepspeed ZeRO-2", {"zero_stage": 2}), ("deepspeed ZeRO-3", {"zero_stage": 3})]


def make_batch(tokenizer, seqs: int, tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    vocab = len(tokenizer)
    trajs = []
    for i in range(seqs):
        t = Trajectory(uid=str(i // 4), reward=float(i % 2))
        rand = lambda n: torch.randint(5, vocab - 1, (n,), generator=g).tolist()  # noqa: E731
        p = tokens // 4
        gen = (tokens - p) // 2
        t.append("prompt", rand(p), 0)
        t.append("generated", rand(gen), 0, logprobs=[-1.0] * gen)
        t.append("observation", rand(8), 0)
        t.append("generated", rand(tokens - p - gen - 8), 1,
                 logprobs=[-1.0] * (tokens - p - gen - 8))
        trajs.append(t)
    b = collate(trajs, tokenizer.pad_token_id)
    b.adv = torch.randn(seqs, generator=g)[:, None] * b.loss_mask
    return b


def run(name: str, opts: dict, a, path: Path, tok) -> dict:
    from agentgym.trainers.backends.factory import make_backend
    over = {"trainer.micro_batch_tokens": a.micro_batch_tokens, "trainer.lr": 1e-5}
    if name != "single":
        over.update({"trainer.backend": name.split()[0], "trainer.nprocs": a.nprocs})
        over.update({f"trainer.{k}": v for k, v in opts.items()})
    cfg = build_config(over)
    t0 = time.perf_counter()
    backend = make_backend(cfg, ModelSpec(str(path)), 1e-5)
    start_s = time.perf_counter() - t0
    engine_model = load_model(path)
    steps, syncs = [], []
    try:
        for s in range(a.steps):
            b = make_batch(tok, a.seqs, a.tokens, s)
            loss = make_loss_fn(cfg, 1.0, float(b.loss_mask.sum()), len(b), a.tokens)
            t0 = time.perf_counter()
            backend.train_step(backend.split(b), loss)
            steps.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            engine_model.load_state_dict(backend.state_dict(), strict=True)
            syncs.append(time.perf_counter() - t0)
    finally:
        backend.close()
    step = statistics.median(steps[1:])
    return {"start_s": start_s, "step_s": step, "tok_s": a.seqs * a.tokens / step,
            "sync_s": statistics.median(syncs[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--micro-batch-tokens", type=int, default=2048)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    path = resolve_model(a.model)
    tok = load_tokenizer(path)
    params = sum(p.numel() for p in load_model(path).parameters())
    results = {}
    for name, opts in CONFIGS:
        results[name] = run(name, opts, a, path, tok)
        r = results[name]
        print(f"{name:18s} start {r['start_s']:6.1f}s  step {r['step_s']:7.2f}s  "
              f"{r['tok_s']:7.0f} tok/s  sync {r['sync_s']:.3f}s", flush=True)
    base = results["single"]["step_s"]
    lines = [f"Machine: {platform.machine()}, {os.cpu_count()} CPUs. Command: "
             f"`python bench/backends_step.py --model {a.model} --steps {a.steps} "
             f"--seqs {a.seqs} --tokens {a.tokens} --nprocs {a.nprocs} "
             f"--micro-batch-tokens {a.micro_batch_tokens}`.",
             f"Model `{a.model}` ({params / 1e6:.1f}M parameters), fp32, AdamW; one optimizer "
             f"step over {a.seqs} sequences of {a.tokens} tokens (micro-batches of "
             f"{a.micro_batch_tokens} tokens), GRPO policy loss; {a.steps} steps, the first "
             f"left out, medians. Sharded backends: {a.nprocs} rank processes on gloo, "
             f"{max(1, (os.cpu_count() or 1) // a.nprocs)} torch thread(s) each; single: one "
             f"process, {torch.get_num_threads()} threads.", "",
             "| backend | step (s) | tokens/s | vs single | weight sync (s) | start-up (s) |",
             "|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['step_s']:.2f} | {r['tok_s']:.0f} | "
                     f"{base / r['step_s']:.2f}x | {r['sync_s']:.3f} | {r['start_s']:.1f} |")
    body = "\n".join(lines)
    print(body)
    if not a.no_write:
        write_section(f"Training backends: step and weight-sync time ({a.model}, CPU)", body)


if __name__ == "__main__":
    main()
