"""On-policy distillation against GRPO on the CPU: from the same student, with the same
prompts and samples per step, distillation alone, GRPO alone, and both mixed, K steps each,
on ``data=arith`` (the code env's generated arithmetic, bench/arith_rl.py's recipe).

    python bench/distill.py --steps 9 --teacher-steps 9 --teacher-demos 256 --eval-limit 200

1. The student: bench/arith_rl.py's cold-start model (demonstrations + SFT), built once
   per work folder.
2. The teacher: GRPO from the student with another seed (``trainer.seed=1``: other
   samples, another order of the training rows) for ``--teacher-steps``; or, with
   ``--teacher-demos N``, a cold start of its own from the same base on N demonstrations
   (``--teacher-epochs``) before those steps. Its last checkpoint, whatever it scores (it
   is not chosen by its held-out score). It must
   stand >= 0.2 EM above the student on the held-out questions with p < 0.01 (exact
   McNemar); the run says so and stops when it does not.
3. Three arms from the student, ``trainer.seed=0`` each (the same prompts per step):
   ``opd`` (``algo=opd trainer.teacher=T``: the teacher's per-token reverse KL is the whole
   advantage), ``grpo`` (the recipe), ``mixed`` (GRPO's advantage plus the teacher's term,
   ``algo.distill_coef=1``); a checkpoint every step.
4. Every checkpoint played greedily on the same first ``--eval-limit`` rows of
   ``arith_test``: EM per step with 95% Wilson intervals, the exact McNemar test of each
   arm against the student and against each other at equal steps, and the steps and
   wall-clock (the arm's own step times) to reach 90% of the teacher's EM (censored: not
   reached by K). An arm's checkpoints but its last are removed once evaluated.
5. ``WORK/result.json``, the curves (docs/distill_curves.png) and the docs/BENCHMARKS.md
   section "On-policy distillation". ``--arm-override KEY=VALUE`` changes the three arms
   only (e.g. their learning rate), with its own section and curves; point a new
   ``--work`` at the same student and teacher by linking the teacher's folder into it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentgym.reporting.stats import mcnemar, wilson_ci95  # noqa: E402
from bench.arith_rl import RECIPE, _bf16, checkpoints, cold_start, evaluate, outcomes  # noqa: E402
from bench.report import machine, write_section  # noqa: E402
from bench.rl_gain import _train  # noqa: E402

ARMS = {"opd": ["algo=opd"], "grpo": [], "mixed": ["algo.distill_coef=1.0"]}
LABEL = {"opd": "distillation alone", "grpo": "GRPO alone", "mixed": "GRPO + distillation"}


def _run(run: Path, start: str, steps: int, extra: list[str]) -> list[tuple[int, Path]]:
    """``steps`` training steps from ``start`` into ``run`` (resumed when run again), a
    checkpoint each step; the checkpoints."""
    if not (run / "checkpoints" / f"step_{steps}" / "state.json").exists():
        _train([*RECIPE, *_bf16(), f"run_dir={run}", f"trainer.cold_start={start}",
                f"trainer.total_steps={steps}", *extra], None)
    return checkpoints(run)


def prune(ckpts: list[tuple[int, Path]]) -> None:
    """Remove an arm's checkpoints but its last, once each has its eval file (a step's
    checkpoint holds the optimizer's state too: 1.5 GB at 135M, 14 GB an arm); the last one
    marks the arm done, and the eval files keep its curve."""
    import shutil
    for _, path in ckpts[:-1]:
        shutil.rmtree(path, ignore_errors=True)


def step_seconds(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    return {int(m["step"]): float(m["time/step_s"]) for m in rows if "time/step_s" in m}


def em(result: dict) -> float:
    return sum(e["em"] for e in result["episodes"]) / len(result["episodes"])


def reach(curve: list[tuple[int, float]], target: float) -> int | None:
    """The first step whose EM is at least ``target`` (None: not by the last)."""
    return next((s for s, v in curve if v >= target), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=9, help="K: training steps of each arm")
    ap.add_argument("--teacher-steps", type=int, default=9)
    ap.add_argument("--teacher-demos", type=int, default=0,
                    help="the teacher's own cold start on this many demonstrations "
                         "(--teacher-epochs) before its GRPO; 0: GRPO from the student")
    ap.add_argument("--teacher-epochs", type=int, default=2)
    ap.add_argument("--eval-limit", type=int, default=200)
    ap.add_argument("--work", default="runs/distill")
    ap.add_argument("--arm-override", action="append", default=[], metavar="KEY=VALUE",
                    help="an override of the three arms only, not of the student or the "
                         "teacher (e.g. trainer.lr=1e-5); repeatable")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of every run")
    a = ap.parse_args()
    work = Path(a.work)
    n = a.eval_limit
    student = cold_start(work)
    base = evaluate(student, "arith_test", n, work / f"eval_student_{n}.json")
    if a.teacher_demos:  # a cold start of its own, on more demonstrations, then GRPO
        teacher_run = work / f"teacher_demos{a.teacher_demos}x{a.teacher_epochs}"
        t_ckpts = _run(teacher_run, "auto", a.teacher_steps, [
            f"trainer.cold_start_demos={a.teacher_demos}", f"sft.epochs={a.teacher_epochs}",
            "trainer.seed=1", *a.overrides])
    else:
        teacher_run = work / "teacher"
        t_ckpts = _run(teacher_run, student, a.teacher_steps, ["trainer.seed=1", *a.overrides])
    teacher = str(t_ckpts[-1][1])
    t_eval = evaluate(teacher, "arith_test", n, teacher_run / f"eval_{n}.json")
    gap = mcnemar(outcomes(base), outcomes(t_eval))
    result = {"student": student, "teacher": teacher, "n": n, "student_em": em(base),
              "teacher_recipe": {"demos": a.teacher_demos, "epochs": a.teacher_epochs,
                                 "grpo_steps": a.teacher_steps},
              "teacher_em": em(t_eval), "teacher_vs_student": vars(gap), "arms": {}}
    target = 0.9 * em(t_eval)
    if em(t_eval) - em(base) < 0.2 or gap.p_value >= 0.01:
        print(f"the teacher ({em(t_eval):.3f}) is not 0.2 EM above the student "
              f"({em(base):.3f}) with p < 0.01 (p = {gap.p_value:.2g}): no comparison")
        (work / "result.json").write_text(json.dumps(result, indent=2) + "\n")
        return
    evals: dict[str, dict[int, dict]] = {}
    for arm, keys in ARMS.items():
        run = work / arm
        teach = [f"trainer.teacher={teacher}"] if arm != "grpo" else []
        ckpts = _run(run, student, a.steps, ["trainer.seed=0", "trainer.save_every=1",
                                             *keys, *teach, *a.overrides,
                                             *a.arm_override])
        for s, path in ckpts:
            evaluate(str(path), "arith_test", n, run / f"eval_{s}_{n}.json")
        evals[arm] = {0: base} | {s: json.loads(f.read_text()) for s in range(1, a.steps + 1)
                                  if (f := run / f"eval_{s}_{n}.json").exists()}
        prune(ckpts)
        secs = step_seconds(run)
        curve = [(s, em(r)) for s, r in sorted(evals[arm].items())]
        hit = reach(curve, target)
        result["arms"][arm] = {
            "curve": curve, "step_s": secs,
            "steps_to_90": hit, "seconds_to_90": None if hit is None else
            sum(v for s, v in secs.items() if s <= hit),
            "vs_student": {s: vars(mcnemar(outcomes(base), outcomes(r)))
                           for s, r in evals[arm].items() if s}}
    steps = sorted(set.intersection(*(set(e) for e in evals.values())) - {0})
    result["pairs"] = {f"{x} vs {y}": {s: vars(mcnemar(outcomes(evals[y][s]), outcomes(evals[x][s])))
                                        for s in steps}
                       for x, y in (("opd", "grpo"), ("mixed", "grpo"), ("opd", "mixed"))}
    result["arm_overrides"] = a.arm_override
    (work / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    tag = "_".join(re.sub(r"[^A-Za-z0-9.-]+", "-", o) for o in a.arm_override)
    _plot(result, ROOT / "docs" / f"distill_curves{'_' + tag if tag else ''}.png")
    text = section(result, sys.argv[1:])
    print(text)
    write_section("On-policy distillation" + (f" ({', '.join(a.arm_override)} in every arm)"
                                              if a.arm_override else ""), text)


def _cell(v: float, n: int) -> str:
    lo, hi = wilson_ci95(v, n)
    return f"{v:.3f} [{lo:.2f}, {hi:.2f}]"


def _teacher(r: dict) -> str:
    t = r.get("teacher_recipe") or {}
    if t.get("demos"):
        return (f"a cold start of its own from the same base on {t['demos']} demonstrations "
                f"({t['epochs']} epochs), then {t['grpo_steps']} GRPO steps, "
                f"`trainer.seed=1`")
    return f"{t.get('grpo_steps', '')} GRPO steps from the student with `trainer.seed=1`"


def section(r: dict, argv: list[str]) -> str:
    n, arms = r["n"], r["arms"]
    g = r["teacher_vs_student"]
    lines = [
        f"Machine: {machine()}. Command: `python bench/distill.py {' '.join(argv)}`. Student: "
        f"the cold-start model of bench/arith_rl.py; teacher: {_teacher(r)}, its last "
        f"checkpoint ({Path(r['teacher']).name}), not chosen by its held-out score. Greedy EM on the same first {n} `arith_test` questions: student "
        f"{r['student_em']:.3f}, teacher {r['teacher_em']:.3f} (+{g['gained']}/-{g['lost']}, "
        f"p = {g['p_value']:.2g}); 90% of the teacher is {0.9 * r['teacher_em']:.3f}. Each arm "
        f"from the student with `trainer.seed=0` (the same prompts, 4 x 8 samples a step); "
        f"intervals Wilson 95%; p exact McNemar (two-sided), against the student.", "",
        "| step | " + " | ".join(f"{LABEL[a]}: EM [95% CI] (p vs student)" for a in arms) + " |",
        "|---|" + "---|" * len(arms)]
    steps = sorted({s for a in arms.values() for s, _ in a["curve"]})
    for s in steps:
        cells = []
        for a in arms.values():
            v = dict(a["curve"]).get(s)
            p = a["vs_student"].get(s) or a["vs_student"].get(str(s))
            cells.append("–" if v is None else _cell(v, n) + (f" ({p['p_value']:.2g})" if p else ""))
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines += ["", "Steps and wall-clock (the arm's own step times) to 90% of the teacher:", "",
              "| arm | steps | minutes | s/step |", "|---|---|---|---|"]
    for name, a in arms.items():
        secs = list(a["step_s"].values())
        hit = a["steps_to_90"]
        reached = str(hit) if hit is not None else f"not by {steps[-1]} (censored)"
        minutes = "–" if hit is None else f"{a['seconds_to_90'] / 60:.1f}"
        lines.append(f"| {LABEL[name]} | {reached} | {minutes} | "
                     f"{sum(secs) / max(len(secs), 1):.0f} |")
    lines += ["", "Arms against each other at equal steps (exact McNemar p; gained/lost by the "
              "first named):", "", "| step | " + " | ".join(r["pairs"]) + " |",
              "|---|" + "---|" * len(r["pairs"])]
    for s in sorted({int(k) for v in r["pairs"].values() for k in v}):
        lines.append(f"| {s} | " + " | ".join(
            f"{(p := v.get(s) or v.get(str(s)))['p_value']:.2g} (+{p['gained']}/-{p['lost']})"
            for v in r["pairs"].values()) + " |")
    return "\n".join(lines)


def _plot(r: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for name, a in r["arms"].items():
        steps, em_ = zip(*a["curve"])
        lo, hi = zip(*(wilson_ci95(v, r["n"]) for v in em_))
        ax.fill_between(steps, lo, hi, alpha=0.15)
        ax.plot(steps, em_, marker="o", label=LABEL[name])
    ax.axhline(r["teacher_em"], color="k", ls="--", lw=1, label="teacher")
    ax.axhline(0.9 * r["teacher_em"], color="k", ls=":", lw=1, label="90% of the teacher")
    ax.set_xlabel("training step (0: the student)")
    ax.set_ylabel(f"held-out EM ({r['n']} arith_test, greedy)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
