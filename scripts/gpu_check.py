"""``make gpu-check``: on a machine with a CUDA GPU, run the tests marked ``gpu`` and
measure the GPU path, then write docs/GPU.md. Without CUDA it says so and exits 0, writing
nothing.

Measured (smollm2-135m, the policy's defaults on a GPU: bf16 rollout copy, bf16 autocast
over fp32 master weights, SDPA or flash attention):

- generation tokens/s: the HF engine, 64 prompts x up to 256 sampled tokens, continuous
  batching (tokens counted as generated);
- update tokens/s and MFU: SFT-style forward+backward+AdamW steps on 8 x 1024-token
  sequences; MFU = 6 x parameters x tokens/s over the GPU's dense bf16 peak (known cards);
- peak memory of each, and of the 20-step GRPO run (``perf/peak_memory_gb``);
- drift: the engine's against the trainer's logprobs of the same sampled tokens over that
  run (``rollout/drift_mean``, ``rollout/drift_max``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: dense bf16 tensor-core peak, FLOP/s, by a substring of the card's name (no sparsity)
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12,
             "A10": 125e12, "4090": 165e12, "3090": 71e12}


def _peak_flops(name: str) -> float | None:
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def _generation(path: str) -> dict:
    import asyncio

    import torch

    from agentgym.core.device import peak_memory_gb, resolve_device
    from agentgym.rollout.engines.hf import HFEngine
    from agentgym.models.zoo import load_model, load_tokenizer
    from agentgym.core.types import SamplingParams
    device = resolve_device("auto")
    tok = load_tokenizer(path)
    engine = HFEngine(load_model(path, dtype="bfloat16", device=device), tok, max_batch_size=64)
    prompts = [tok.encode(f"Question {i}: who wrote the book number {i}? Think, then answer.")
               for i in range(64)]
    sampling = SamplingParams(max_new_tokens=256, temperature=1.0, seed=0)

    async def go():
        return await asyncio.gather(*(engine.generate(p, sampling, session_id=f"g{i}")
                                      for i, p in enumerate(prompts)))
    try:
        asyncio.run(go())  # warm-up: kernels, allocator
        peak_memory_gb(device)
        t0 = time.perf_counter()
        outs = asyncio.run(go())
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    finally:
        engine.close()
    tokens = sum(len(o.ids) for o in outs)
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "peak_memory_gb": peak_memory_gb(device)}


def _update(path: str) -> dict:
    import torch

    from agentgym.core.device import peak_memory_gb, resolve_device
    from agentgym.core.types import Trajectory
    from trainers.backends.base import ModelSpec
    from trainers.backends.single import SingleBackend
    from trainers.batch import collate
    from trainers.sft import sft_loss_fn
    device = resolve_device("auto")
    model = ModelSpec(path).load(device)
    params = sum(p.numel() for p in model.parameters())
    backend = SingleBackend(model, lr=1e-6, micro_batch_tokens=8 * 1024, mixed_precision="bf16",
                            logprob_chunk=1024)
    g = torch.Generator().manual_seed(0)
    trajs = []
    for i in range(8):
        t = Trajectory(uid=str(i))
        t.append("prompt", torch.randint(5, 40000, (24,), generator=g).tolist(), 0)
        t.append("generated", torch.randint(5, 40000, (1000,), generator=g).tolist(), 0,
                 logprobs=[0.0] * 1000)
        trajs.append(t)
    batch = collate(trajs, 0)
    tokens = int(batch.attention_mask.sum())
    loss = sft_loss_fn(float(batch.loss_mask.sum()), chunk=1024)
    for _ in range(2):  # warm-up
        backend.train_step(backend.split(batch), loss)
    peak_memory_gb(device)
    steps = 5
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        backend.train_step(backend.split(batch), loss)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    tps = steps * tokens / wall
    return {"params": params, "tokens_per_s": tps, "flops_per_s": 6 * params * tps,
            "peak_memory_gb": peak_memory_gb(device), "seq_len": batch.input_ids.shape[1]}


def _grpo_figures(run: Path) -> dict:
    lines = (run / "metrics.jsonl").read_text().splitlines() if \
        (run / "metrics.jsonl").exists() else []
    steps = [m for m in map(json.loads, lines) if "rollout/reward" in m]
    if not steps:
        return {}

    def col(key):
        return [m[key] for m in steps if key in m]
    return {"steps": len(steps), "reward": col("rollout/reward"),
            "drift_mean": max(col("rollout/drift_mean") or [float("nan")]),
            "drift_max": max(col("rollout/drift_max") or [float("nan")]),
            "peak_memory_gb": max(col("perf/peak_memory_gb") or [float("nan")]),
            "step_s": sum(col("time/step_s")) / len(steps)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "GPU.md"))
    ap.add_argument("--work", default=str(ROOT / "runs" / "gpu_check"))
    a = ap.parse_args()
    import torch

    from agentgym.core.device import cuda_available
    if not cuda_available():
        print(f"gpu-check: torch {torch.__version__} sees no CUDA device on this machine "
              f"(CUDA build: {torch.version.cuda or 'no'}); nothing measured, "
              f"{Path(a.out).name} left as it is")
        return 0
    from agentgym.models.zoo import resolve_model
    name = torch.cuda.get_device_name()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    run = work / "grpo"
    print(f"gpu-check on {name}: the tests marked gpu", flush=True)
    t0 = time.perf_counter()
    tests = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs",
                            "tests/test_gpu.py"], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "AGENTGYM_GPU_RUN_DIR": str(run)})
    print(tests.stdout[-3000:], tests.stderr[-2000:], flush=True)
    summary = (tests.stdout.strip().splitlines() or ["(no output)"])[-1]
    tests_s = time.perf_counter() - t0
    path = str(resolve_model("smollm2-135m"))
    print("gpu-check: generation throughput", flush=True)
    gen = _generation(path)
    print("gpu-check: update throughput", flush=True)
    upd = _update(path)
    grpo = _grpo_figures(run)
    peak = _peak_flops(name)
    mfu = f"{upd['flops_per_s'] / peak:.1%}" if peak else "– (peak of this card not in the table)"
    props = torch.cuda.get_device_properties(0)
    rows = [
        ("tests marked gpu (`pytest -m gpu tests/test_gpu.py`)", f"{summary} ({tests_s:.0f} s)"),
        ("generation, HF engine, bf16, 64 prompts x up to 256 tokens",
         f"{gen['tokens_per_s']:.0f} tokens/s (peak memory {gen['peak_memory_gb']:.2f} GiB)"),
        (f"update, 8 x {upd['seq_len']} tokens, bf16 autocast, AdamW",
         f"{upd['tokens_per_s']:.0f} tokens/s, {upd['flops_per_s'] / 1e12:.1f} TFLOP/s, "
         f"MFU {mfu} (peak memory {upd['peak_memory_gb']:.2f} GiB)"),
    ]
    if grpo:
        rows += [("GRPO on search, 20 steps x 16 prompts x 8 samples (the gpu test's run)",
                  f"{grpo['step_s']:.1f} s/step, peak memory {grpo['peak_memory_gb']:.2f} GiB, "
                  f"reward {grpo['reward'][0]:.3f} → {grpo['reward'][-1]:.3f}"),
                 ("drift, engine vs trainer logprobs over that run (largest step value)",
                  f"mean {grpo['drift_mean']:.4f}, max {grpo['drift_max']:.3f}")]
    text = "\n".join([
        "# GPU check", "",
        f"_Measured {dt.date.today().isoformat()} by `make gpu-check`._", "",
        f"GPU: {name} ({props.total_memory / 2**30:.0f} GiB), torch {torch.__version__} (CUDA "
        f"{torch.version.cuda}), model smollm2-135m ({upd['params'] / 1e6:.0f}M parameters).",
        "", "| what | measured |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows], "",
        f"Peak used for MFU: {peak / 1e12:.0f} TFLOP/s dense bf16." if peak else "", ""])
    Path(a.out).write_text(text)
    print(text)
    return 0 if tests.returncode == 0 else tests.returncode


if __name__ == "__main__":
    sys.exit(main())
