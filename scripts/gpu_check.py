"""``make gpu-check``: on a machine with a CUDA GPU, run the tests marked ``gpu`` and
measure the GPU path, writing docs/GPU.md after every stage (a call cut short still leaves
its figures). Without CUDA it says so and exits 0, writing nothing; ``--cpu-smoke`` runs
every stage but the tests on the CPU with tiny shapes and short sequences, to a file of
your choosing, to find a stage's bug before a lent GPU does.

In the order that pays on a lent GPU (a call lasts at most 10 minutes), each stage writing
the page before the next begins:

1. the tests marked gpu but the 20-step GRPO run (about a minute: the engine's conformance
   on the device, FSDP2 over NCCL), so correctness is known before anything else;
2. the engine against transformers' static-cache compiled ``generate`` on
   random-initialised shapes (``bench/engine_speed.py --bars --baselines static``: no
   weights needed), trimmed to the shapes and batches the GPU bars name (smollm2-135m
   single-turn at batch 64 and 256 and multi-turn 64 x 8 turns, qwen2.5-1.5b single-turn
   at batch 64), every contender warmed untimed on the timed shapes, the compiled
   baseline's warm-up (its compiles) in a column of its own; the page is rewritten after
   each of its rows, and should it fail, the page says so and the check goes on (exiting
   1 at the end);
3. ``bench/update_speed.py``: the packed update against the padded one, MFU at 135M and
   1.5B with the run's own micro-batch budget (issue 56's bars);
4. update throughput, MFU and peak memory of random-initialised models of the shipped
   shapes (smollm2 135M/360M/1.7B, Qwen2.5 0.5B/1.5B/3B/7B, while the planner says a
   single-GPU full fine-tune fits), each peak beside the memory planner's figure;
5. on smollm2-135m's real weights (the policy's GPU defaults: bf16 rollout copy, bf16
   autocast over fp32 master weights, SDPA or flash attention), generation and update
   throughput;
6. last, the tests' 20-step GRPO run on arith (minutes), read back from its run directory.

The figures of stages 5 and 6:

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


def _generation(path: str, device, prompts: int = 64, new_tokens: int = 256) -> dict:
    import asyncio

    from agentgym.core.device import peak_memory_gb
    from agentgym.rollout.engines.hf import HFEngine
    from agentgym.models.zoo import load_model, load_tokenizer
    from agentgym.core.types import SamplingParams
    tok = load_tokenizer(path)
    engine = HFEngine(load_model(path, dtype="bfloat16", device=device), tok,
                      max_batch_size=prompts)
    inputs = [tok.encode(f"Question {i}: who wrote the book number {i}? Think, then answer.")
              for i in range(prompts)]
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=0)

    async def go():
        return await asyncio.gather(*(engine.generate(p, sampling, session_id=f"g{i}")
                                      for i, p in enumerate(inputs)))
    try:
        asyncio.run(go())  # warm-up: kernels, allocator
        peak_memory_gb(device)
        t0 = time.perf_counter()
        outs = asyncio.run(go())
        _sync(device)
        wall = time.perf_counter() - t0
    finally:
        engine.close()
    tokens = sum(len(o.ids) for o in outs)
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "prompts": prompts, "new_tokens": new_tokens,
            "peak_memory_gb": peak_memory_gb(device)}


def _update(model, vocab: int, device, rows: int = 8, seq: int = 1000,
            steps: int = 5) -> dict:
    """``steps`` timed SFT-style updates (after two warm-ups) over ``rows`` random
    sequences of ``seq`` tokens: tokens/s, FLOP/s (6 x parameters x tokens/s), peak memory."""
    import torch

    from agentgym.core.device import peak_memory_gb
    from agentgym.core.types import Trajectory
    from agentgym.trainers.backends.single import SingleBackend
    from agentgym.trainers.batch import collate
    from agentgym.trainers.sft import sft_loss_fn
    params = sum(p.numel() for p in model.parameters())
    backend = SingleBackend(model, lr=1e-6, micro_batch_tokens=rows * (seq + 24),
                            mixed_precision="bf16", logprob_chunk=1024)
    g = torch.Generator().manual_seed(0)
    trajs = []
    for i in range(rows):
        t = Trajectory(uid=str(i))
        t.append("prompt", torch.randint(5, vocab, (24,), generator=g).tolist(), 0)
        t.append("generated", torch.randint(5, vocab, (seq,), generator=g).tolist(), 0,
                 logprobs=[0.0] * seq)
        trajs.append(t)
    batch = collate(trajs, 0)
    tokens = int(batch.attention_mask.sum())
    loss = sft_loss_fn(float(batch.loss_mask.sum()), chunk=1024)
    for _ in range(2):  # warm-up
        backend.train_step(backend.split(batch), loss)
    peak_memory_gb(device)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        backend.train_step(backend.split(batch), loss)
    _sync(device)
    wall = time.perf_counter() - t0
    tps = steps * tokens / wall
    return {"params": params, "tokens": tokens, "tokens_per_s": tps,
            "flops_per_s": 6 * params * tps, "peak_memory_gb": peak_memory_gb(device),
            "seq_len": batch.input_ids.shape[1]}


def _gb(value) -> str:
    """A peak in GiB, or "n/a" where the device reports none (the CPU)."""
    return "n/a" if value is None else f"{value:.2f} GiB"


def _sync(device) -> None:
    import torch
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _shapes(device, capacity: float, smoke: bool) -> list[tuple[str, str]]:
    """One row per shipped text shape: a random-initialised model's update figures beside
    the planner's peak, while the planner says a single-device full fine-tune fits."""
    import gc

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from agentgym.models import plan
    from agentgym.models.shapes import is_vision, shape_config, shape_names, shrunk_config
    rows_, seq = (2, 64) if smoke else (8, 1000)
    names = sorted((n for n in shape_names() if not is_vision(shape_config(n))),
                   key=lambda n: plan.shape_numbers(shape_config(n)).params)
    out = []
    for name in names:
        config = shrunk_config(name, 1024) if smoke else \
            {k: v for k, v in shape_config(name).items() if k not in ("torch_dtype",)}
        shape = plan.shape_numbers(config)
        setting = plan.Setting(device="host" if smoke else "gpu", engine=False,
                               micro_batch_tokens=rows_ * (seq + 24))
        planned = plan.total(shape, setting)
        label = f"update, random-init {name} ({shape.params / 1e9:.2f}B), {rows_} x {seq}"
        if planned > 0.9 * capacity:
            out.append((label, f"skipped: the planner puts it at {planned / plan.GiB:.0f} "
                               f"GiB of {capacity / plan.GiB:.0f}"))
            continue
        values = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
        torch.manual_seed(0)
        with torch.device(device):  # initialised where it trains: no host copy of a 3B model
            model = AutoModelForCausalLM.from_config(
                AutoConfig.for_model(config["model_type"], **values), dtype=torch.float32)
        try:
            upd = _update(model, shape.vocab, device, rows_, seq, steps=2 if smoke else 3)
        except torch.OutOfMemoryError:
            out.append((label, f"out of memory (planned {planned / plan.GiB:.1f} GiB)"))
            continue
        finally:
            del model
            gc.collect()
            if not smoke:
                torch.cuda.empty_cache()
        peak = _peak_flops(_device_name(device))
        mfu = f", MFU {upd['flops_per_s'] / peak:.1%}" if peak else ""
        out.append((label, f"{upd['tokens_per_s']:.0f} tokens/s{mfu}, peak "
                           f"{_gb(upd['peak_memory_gb'])} (planned "
                           f"{planned / plan.GiB:.2f} GiB)"))
    return out


def _device_name(device) -> str:
    import torch
    return torch.cuda.get_device_name() if str(device).startswith("cuda") else "cpu"


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
            "step_s": sum(col("time/step_s")) / len(steps),
            "gen_share": sum(col("time/generate_s")) / max(sum(col("time/step_s")), 1e-9)}


def _gpu_tests(select: str, run: Path) -> tuple[int, tuple[str, str]]:
    """The tests marked gpu that ``-k select`` picks: (exit code, the table's row)."""
    print(f"gpu-check: the tests marked gpu, -k '{select}'", flush=True)
    t0 = time.perf_counter()
    tests = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-k",
                            select, "tests/test_gpu.py", "tests/test_model_runner.py"],
                           cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "AGENTGYM_GPU_RUN_DIR": str(run)})
    print(tests.stdout[-3000:], tests.stderr[-2000:], flush=True)
    summary = (tests.stdout.strip().splitlines() or ["(no output)"])[-1]
    return tests.returncode, (f"tests marked gpu, `-k '{select}'`",
                              f"{summary} ({time.perf_counter() - t0:.0f} s)")


def _engine_speed(smoke: bool, progress) -> str:
    """bench/engine_speed.py on the device: ours against transformers' static-cache compiled
    generate on the shapes the GPU bars name (the CPU smoke: eager generate, tiny shapes);
    its section's text. ``progress`` gets the section so far after every row."""
    from bench import engine_speed
    argv = (["--device", "cpu", "--batch", "4", "--episodes", "2", "--turns", "2", "--new", "8",
             "--layers", "2", "--dtype", "float32"] if smoke
            else ["--device", "cuda", "--bars", "--baselines", "static"])
    return engine_speed.run(engine_speed.parse(argv),
                            "python bench/engine_speed.py " + " ".join(argv), progress)


def _update_speed(smoke: bool, peak: float | None) -> str:
    """bench/update_speed.py on the device: the padded update against the packed one with
    the run's own micro-batch budget (``trainer.micro_batch_tokens=0``: the planner's on a
    GPU), MFU at 135M and 1.5B on 32 x 8 trl and 8 x 8 search rows (issue 56's bars); the
    CPU smoke: the tiny model, two rows a group. Its section's text."""
    from bench import update_speed
    runs = ([["--model", "tiny", "--device", "cpu", "--repeats", "1", "--prompts", "2",
              "--groups", "1", "--samples", "2"]] if smoke
            else [["--random", name, "--device", "cuda", "--bf16", "--mfu", "--peak-tflops",
                   f"{(peak or 989e12) / 1e12:.0f}", "--prompts", "32", "--groups", "8",
                   "--repeats", "2"] for name in ("smollm2-135m", "qwen2.5-1.5b")])
    return "\n\n".join(update_speed.run(update_speed.parse(argv),
                                        "python bench/update_speed.py " + " ".join(argv))
                       for argv in runs)


def _engine_stage(smoke: bool, out: Path, header: list[str], rows: list[tuple[str, str]],
                  peak_line: str) -> tuple[str, bool]:
    """The engine benchmark as the page's footer (rewritten after each of its rows): (the
    footer, whether it finished). A failure is written into the page and the check goes
    on to the next stage, keeping the rows measured before it."""
    print("gpu-check: engine speed", flush=True)
    title = "## Engine speed against transformers' generate\n\n"
    tail = "\n\n" + peak_line if peak_line else ""
    so_far = [""]

    def progress(section: str) -> None:
        so_far[0] = section
        _write(out, header, rows, title + section + tail)
    try:
        footer, ok = title + _engine_speed(smoke, progress) + tail, True
    except Exception as e:  # noqa: BLE001 - the later stages still pay; the page says why
        import traceback
        traceback.print_exc()
        footer, ok = (title + (so_far[0] + "\n\n" if so_far[0] else "")
                      + f"**Stopped by {type(e).__name__}: {e}**" + tail), False
    _write(out, header, rows, footer)
    return footer, ok


def _write(out: Path, header: list[str], rows: list[tuple[str, str]], footer: str) -> None:
    """docs/GPU.md as far as the check has come (rewritten after every stage)."""
    text = "\n".join([*header, "", "| what | measured |", "|---|---|",
                      *[f"| {k} | {v} |" for k, v in rows], "", footer, ""])
    out.write_text(text)
    print(text, flush=True)


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "GPU.md"))
    ap.add_argument("--work", default=str(ROOT / "runs" / "gpu_check"))
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="every stage but the tests, on the CPU, tiny shapes, to --out")
    return ap.parse_args()


def _generation_row(path: str, device, smoke: bool) -> tuple[str, str]:
    gen = _generation(path, device, prompts=4 if smoke else 64, new_tokens=8 if smoke else 256)
    return (f"generation, HF engine, bf16, {gen['prompts']} prompts x up to "
            f"{gen['new_tokens']} tokens ({Path(path).name})",
            f"{gen['tokens_per_s']:.0f} tokens/s (peak memory "
            f"{_gb(gen['peak_memory_gb'])})")


def _update_row(path: str, device, smoke: bool, peak: float | None) -> tuple[str, str]:
    from agentgym.trainers.backends.base import ModelSpec
    model = ModelSpec(path).load(device)
    upd = _update(model, model.config.vocab_size, device, *((2, 64) if smoke else (8, 1000)))
    mfu = f"{upd['flops_per_s'] / peak:.1%}" if peak else "– (peak of this card not in the table)"
    return (f"update, {Path(path).name}, {upd['tokens']} tokens, bf16 autocast, AdamW",
            f"{upd['tokens_per_s']:.0f} tokens/s, {upd['flops_per_s'] / 1e12:.2f} TFLOP/s, "
            f"MFU {mfu} (peak memory {_gb(upd['peak_memory_gb'])})")


def _grpo_rows(run: Path) -> list[tuple[str, str]]:
    """The gpu test's 20-step GRPO run, read from its run directory ([] if it left none)."""
    grpo = _grpo_figures(run)
    if not grpo:
        return []
    first, last = grpo["reward"][:3], grpo["reward"][-3:]
    return [("GRPO on arith (code env, solve-rate curriculum), 20 steps x 8 prompts x 8 "
             "samples, smollm2-135m (the gpu test's run)",
             f"{grpo['step_s']:.1f} s/step ({grpo['gen_share']:.0%} generation), peak "
             f"memory {grpo['peak_memory_gb']:.2f} GiB, reward first 3 steps "
             f"{sum(first) / len(first):.3f} → last 3 {sum(last) / len(last):.3f}; per step: "
             + ", ".join(f"{r:.2f}" for r in grpo["reward"])),
            ("drift, engine vs trainer logprobs over that run (largest step value)",
             f"mean {grpo['drift_mean']:.4f}, max {grpo['drift_max']:.3f}")]


def main() -> int:
    a = _args()
    import torch

    from agentgym.core.device import cuda_available
    if not cuda_available() and not a.cpu_smoke:
        print(f"gpu-check: torch {torch.__version__} sees no CUDA device on this machine "
              f"(CUDA build: {torch.version.cuda or 'no'}); nothing measured, "
              f"{Path(a.out).name} left as it is")
        return 0
    from agentgym.core.device import resolve_device
    from agentgym.models.zoo import resolve_model
    device = resolve_device("cpu" if a.cpu_smoke else "auto")
    name = _device_name(device)
    capacity = (torch.cuda.get_device_properties(0).total_memory if not a.cpu_smoke
                else 8 * 2 ** 30)
    work, out = Path(a.work), Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    run = work / "grpo"
    header = ["# GPU check", "", f"_Measured {dt.date.today().isoformat()} by `make gpu-check`"
              f"{' --cpu-smoke (not a GPU figure)' if a.cpu_smoke else ''}._", "",
              f"Device: {name} ({capacity / 2**30:.0f} GiB), torch {torch.__version__} (CUDA "
              f"{torch.version.cuda}), transformers {__import__('transformers').__version__}."]
    peak = _peak_flops(name)
    footer = f"Peak used for MFU: {peak / 1e12:.0f} TFLOP/s dense bf16." if peak else ""
    rows: list[tuple[str, str]] = []
    tests_rc = 0
    if not a.cpu_smoke:  # correctness first; the 20-step GRPO run (minutes) comes last
        rc, row = _gpu_tests("not grpo_20_steps", run)
        rows.append(row)
        tests_rc = tests_rc or rc
        _write(out, header, rows, footer)
    footer, engine_ok = _engine_stage(a.cpu_smoke, out, header, rows, footer)
    print("gpu-check: update speed", flush=True)
    title = "## Update speed: packed against padded\n\n"
    try:
        footer += "\n\n" + title + _update_speed(a.cpu_smoke, peak)
    except Exception as e:  # noqa: BLE001 - the later stages still pay; the page says why
        import traceback
        traceback.print_exc()
        footer += "\n\n" + title + f"**Stopped by {type(e).__name__}: {e}**"
        engine_ok = False
    _write(out, header, rows, footer)
    print("gpu-check: random-initialised shapes", flush=True)
    for row in _shapes(device, capacity, a.cpu_smoke):
        rows.append(row)
        _write(out, header, rows, footer)
    path = str(resolve_model("tiny" if a.cpu_smoke else "smollm2-135m"))
    print("gpu-check: generation throughput", flush=True)
    rows.append(_generation_row(path, device, a.cpu_smoke))
    _write(out, header, rows, footer)
    print("gpu-check: update throughput", flush=True)
    rows.append(_update_row(path, device, a.cpu_smoke, peak))
    _write(out, header, rows, footer)
    if not a.cpu_smoke:
        rc, row = _gpu_tests("grpo_20_steps", run)
        rows.append(row)
        tests_rc = tests_rc or rc
        _write(out, header, rows, footer)
    grpo = _grpo_rows(run)
    if grpo:
        rows += grpo
        _write(out, header, rows, footer)
    return tests_rc or (0 if engine_ok else 1)


if __name__ == "__main__":
    sys.exit(main())
