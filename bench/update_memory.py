"""Peak memory and tokens/s of one policy update: the plain log-probs against chunked
log-probs (``trainer.logprob_chunk``) and chunked log-probs with activation checkpointing
(``model.gradient_checkpointing``), on padded rows (``trainer.packing=false``), and the
packed update (``trainer.packing``, with and without checkpointing, and with on-policy
distillation's teacher, smollm2-360m's shape randomly initialised, loaded and scoring the
batch), at 1k, 4k and 8k-token sequences.

    python bench/update_memory.py                      # all lengths x settings
    python bench/update_memory.py --lengths 1024 4096

Each cell is its own process (peak RSS is per process): smollm2-135m, one
``SingleBackend.train_step`` (GRPO loss, bf16 autocast where the CPU has native bf16, else
fp32) over one sequence of the given length (24 prompt tokens, the rest sampled); then a
second step, timed. Figures go to docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentgym.core.device import cpu_bf16_flags  # noqa: E402

#: setting -> (trainer.logprob_chunk, model.gradient_checkpointing, trainer.packing): the
#: padded paths as they were before packing, and the packed one (the default since issue 56)
SETTINGS = {"plain": (0, False, False), "chunked log-probs": (1024, False, False),
            "chunked + checkpointing": (1024, True, False), "packed": (1024, False, True),
            "packed + checkpointing": (1024, True, True),
            "packed + teacher": (1024, False, True)}
#: the settings that also hold on-policy distillation's teacher in the process (loaded as
#: trainers/distill.py loads it, fp32) and score the batch with it before the steps
TEACHER_SETTINGS = {"packed + teacher": "smollm2-360m"}
SECTION = "Update memory: chunked log-probs and activation checkpointing (smollm2-135m, CPU)"
ROWS = 1  # one sequence: 8k tokens of the plain path already take ~12 GiB here


def one(length: int, setting: str) -> dict:
    """One cell, in this process (the first the OOM killer picks, should memory run out)."""
    import torch
    try:
        Path("/proc/self/oom_score_adj").write_text("1000")
    except OSError:
        pass
    from agentgym.core.memory import return_freed_memory
    return_freed_memory()  # as agentgym's own processes do

    from agentgym.config import build_config
    from agentgym.models.zoo import resolve_model
    from agentgym.core.types import Trajectory
    from agentgym.trainers.backends.base import ModelSpec
    from agentgym.trainers.backends.single import SingleBackend
    from agentgym.trainers.batch import collate
    from agentgym.trainers.phases import make_loss_fn
    chunk, ckpt, packing = SETTINGS[setting]
    precision = "bf16" if cpu_bf16_flags() else ""
    model = ModelSpec(str(resolve_model("smollm2-135m")), gradient_checkpointing=ckpt).load()
    backend = SingleBackend(model, lr=1e-6, micro_batch_tokens=ROWS * length,
                            mixed_precision=precision, logprob_chunk=chunk, packing=packing)
    g = torch.Generator().manual_seed(0)
    trajs = []
    for i in range(ROWS):
        t = Trajectory(uid="0", reward=float(i))
        t.append("prompt", torch.randint(5, 40000, (24,), generator=g).tolist(), 0)
        n = length - 24
        t.append("generated", torch.randint(5, 40000, (n,), generator=g).tolist(), 0,
                 logprobs=[-1.0] * n)
        trajs.append(t)
    batch = collate(trajs, 0)
    mask = batch.loss_mask
    batch.old_logp = -torch.rand(mask.shape, generator=g) * mask
    batch.adv = torch.randn(ROWS, generator=g)[:, None] * mask
    cfg = build_config({"trainer.logprob_chunk": chunk, "trainer.packing": packing})
    if setting in TEACHER_SETTINGS:  # the teacher stays loaded through the steps, as in a run
        from agentgym.trainers.distill import Teacher
        from bench.engine_speed import random_model
        # the shape at its full size, randomly initialised (memory depends on the shape only;
        # no weights of it ship), fp32 as trainers/distill.py loads a teacher
        teacher = Teacher(TEACHER_SETTINGS[setting], micro_batch_tokens=ROWS * length,
                          chunk=chunk, packing=packing,
                          model=random_model(TEACHER_SETTINGS[setting], torch.float32, "cpu"))
        teacher.model.requires_grad_(False)
        batch.teacher_logp = teacher.logprobs(batch, 1.0)
    loss = make_loss_fn(cfg, 1.0, float(mask.sum()), ROWS, length)
    backend.train_step(backend.split(batch), loss)  # first step: optimizer state, allocator
    t0 = time.perf_counter()
    backend.train_step(backend.split(batch), loss)
    wall = time.perf_counter() - t0
    return {"length": length, "setting": setting, "precision": precision or "fp32",
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "seconds": wall, "tokens_per_s": ROWS * length / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--one", nargs=2, metavar=("LENGTH", "SETTING"), help=argparse.SUPPRESS)
    ap.add_argument("--note", default="", help="conditions to record with the figures")
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--results", default=str(ROOT / "runs" / "update_memory.json"),
                    help="cells measured so far: a run replaces the cells it measures and "
                         "keeps the others, so one cell can be measured again")
    ap.add_argument("--section", default=SECTION,
                    help="the docs/BENCHMARKS.md section the cells of --results are written to")
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(int(a.one[0]), a.one[1])))
        return
    from bench.report import machine, write_section
    store = Path(a.results)
    kept = json.loads(store.read_text()) if store.exists() else []
    results = []
    for length in a.lengths:
        for setting in a.settings:
            proc = subprocess.run([sys.executable, __file__, "--one", str(length), setting],
                                  capture_output=True, text=True, cwd=ROOT,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})
            if proc.returncode:
                print(f"{length} {setting}: exit {proc.returncode} "
                      f"{'(killed: out of memory?)' if proc.returncode == -9 else ''}\n"
                      f"{proc.stderr[-1500:]}", flush=True)
                results.append({"length": length, "setting": setting, "failed": proc.returncode})
                continue
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(results[-1], flush=True)
    measured = {(r["length"], r["setting"]) for r in results}
    results = [r for r in kept if (r["length"], r["setting"]) not in measured] + results
    results.sort(key=lambda r: (r["length"], list(SETTINGS).index(r["setting"])))
    store.parent.mkdir(parents=True, exist_ok=True)
    store.write_text(json.dumps(results, indent=2) + "\n")
    # each length's cells against the plain path, or where it was not measured (a section
    # of its own cells) against the first setting measured
    first = "plain" if any(r["setting"] == "plain" for r in results) else results[0]["setting"]
    base = {r["length"]: r for r in results if r["setting"] == first and "failed" not in r}
    precision = next((r["precision"] for r in results if "precision" in r), "?")
    argv, shown = sys.argv[1:], []
    while argv:  # the command without its --note text, which follows it
        arg = argv.pop(0)
        if arg == "--note":
            argv = argv[1:]
            continue
        shown.append(arg)
    body = [f"Machine: {machine()}. Command: `python bench/update_memory.py "
            f"{shlex.join(shown)}`. smollm2-135m, one GRPO `train_step` over {ROWS} "
            f"sequence(s) of the given length in one micro-batch, {precision}; the second of "
            f"two steps timed; peak RSS of the process (model, AdamW state and the step). "
            f"{a.note}\n",
            f"| tokens per sequence | setting | peak RSS (GiB) | vs {first} | tokens/s | "
            f"vs {first} |",
            "|---|---|---|---|---|---|"]
    for r in results:
        if "failed" in r:
            body.append(f"| {r['length']} | {r['setting']} | failed (exit {r['failed']}) | | | |")
            continue
        b = base.get(r["length"])
        mem = f"{r['peak_rss_gb'] / b['peak_rss_gb']:.2f}x" if b else "–"
        speed = f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x" if b else "–"
        body.append(f"| {r['length']} | {r['setting']} | {r['peak_rss_gb']:.2f} | {mem} | "
                    f"{r['tokens_per_s']:.0f} | {speed} |")
    text = "\n".join(body)
    print(text)
    write_section(a.section, text)


if __name__ == "__main__":
    main()
