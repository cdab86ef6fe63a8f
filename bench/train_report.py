"""Write a training run's figures (and before/after evals) to docs/BENCHMARKS.md.

    agentgym train env=search model=smollm2-135m run_dir=runs/bench-smollm2 …   # the run
    python bench/search_eval.py --model smollm2-135m --out before.json …           # step 0
    python bench/search_eval.py --model runs/bench-smollm2/checkpoints/step_N --out after.json
    python bench/train_report.py runs/bench-smollm2 before.json after.json --png docs/x.png

Reads ``config.json`` and ``metrics.jsonl`` of the run directory; copies its reward
curve next to the benchmarks page.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentgym.reporting.stats import wilson_ci95  # noqa: E402
from bench.report import write_section  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--png", default="docs/train_reward_curve.png")
    ap.add_argument("--title", default="GRPO training on search (CPU)")
    ap.add_argument("--note", default="", help="free text appended to the section")
    args = ap.parse_args()
    run = Path(args.run_dir)
    cfg = json.loads((run / "config.json").read_text())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "rollout/reward" in r]
    shutil.copy(run / "reward_curve.png", ROOT / args.png)
    before, after = (json.loads(Path(p).read_text()) for p in (args.before, args.after))

    def em(r):
        lo, hi = r["em_ci95"] if isinstance(r["em_ci95"], list) else wilson_ci95(r["em"], r["n"])
        return f"{r['em']:.3f} [{lo:.3f}, {hi:.3f}] (n={r['n']})"

    t, ro, al = cfg["trainer"], cfg["rollout"], cfg["algo"]
    minutes = sum(r["time/step_s"] for r in steps) / 60
    settings = (f"model `{cfg['model']['name']}`, {len(steps)} steps of "
                f"{t['prompts_per_step']} prompts x n={ro['n']}, lr {t['lr']} "
                f"(warmup {t['warmup_steps']}, {t['lr_schedule']}), {al['policy_loss']} "
                f"clip {al['clip_low']}/{al['clip_high']}, {al['loss_agg_mode']}, kl_coef "
                f"{al['kl_coef']}, temperature {ro['temperature']}, max_turns {ro['max_turns']}, "
                f"{ro['max_tokens_per_turn']} tokens/turn, {ro['max_response_tokens']} response "
                f"tokens, engine.dtype {cfg['engine']['dtype'] or cfg['model']['dtype']}, "
                f"mixed_precision {t['mixed_precision'] or 'off'}, search.format_reward "
                f"{cfg['search']['format_reward']}")
    table = ["| step | reward | EM | answered | turns | response length | drift mean | "
             "rollout s | train s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in steps:
        table.append(f"| {r['step']} | {r['rollout/reward']:.3f} | {r['rollout/em']:.3f} | "
                     f"{r['rollout/answered']:.3f} | {r['rollout/turns']:.2f} | "
                     f"{r['rollout/response_length']:.0f} | {r['rollout/drift_mean']:.1e} | "
                     f"{r['time/rollout_s']:.0f} | {r['time/train_s']:.0f} |")
    body = "\n".join([
        f"Settings: {settings}. Wall time of the {len(steps)} steps: {minutes:.1f} min.",
        "", f"- Held-out NQ EM at step 0: **{em(before)}**",
        f"- Held-out NQ EM after step {steps[-1]['step']}: **{em(after)}** "
        f"(`{after['model']}`)", "", *table, "",
        f"Reward curve: `{args.png}`.", "", args.note])
    write_section(args.title, body)


if __name__ == "__main__":
    main()
