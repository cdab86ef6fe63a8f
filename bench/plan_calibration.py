"""The memory planner (``agentgym plan``, :mod:`agentgym.models.plan`) against measured
peaks, and its plan for every shipped recipe.

    python bench/plan_calibration.py

1. Calibration: the nine cells of ``bench/update_memory.py`` (smollm2-135m, one GRPO
   update of one sequence on the CPU, bf16 autocast; docs/BENCHMARKS.md, "Update memory:
   chunked log-probs and activation checkpointing"), predicted by the planner with the
   CPU constants (fitted to the 1k and 8k cells; the 4k cells are held out), and the error.
2. ``agentgym plan recipe=NAME`` for each recipe on 8 x 80 GiB GPUs (the CPU demo on this
   machine's memory), as printed.

Writes the section "Memory planner" of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentgym.models.plan import DEVICES, GiB, Setting, breakdown, shape_numbers, total  # noqa: E402
from agentgym.models.shapes import shape_config  # noqa: E402
from agentgym.presets import recipe_names  # noqa: E402
from bench.report import machine, write_section  # noqa: E402

#: docs/BENCHMARKS.md, "Update memory: …" (measured 2026-11-25, Intel Xeon, 2 CPUs, amx_bf16):
#: (tokens, setting) -> peak RSS in GiB of one process running one update
MEASURED = {(1024, "plain"): 3.96, (1024, "chunked log-probs"): 3.96,
            (1024, "chunked + checkpointing"): 2.96, (4096, "plain"): 9.40,
            (4096, "chunked log-probs"): 6.68, (4096, "chunked + checkpointing"): 3.27,
            (8192, "plain"): 16.65, (8192, "chunked log-probs"): 10.20,
            (8192, "chunked + checkpointing"): 3.57}
SETTINGS = {"plain": (0, False, False), "chunked log-probs": (1024, False, False),
            "chunked + checkpointing": (1024, True, False)}  # padded rows (packing=false)


def calibration() -> list[str]:
    shape = shape_numbers(shape_config("smollm2-135m"))
    lines = ["| tokens | setting | measured (GiB) | planned (GiB) | error | fitted on |",
             "|---|---|---|---|---|---|"]
    worst = {True: 0.0, False: 0.0}
    for (tokens, name), measured in MEASURED.items():
        chunk, ckpt, packing = SETTINGS[name]
        s = Setting(device="host", micro_batch_tokens=tokens, logprob_chunk=chunk,
                    checkpointing=ckpt, packing=packing, engine=False)
        planned = total(shape, s) / GiB
        err = (planned - measured) / measured
        held = tokens == 4096
        worst[held] = max(worst[held], abs(err))
        lines.append(f"| {tokens} | {name} | {measured:.2f} | {planned:.2f} | {100 * err:+.1f}% "
                     f"| {'held out' if held else 'yes'} |")
    c = DEVICES["host"]
    lines += ["", f"Largest error: {100 * worst[False]:.1f}% on the six cells the constants were "
              f"fitted to, {100 * worst[True]:.1f}% on the three held out. CPU constants: "
              f"process {c.base / GiB:.2f} GiB, {c.act_bytes} bytes per saved activation "
              f"element, {c.ckpt_bytes} per checkpointed layer-input element, "
              f"{c.logit_copies:g} fp32 copies of the logits."]
    return lines


#: docs/BENCHMARKS.md, "Update memory with on-policy distillation's teacher …" (measured
#: 2026-12-02, AMD EPYC, 2 CPUs, avx512_bf16): tokens -> peak RSS in GiB of the packed update
#: without and with the teacher (smollm2-360m's shape, fp32) loaded and scoring the batch
TEACHER = "smollm2-360m"
TEACHER_MEASURED = {1024: (4.00, 5.32), 4096: (8.85, 10.18)}


def teacher_calibration() -> list[str]:
    """The teacher's row of the plan (its parameters at 4 bytes) against what loading it
    and scoring the batch adds to the packed update's measured peak, on the same machine;
    and the whole peak with the teacher, planned against measured."""
    shape = shape_numbers(shape_config("smollm2-135m"))
    params = shape_numbers(shape_config(TEACHER)).params
    lines = ["| tokens | packed, measured (GiB) | + teacher, measured | teacher adds, measured "
             "| teacher's row, planned | error | whole peak, planned | error |",
             "|---|---|---|---|---|---|---|---|"]
    for tokens, (without, with_teacher) in TEACHER_MEASURED.items():
        s = Setting(device="host", micro_batch_tokens=tokens, logprob_chunk=1024,
                    checkpointing=False, packing=True, engine=False,
                    teacher_params=params, teacher_bytes=4)
        row = dict(breakdown(shape, s))
        teacher_row = next(v for k, v in row.items() if k.startswith("teacher model")) / GiB
        added = with_teacher - without
        whole = total(shape, s) / GiB
        lines.append(f"| {tokens} | {without:.2f} | {with_teacher:.2f} | {added:.2f} | "
                     f"{teacher_row:.2f} | {100 * (teacher_row - added) / added:+.1f}% | "
                     f"{whole:.2f} | {100 * (whole - with_teacher) / with_teacher:+.1f}% |")
    return lines


def plans() -> list[str]:
    out = []
    for name in recipe_names():
        args = [f"recipe={name}"] + (["trainer.device=cpu", "gpus=1", "gpu_memory=24GiB"]
                                     if name == "cpu_demo" else ["gpus=8", "gpu_memory=80GB"])
        cmd = [sys.executable, "-m", "agentgym.cli", "plan", *args]
        text = subprocess.run(cmd, check=True, capture_output=True, text=True,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"}).stdout
        out += [f"`agentgym plan {' '.join(args)}`:", "", "```", text.rstrip(), "```", ""]
    return out


def main() -> None:
    body = [f"Machine: {machine()}. Command: `python bench/plan_calibration.py`.", "",
            "**Calibration** against measured peaks (one process, one update; the cells of "
            "\"Update memory: chunked log-probs and activation checkpointing\", measured "
            "2026-11-25 on an Intel Xeon, 2 CPUs, amx_bf16):", "",
            *calibration(), "",
            f"**On-policy distillation's teacher** ({TEACHER}'s shape, fp32, `trainer.teacher`) "
            "against the packed update measured without and with it on one machine (docs/"
            "BENCHMARKS.md, \"Update memory with on-policy distillation's teacher\"):", "",
            *teacher_calibration(), "",
            "The teacher's row is what it adds, within a few percent at both lengths. The whole "
            "peak with it is off by as much as the packed update alone is on this machine, "
            "whose packed cells measure 13-26% above the Xeon's the CPU constants were fitted "
            "to (avx512_bf16 without AMX).", "",
            "**Plans** of the shipped recipes:", "", *plans()]
    text = "\n".join(body)
    print(text)
    write_section("Memory planner", text)


if __name__ == "__main__":
    main()
