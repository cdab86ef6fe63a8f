"""Does GRPO teach a 135M model to use its tool? ``data=arith`` (the code env's generated
arithmetic, :mod:`agentgym.envs.arith`) with the solve-rate curriculum, on the CPU, against
the cold-start (SFT) model it starts from, on the same held-out questions.

    python bench/arith_rl.py --minutes 10 --name full trainer.lr=2e-5   # the CPU recipe
    python bench/arith_rl.py --minutes 0 --name full --gsm8k 200        # + GSM8K (transfer)
    python bench/arith_rl.py --minutes 10 --name lora8 model.lora.rank=8 model.lora.alpha=32 \
        trainer.lr=2e-4
    python bench/arith_rl.py --table full lora32 lora8 lora1            # full vs LoRA

1. The cold start, once per work folder: ``agentgym train env=code data=arith`` for one
   step, whose demonstrations + SFT (``trainer.cold_start_demos``) give the model every arm
   starts from (``trainer.cold_start=PATH``), so arms differ only in their RL settings.
2. GRPO for ``--minutes`` of wall clock (``trainer.save_every`` steps between checkpoints;
   stopped by SIGTERM to its process group when the time is spent; the last checkpoint
   is the result).
3. Greedy evals of the SFT model and of every checkpoint on the first ``--eval-limit``
   rows of ``arith_test`` (interleaved: ``--eval-limit / 5`` per level): the learning
   curve (PNG) and, SFT against the last checkpoint, the paired exact McNemar test overall
   and per level. With ``--gsm8k N`` both also play the first N GSM8K test questions
   (transfer).
4. ``WORK/NAME/result.json``, and a docs/BENCHMARKS.md section.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentgym.core.device import cpu_bf16_flags  # noqa: E402
from agentgym.reporting.stats import mcnemar, wilson_ci95  # noqa: E402
from bench.report import machine, write_section  # noqa: E402
from bench.rl_gain import _agentgym, _train  # noqa: E402

#: rollout budgets (training and eval): a demonstration is one code cell and the answer,
#: each under 40 tokens; a step's update computes every token of every sample
BUDGETS = ["rollout.max_turns=2", "rollout.max_tokens_per_turn=64"]
#: the settings every arm shares (the recipe; an arm's overrides come after them)
RECIPE = ["env=code", "data=arith", "data.curriculum=solve_rate", "rollout.n=8",
          "trainer.prompts_per_step=4", *BUDGETS,
          "trainer.eval_limit=0", "trainer.eval_data=arith_test", "trainer.total_steps=1000",
          "trainer.save_every=3", "trainer.cold_start_demos=32", "sft.epochs=1"]
LEVEL = re.compile(r"-L(\d+)-")


def _bf16() -> list[str]:
    return (["engine.dtype=bfloat16", "trainer.mixed_precision=bf16"]
            if cpu_bf16_flags() else [])


def cold_start(work: Path) -> str:
    """The SFT model every arm starts from (built once: one training step with the cold
    start on; its cache makes a second call instant)."""
    run = work / "cold_start"
    record = run / "cold_start" / "cold_start.json"
    if not record.exists():
        _agentgym("train", *RECIPE, *_bf16(), f"run_dir={run}", "trainer.total_steps=1")
    model = json.loads(record.read_text()).get("model")
    if not model:
        raise SystemExit(f"the cold start did not run ({record}): nothing to start from")
    return model


def evaluate(model: str, data: str, limit: int, out: Path) -> dict:
    """A greedy eval (kept: re-running the command only reports, unless ``limit`` changed).
    GSM8K with the code env's own budgets (4 turns of 128 tokens: its solutions take
    several cells)."""
    budgets = ["rollout.max_turns=4", "rollout.max_tokens_per_turn=128"] if data == "gsm8k" \
        else BUDGETS
    if not out.exists() or len(json.loads(out.read_text())["episodes"]) != limit:
        _agentgym("eval", "env=code", f"model={model}", f"data={data}", f"limit={limit}",
                  f"out={out}", *budgets, *_bf16()[:1])
    return json.loads(out.read_text())


def outcomes(result: dict, level: int | None = None) -> dict[str, bool]:
    return {e["uid"]: bool(e["em"]) for e in result["episodes"]
            if level is None or int(LEVEL.search(e["uid"]).group(1)) == level}


def checkpoints(run: Path) -> list[tuple[int, Path]]:
    found = [(int(m.group(1)), d) for d in (run / "checkpoints").glob("step_*")
             if (m := re.fullmatch(r"step_(\d+)", d.name)) and (d / "state.json").exists()]
    return sorted(found)


def run_arm(a, work: Path) -> dict:
    sft = a.sft or cold_start(work)
    run = work / a.name
    earlier = run / "result.json"
    if a.minutes:
        t0 = time.perf_counter()
        stopped = _train([*RECIPE, *_bf16(), f"run_dir={run}", f"trainer.cold_start={sft}",
                          *a.overrides], a.minutes)
        minutes = (time.perf_counter() - t0) / 60
    elif earlier.exists():  # --minutes 0: report on the run as it is (add --gsm8k, say)
        old = json.loads(earlier.read_text())
        stopped, minutes, a.overrides = old["stopped"], old["minutes"], old["overrides"]
    else:
        raise SystemExit(f"--minutes 0 reports on an earlier run, and {earlier} is missing")
    ckpts = checkpoints(run)
    if not ckpts:
        raise SystemExit(f"no checkpoint under {run / 'checkpoints'}: raise --minutes")
    # the curve: every checkpoint on the first --curve-limit questions; SFT and the last
    # checkpoint on --eval-limit (the paired test)
    before = evaluate(sft, "arith_test", a.eval_limit, work / f"eval_sft_{a.eval_limit}.json")
    after = evaluate(str(ckpts[-1][1]), "arith_test", a.eval_limit,
                     run / f"eval_step_{ckpts[-1][0]}_{a.eval_limit}.json")
    curve = [(0, before)] + [(step, evaluate(str(path), "arith_test", a.curve_limit,
                                             run / f"eval_step_{step}_{a.curve_limit}.json"))
                             for step, path in ckpts[:-1]] + [(ckpts[-1][0], after)]
    levels = sorted({int(LEVEL.search(e["uid"]).group(1)) for e in before["episodes"]})
    paired = {"all": mcnemar(outcomes(before), outcomes(after))}
    paired.update({f"L{lv}": mcnemar(outcomes(before, lv), outcomes(after, lv)) for lv in levels})
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    result = {"name": a.name, "overrides": a.overrides, "minutes": minutes, "stopped": stopped,
              "steps": ckpts[-1][0], "sft": sft,
              "curve_n": min(a.curve_limit, a.eval_limit),
              "curve": [(s, _head_em(r, a.curve_limit)) for s, r in curve],
              "paired": {k: vars(p) | {"delta": p.delta}
                         for k, p in paired.items()},
              "level_reached": max((m.get("curriculum/level", 0) for m in metrics), default=0),
              "step_s": _mean([m["time/step_s"] for m in metrics if "time/step_s" in m]),
              "rl_minutes": rl_minutes(run, ckpts[-1][0])}
    if a.gsm8k:
        g = [evaluate(m, "gsm8k", a.gsm8k, p) for m, p in
             ((sft, work / "eval_sft_gsm8k.json"), (str(ckpts[-1][1]), run / "eval_gsm8k.json"))]
        t = mcnemar(outcomes(g[0]), outcomes(g[1]))
        result["gsm8k"] = vars(t) | {"delta": t.delta}
    (run / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, ROOT / "docs" / f"arith_rl_{a.name}.png")
    return result


def rl_minutes(run: Path, step: int) -> float:
    """Minutes of GRPO steps up to the evaluated checkpoint (``step``): what it cost, not
    counting the steps the time budget cut off after it."""
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    return sum(m.get("time/step_s", 0.0) for m in metrics if m["step"] <= step) / 60


def _head_em(result: dict, limit: int) -> float:
    """EM on the first ``limit`` questions (every point of the curve on the same ones)."""
    head = result["episodes"][:limit]
    return sum(e["em"] for e in head) / len(head)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps, em = zip(*result["curve"])
    n = result["curve_n"]
    lo, hi = zip(*(wilson_ci95(v, n) for v in em))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.fill_between(steps, lo, hi, alpha=0.25, label="95% Wilson interval")
    ax.plot(steps, em, marker="o", label=f"held-out EM ({n} arith_test questions, greedy)")
    ax.set_xlabel("GRPO step (0: the cold-start SFT model)")
    ax.set_ylabel("exact match")
    ax.set_title(f"arith: {result['name']}, {result['minutes']:.0f} min of GRPO")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cell(p: dict) -> str:
    return (f"{p['before']:.3f} → {p['after']:.3f} ({100 * p['delta']:+.1f}; "
            f"{p['gained']}/{p['lost']}, p = {p['p_value']:.2g})")


def section(result: dict, argv: list[str]) -> str:
    p = result["paired"]
    body = [f"Machine: {machine()}. Command: `python bench/arith_rl.py {' '.join(argv)}`. "
            f"GRPO from the cold-start model for {result['minutes']:.1f} min of wall clock; "
            f"the last checkpoint, step {result['steps']}, after "
            f"{result['rl_minutes']:.1f} min of GRPO steps "
            f"({result['step_s']:.0f} s per step; the "
            f"curriculum reached level {result['level_reached']:g}). Greedy EM on the same "
            f"{p['all']['n']} held-out `arith_test` questions before (SFT) and after; "
            f"gained/lost questions and exact McNemar p (two-sided).", "",
            "| questions | SFT → GRPO (Δ points; gained/lost, p) |", "|---|---|",
            f"| all | {_cell(p['all'])} |"]
    body += [f"| level {k[1:]} | {_cell(v)} |" for k, v in p.items() if k != "all"]
    if "gsm8k" in result:
        body.append(f"| GSM8K (transfer) | {_cell(result['gsm8k'])} |")
    body += ["", f"Learning curve (greedy EM on the first {result['curve_n']} held-out "
             f"questions, by step; docs/arith_rl_{result['name']}.png): " + ", ".join(
        f"{s}: {v:.3f}" for s, v in result["curve"])]
    return "\n".join(body)


def table(work: Path, names: list[str]) -> str:
    rows = ["| arm | settings | steps | s/step | GRPO minutes to it | held-out EM SFT → GRPO | "
            "Δ points | gained/lost | p | points per minute |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        r = json.loads((work / name / "result.json").read_text())
        p = r["paired"]["all"]
        minutes = rl_minutes(work / name, r["steps"])
        rows.append(f"| {name} | {' '.join(r['overrides']) or 'recipe defaults'} | "
                    f"{r['steps']} | {r['step_s']:.0f} | {minutes:.1f} | "
                    f"{p['before']:.3f} → {p['after']:.3f} | {100 * p['delta']:+.1f} | "
                    f"{p['gained']}/{p['lost']} | {p['p_value']:.2g} | "
                    f"{100 * p['delta'] / minutes:+.2f} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--name", default="recipe")
    ap.add_argument("--work", default="runs/arith_rl")
    ap.add_argument("--sft", default="", help="the model arms start from (default: built)")
    ap.add_argument("--eval-limit", type=int, default=250)
    ap.add_argument("--curve-limit", type=int, default=100,
                    help="questions each intermediate checkpoint plays (the curve)")
    ap.add_argument("--gsm8k", type=int, default=0, help="also GSM8K's first N (transfer)")
    ap.add_argument("--table", nargs="*", help="arms to tabulate (no training)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the arm")
    a = ap.parse_args()
    work = Path(a.work)
    if a.table:
        text = (f"Machine: {machine()}. Each arm: `python bench/arith_rl.py --name ARM "
                f"SETTINGS` from the same cold-start model; greedy EM on the same held-out "
                f"questions; p exact McNemar.\n\n" + table(work, a.table))
        print(text)
        write_section("Full fine-tuning against LoRA for GRPO on the CPU (arith)", text)
        return
    result = run_arm(a, work)
    text = section(result, sys.argv[1:])
    print(text)
    write_section(f"RL that learns on the CPU: arith, {a.name}", text)


if __name__ == "__main__":
    main()
