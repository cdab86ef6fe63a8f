"""Does a small model learn to work in a repository? env=swe on held-out repositories: the
model before the cold start, after it (SFT on demonstrations that solve training tasks with
the tools) and after GRPO from it, each played greedily on the same held-out tasks.

    python bench/swe_learning.py --steps 20 --eval-limit 120 model=smollm2-135m \\
        trainer.cold_start_demos=160 trainer.prompts_per_step=8 rollout.n=4

1. ``agentgym train env=swe`` with the cold start (``trainer.cold_start=auto`` at
   threshold 1.0): demonstrations built from
   ``data=train`` (find the code, open it, edit it, run the tests, submit; each graded
   resolved before it is kept), SFT, then STEPS of GRPO (bench/rl_gain.py's runner: a
   killed run resumes when the command is run again; ``--minutes`` stops it early);
2. ``agentgym eval`` of the starting model, the SFT model and the last GRPO checkpoint on
   the first EVAL_LIMIT tasks of ``data=test`` (five repositories no training task comes
   from); an evaluation already written is kept, so a second invocation only resumes;
3. per stage: format validity (a command, then a submit with a non-empty diff that applies)
   and the resolved rate with 95% Wilson intervals, the exact McNemar test of each stage
   against the one before on the same tasks, and the funnel of each task (a command named a
   file of its failing checks, named the file to fix, the diff edits it, the tests were
   run, resolved), in all and per repository, written to docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentgym.reporting.stats import mcnemar, wilson_ci95  # noqa: E402
from bench.report import machine, write_section  # noqa: E402
from bench.rl_gain import _evaluate, _train  # noqa: E402
from bench.stages import last_checkpoint  # noqa: E402

FUNNEL = [("opened_test", "opened a failing check's file"),
          ("opened_file", "opened the file to fix"), ("edited_file", "edited it"),
          ("ran_tests", "ran the tests"), ("format_valid", "format-valid"),
          ("resolved", "resolved")]


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-limit", type=int, default=120)
    ap.add_argument("--work", default="runs/swe_learning")
    ap.add_argument("--minutes", type=float, default=None,
                    help="stop the GRPO run after this many minutes (its last checkpoint "
                         "is compared)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for every command")
    return ap.parse_args()


def _outcomes(ev: dict, key: str) -> dict[str, bool]:
    return {e["uid"]: bool(e.get(key, 0)) for e in ev["episodes"]}


def _share(ev: dict, key: str, repo: str | None = None) -> tuple[int, int]:
    eps = [e for e in ev["episodes"] if repo is None or e["uid"].startswith(repo)]
    return sum(bool(e.get(key, 0)) for e in eps), len(eps)


def _cell(k: int, n: int) -> str:
    lo, hi = wilson_ci95(k / n if n else 0.0, n)
    return f"{k / n:.3f} [{lo:.3f}, {hi:.3f}]" if n else "–"


def report(stages: list[tuple[str, dict]]) -> list[str]:
    """The held-out table (format-valid and resolved, each stage against the one before)
    and the funnel, in all and per repository."""
    lines = ["| model | format-valid [95% CI] | p (vs row above) | resolved [95% CI] | "
             "p (vs row above) |", "|---|---|---|---|---|"]
    for i, (name, ev) in enumerate(stages):
        cells = []
        for key in ("format_valid", "resolved"):
            k, n = _share(ev, key)
            p = ""
            if i:
                t = mcnemar(_outcomes(stages[i - 1][1], key), _outcomes(ev, key))
                p = f"{t.p_value:.3g} (+{t.gained}/-{t.lost})"
            cells += [_cell(k, n), p]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "The funnel: the share of held-out tasks whose episode reached each step.", "",
              "| step | " + " | ".join(name for name, _ in stages) + " |",
              "|---|" + "---|" * len(stages)]
    for key, label in FUNNEL:
        lines.append(f"| {label} | " + " | ".join(
            f"{_share(ev, key)[0]} / {_share(ev, key)[1]}" for _, ev in stages) + " |")
    repos = sorted({e["uid"].rsplit("-", 1)[0] for e in stages[0][1]["episodes"]})
    lines += ["", "Per held-out repository, " + ", ".join(
        f"{label}" for _, label in FUNNEL[1:3]) + ", resolved (tasks reaching each, of all):",
              "", "| repository | tasks | " + " | ".join(name for name, _ in stages) + " |",
              "|---|---|" + "---|" * len(stages)]
    for repo in repos:
        n = _share(stages[0][1], "resolved", repo)[1]
        lines.append(f"| {repo} | {n} | " + " | ".join(
            " / ".join(str(_share(ev, k, repo)[0]) for k in ("opened_file", "edited_file",
                                                             "resolved"))
            for _, ev in stages) + " |")
    return lines


def main() -> None:
    a = _args()
    work = Path(a.work)
    model = next((o.split("=", 1)[1] for o in a.overrides if o.startswith("model=")),
                 "smollm2-135m")
    # the evals take the run's engine, budgets and env settings, one greedy episode a task
    extra = [o for o in a.overrides if o.startswith(("engine.", "rollout.", "swe."))
             and not o.startswith("rollout.n=")]
    run = work / "run"
    t0 = time.perf_counter()
    stopped = _train(["env=swe", f"model={model}", f"trainer.total_steps={a.steps}",
                      f"run_dir={run}", "trainer.cold_start=auto", "trainer.cold_start_threshold=1.0", "trainer.eval_limit=0",
                      *[o for o in a.overrides if not o.startswith("model=")]], a.minutes)
    train_s = time.perf_counter() - t0
    record = json.loads((run / "cold_start" / "cold_start.json").read_text())
    sft_model = record["model"]
    rl_steps, rl_model = last_checkpoint(run)
    base = _evaluate("swe", model, "test", a.eval_limit, work / "eval_base.json", extra)
    sft = _evaluate("swe", sft_model, "test", a.eval_limit, work / "eval_sft.json", extra)
    rl = _evaluate("swe", str(rl_model), "test", a.eval_limit, work / "eval_rl.json", extra)
    stages = [(f"before ({Path(model).name})", base), ("after the cold start", sft),
              (f"after GRPO (step {rl_steps})", rl)]
    cs, secs = record.get("sft", {}), record.get("seconds", {})
    (work / "funnel.json").write_text(json.dumps(
        {name: {e["uid"]: {k: e.get(k, 0) for k, _ in FUNNEL} for e in ev["episodes"]}
         for name, ev in stages}, indent=1) + "\n")
    body = [
        f"Machine: {machine()}. Command: `python bench/swe_learning.py "
        f"{' '.join(sys.argv[1:])}` ({train_s / 60:.0f} min of training in this invocation; "
        f"a resumed run counts only its own part"
        f"{f', stopped by the {a.minutes:g}-minute budget' if stopped else ''}). The cold "
        f"start: {record.get('demos')} demonstrations of training tasks "
        f"({secs.get('demos', 0) / 60:.0f} min), SFT {cs.get('steps')} steps "
        f"({secs.get('sft', 0) / 60:.0f} min, loss {cs.get('loss_first', float('nan')):.3f} → "
        f"{cs.get('loss_last', float('nan')):.3f}); then {rl_steps} GRPO steps. Each model "
        f"played greedily on the same first {base['n']} tasks of `data=test` (repositories "
        f"no training task comes from); intervals Wilson 95%, p-values exact McNemar "
        f"(two-sided, tasks gained/lost). Each task's funnel: `{work / 'funnel.json'}`.\n",
        *report(stages)]
    text = "\n".join(body)
    print(text)
    write_section("A coding agent learning in repositories: env=swe, held out", text)


if __name__ == "__main__":
    main()
