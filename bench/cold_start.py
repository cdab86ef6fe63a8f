"""Cold start on CPU: a model before, after SFT, and after SFT + GRPO, in one env.

    python bench/cold_start.py --env search            # every missing stage, then the report
    python bench/cold_start.py --env code --eval-limit 100
    python bench/cold_start.py --env search --report-only

Stages (each is an ``agentgym`` command; a stage whose output exists is skipped, so a
killed benchmark resumes): ``demos`` (builder) → ``sft`` → ``eval`` after SFT → ``train``
(GRPO from the SFT checkpoint) → ``eval`` after it → ``eval`` before (the base model).
Evals are greedy on the env's held-out set (search: NQ; code: GSM8K test) with the
default budgets; the report gives format validity (episodes that follow the protocol
to an answer, with no malformed action) and EM, each with a Wilson 95% interval, and
copies the SFT loss and GRPO reward curves next to docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentgym.reporting.stats import wilson_ci95  # noqa: E402
from bench.report import write_section  # noqa: E402

HELD_OUT = {"search": "nq", "code": "gsm8k"}


def stages(a) -> list[tuple[str, Path, list[str]]]:
    """``(name, output that marks it done, agentgym argv)`` in run order."""
    w = Path(a.work) / a.env
    demos, sft_dir, grpo_dir = w / "demos.jsonl", w / "sft", w / "grpo"
    res = lambda tag: Path("docs") / f"results_cold_{a.env}_{tag}.json"  # noqa: E731
    ev = ["eval", f"env={a.env}", f"data={HELD_OUT[a.env]}", f"limit={a.eval_limit}",
          "engine.dtype=bfloat16"]
    sft_ckpt = sft_dir / "checkpoints" / "final"
    return [
        ("demos", demos, ["demos", f"env={a.env}", f"model={a.model}", f"out={demos}",
                          f"limit={a.demo_rows}"]),
        ("sft", sft_ckpt, ["sft", f"env={a.env}", f"data={demos}", f"model={a.model}",
                           f"run_dir={sft_dir}", f"limit={a.sft_demos}",
                           f"sft.epochs={a.sft_epochs}", f"sft.batch_size={a.batch_size}",
                           f"trainer.lr={a.sft_lr}", "trainer.mixed_precision=bf16",
                           "trainer.save_every=1000"]),
        ("eval after SFT", res("sft"), ev + [f"model={sft_ckpt}", f"out={res('sft')}"]),
        ("grpo", grpo_dir / "checkpoints" / f"step_{a.grpo_steps}",
         ["train", f"env={a.env}", f"model={sft_ckpt}", f"run_dir={grpo_dir}",
          f"trainer.total_steps={a.grpo_steps}", "trainer.prompts_per_step=4", "n=4",
          f"trainer.lr={a.grpo_lr}", "trainer.eval_limit=0", "trainer.save_every=1",
          "trainer.cold_start=off",
          "engine.dtype=bfloat16", "trainer.mixed_precision=bf16",
          "rollout.max_tokens_per_turn=128", "rollout.max_response_tokens=768",
          *(["search.format_reward=0.1"] if a.env == "search" else [])]),
        ("eval after SFT + GRPO", res("sft_grpo"),
         ev + [f"model={grpo_dir}/checkpoints/step_{a.grpo_steps}", f"out={res('sft_grpo')}"]),
        ("eval before", res("before"), ev + [f"model={a.model}", f"out={res('before')}"]),
    ]


def run(a) -> None:
    agentgym = str(Path(sys.executable).with_name("agentgym"))
    for name, done, argv in stages(a):
        if (ROOT / done).exists():
            print(f"[{a.env}] {name}: done ({done})", flush=True)
            continue
        print(f"[{a.env}] {name}: agentgym {' '.join(argv)}", flush=True)
        subprocess.run([agentgym, *argv], check=True, cwd=ROOT)
        if name == "sft":  # the last step's checkpoint, under a stable name
            ckpts = sorted((Path(a.work) / a.env / "sft" / "checkpoints").glob("step_*"),
                           key=lambda p: int(p.name.split("_")[1]))
            shutil.copytree(ckpts[-1], ROOT / done)


def _metrics(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def report(a) -> None:
    w = Path(a.work) / a.env
    st = stages(a)
    results = {}
    points = [("before (base model)", "before"), ("after SFT", "sft")]
    for p in sorted(Path("docs").glob(f"results_cold_{a.env}_sft_grpo[0-9]*.json")):
        k = p.stem.rsplit("grpo", 1)[1]  # an earlier, shorter GRPO run kept for comparison
        points.append((f"after SFT + {k} GRPO steps", f"sft_grpo{k}"))
    points.append((f"after SFT + {a.grpo_steps} GRPO steps", "sft_grpo"))
    for label, tag in points:
        p = ROOT / "docs" / f"results_cold_{a.env}_{tag}.json"
        if p.exists():
            results[label] = json.loads(p.read_text())
    rows = []
    for label, r in results.items():
        n = r["n"]
        flo, fhi = wilson_ci95(r["format_valid"], n)
        elo, ehi = wilson_ci95(r["em"], n)
        rows.append(f"| {label} | `{r['model']}` | {n} | {r['format_valid']:.3f} "
                    f"[{flo:.3f}, {fhi:.3f}] | {r['em']:.3f} [{elo:.3f}, {ehi:.3f}] | "
                    f"{r['answered']:.3f} | {r['mean_turns']:.2f} | {r['mean_tool_calls']:.2f} | "
                    f"{r['response_length']:.0f} | {r['seconds']:.0f} |")
    sft_m = [r for r in _metrics(w / "sft") if "train/loss" in r]
    grpo_m = [r for r in _metrics(w / "grpo") if "rollout/reward" in r]
    demos = w / "demos.jsonl"
    n_demos = sum(1 for _ in open(demos)) if demos.exists() else 0
    pngs = []
    for src, dst in ((w / "sft" / "loss_curve.png", f"cold_{a.env}_sft_loss.png"),
                     (w / "grpo" / "reward_curve.png", f"cold_{a.env}_grpo_reward.png")):
        if src.exists():
            shutil.copy(src, ROOT / "docs" / dst)
            pngs.append(f"`docs/{dst}`")
    lines = [f"Machine: {platform.machine()}, 2-core CPU, 24 GiB. Command: "
             f"`python {' '.join(['bench/cold_start.py', *sys.argv[1:]])}`; the stages it ran:", ""]
    lines += [f"- {name}: `agentgym {' '.join(argv)}`" for name, _, argv in st]
    lines += ["", f"Held-out set: the first {a.eval_limit} questions of "
              f"`{HELD_OUT[a.env]}`, greedy decoding, default budgets. Format-valid = the "
              "episode ended with an answer and had no malformed action. Intervals: Wilson "
              "95%.", "",
              "| point | model | questions | format-valid [95% CI] | EM [95% CI] | answered | "
              "mean turns | mean tool calls | response length | eval seconds |",
              "|---|---|---|---|---|---|---|---|---|---|", *rows, ""]
    if sft_m:
        secs = sum(r["time/step_s"] for r in sft_m)
        lines.append(f"SFT: {n_demos} demonstrations built, {a.sft_demos or n_demos} used, "
                     f"{a.sft_epochs} epoch{'s' if a.sft_epochs != 1 else ''} = {len(sft_m)} steps of {a.batch_size} sequences, "
                     f"lr {a.sft_lr} cosine, bf16 autocast; loss {sft_m[0]['train/loss']:.3f} → "
                     f"{sft_m[-1]['train/loss']:.3f}; {secs / 60:.1f} min of steps; mean padding "
                     f"{sum(r['train/pad_fraction'] for r in sft_m) / len(sft_m):.3f}.")
    if grpo_m:
        secs = sum(r["time/step_s"] for r in grpo_m)
        per = ", ".join(f"{r['rollout/reward']:.2f}" for r in grpo_m)
        lines.append(f"GRPO: {len(grpo_m)} steps of 4 prompts x n=4, lr {a.grpo_lr}, "
                     f"{secs / 60:.1f} min; rollout reward per step: {per}.")
    if pngs:
        lines.append(f"Curves: {', '.join(pngs)}.")
    if a.note:
        lines += ["", a.note]
    write_section(f"Cold start: {a.model} on {a.env}", "\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", choices=sorted(HELD_OUT), required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--work", default="runs/cold")
    ap.add_argument("--demo-rows", type=int, default=0, help="training rows to build from")
    ap.add_argument("--sft-demos", type=int, default=0, help="demonstrations used (0 = all)")
    ap.add_argument("--sft-epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--sft-lr", default="5e-5")
    ap.add_argument("--grpo-steps", type=int, default=5)
    ap.add_argument("--grpo-lr", default="1e-5")
    ap.add_argument("--eval-limit", type=int, default=200)
    ap.add_argument("--note", default="")
    ap.add_argument("--report-only", action="store_true")
    a = ap.parse_args()
    os.chdir(ROOT)  # stage paths are relative to the repository root
    if not a.report_only:
        run(a)
    report(a)


if __name__ == "__main__":
    main()
