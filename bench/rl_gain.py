"""Does RL add to the cold start? The SFT checkpoint against the SFT+GRPO checkpoint of one
`agentgym train` run, on the same held-out questions, with the exact McNemar test.

    python bench/rl_gain.py --env search --steps 60 --eval-data nq --eval-limit 500 \\
        engine.dtype=bfloat16 trainer.mixed_precision=bf16
    python bench/rl_gain.py --env code --steps 40 --eval-data gsm8k --eval-limit 200
    python bench/rl_gain.py --env search --steps 20 --two-hop 200 data.curriculum=solve_rate …

1. ``agentgym train env=ENV trainer.total_steps=STEPS run_dir=WORK/ENV`` with the cold start
   on (``trainer.cold_start=auto``): demonstrations + SFT, then GRPO from the SFT model. A
   killed run resumes from its last checkpoint when the command is run again. With
   ``--minutes M`` the training stops after M minutes (the learning rate is constant, so
   stopping early changes no schedule) and the last saved checkpoint is the RL one: pass
   ``trainer.save_every`` small enough that little is lost.
2. ``agentgym eval`` (greedy) of the SFT model and of the last GRPO checkpoint on the first
   EVAL_LIMIT questions of EVAL_DATA, each written with its per-question outcomes.
3. The paired test (:func:`agentgym.reporting.stats.mcnemar`) of their EM (with ``--two-hop
   N``, on the first N two-hop HotpotQA questions too: ``data=hotpotqa``), searches per
   episode (mean, and the share of episodes with two or more), and the run's training
   signals over its steps (reward, share of groups whose rewards differ, advantage size,
   entropy, KL, response length), written to docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentgym.reporting.stats import mcnemar, wilson_ci95  # noqa: E402
from bench.report import machine, write_section  # noqa: E402
from bench.stages import last_checkpoint, stop  # noqa: E402

#: training signals shown over the run's steps: (metrics.jsonl key, column)
SIGNALS = [("rollout/reward", "reward"), ("rollout/signal_groups", "groups with signal"),
           ("rollout/answer_seen", "answer in results"),
           ("rollout/adv_abs", "mean abs. advantage"), ("train/entropy", "entropy"),
           ("train/kl", "KL to ref"), ("rollout/drift_max", "max drift"),
           ("rollout/format_valid", "format-valid"),
           ("rollout/response_length", "response tokens"), ("train/grad_norm", "grad norm")]


def _agentgym(*argv: str) -> None:
    cmd = [sys.executable, "-m", "agentgym.cli", *argv]
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True)


def _train(argv: list[str], minutes: float | None) -> bool:
    """Run ``agentgym train``; with a time budget, stop it (its whole process group, so the
    retriever server it started goes too) when the budget is spent. True if it was stopped."""
    cmd = [sys.executable, "-m", "agentgym.cli", "train", *argv]
    print("$", " ".join(cmd[2:]), flush=True)
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        proc.wait(timeout=None if minutes is None else minutes * 60)
    except subprocess.TimeoutExpired:
        print(f"time budget of {minutes:g} min spent: stopping the training run", flush=True)
        stop(proc)  # SIGTERM to its process group, SIGKILL after 2 minutes
        return True
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if proc.returncode:
        raise SystemExit(f"training failed with exit code {proc.returncode}")
    return False


def _evaluate(env: str, model: str, data: str, limit: int, out: Path, extra: list[str]) -> dict:
    if not out.exists():  # a finished eval is kept: re-running the command only reports
        _agentgym("eval", f"env={env}", f"model={model}", f"data={data}", f"limit={limit}",
                  f"out={out}", *extra)
    return json.loads(out.read_text())


def _over_steps(metrics: list[dict], parts: int = 4) -> list[tuple[str, dict]]:
    """Mean of each signal over consecutive slices of the RL steps."""
    steps = [m for m in metrics if "rollout/reward" in m]
    if not steps:
        return []
    size = max(1, -(-len(steps) // parts))
    out = []
    for i in range(0, len(steps), size):
        chunk = steps[i:i + size]
        means = {}
        for key, _ in SIGNALS:
            vals = [m[key] for m in chunk if key in m]
            means[key] = sum(vals) / len(vals) if vals else None
        out.append((f"{chunk[0]['step']}–{chunk[-1]['step']}", means))
    return out


def _tool_rows(before: dict, after: dict, where: str) -> list[str]:
    """Searches (tool calls) per episode: the mean, and the share of episodes with two or
    more (a second hop), SFT against SFT+GRPO."""
    if not all("tool_calls" in e for ev in (before, after) for e in ev["episodes"]):
        return []  # evals written before episodes recorded their tool calls
    calls = [[e["tool_calls"] for e in ev["episodes"]] for ev in (before, after)]
    mean = [sum(c) / len(c) for c in calls]
    two = [sum(x >= 2 for x in c) / len(c) for c in calls]
    return [f"| tool calls per episode{where} | {mean[0]:.2f} | {mean[1]:.2f} | | | |",
            f"| episodes with 2+ tool calls{where} | {two[0]:.3f} | {two[1]:.3f} | "
            f"{100 * (two[1] - two[0]):+.1f} | | |"]


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default="search")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--eval-data", default="nq")
    ap.add_argument("--eval-limit", type=int, default=500)
    ap.add_argument("--work", default="runs/rl_gain")
    ap.add_argument("--two-hop", type=int, default=0,
                    help="also evaluate both checkpoints on the first N two-hop questions "
                         "(search: data=hotpotqa)")
    ap.add_argument("--minutes", type=float, default=None,
                    help="stop training after this many minutes and compare the last "
                         "saved checkpoint (default: train all --steps)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for the training run")
    return ap.parse_args()


def _paired_rows(paired: dict, sft_eval: dict, rl_eval: dict) -> list[str]:
    """EM and format validity (paired, with Wilson intervals), then the mean F1."""
    n = paired["em"].n
    rows = []
    for key, label in (("em", "EM"), ("format_valid", "format-valid")):
        p = paired[key]
        cells = []
        for v in (p.before, p.after):
            lo, hi = wilson_ci95(v, n)
            cells.append(f"{v:.3f} [{lo:.3f}, {hi:.3f}]")
        rows.append(f"| {label} | {cells[0]} | {cells[1]} | {100 * p.delta:+.1f} | "
                    f"{p.gained} / {p.lost} | {p.p_value:.3g} |")
    rows.append(f"| F1 (mean) | {sft_eval['f1']:.3f} | {rl_eval['f1']:.3f} | "
                f"{100 * (rl_eval['f1'] - sft_eval['f1']):+.1f} | | |")
    return rows


def _two_hop_rows(a: argparse.Namespace, run: Path, models: dict[str, str],
                  extra: list[str]) -> list[str]:
    """EM and tool calls of both checkpoints on the first ``--two-hop`` HotpotQA questions."""
    hop = [_evaluate(a.env, m, "hotpotqa", a.two_hop, run / f"eval_{name}_hotpotqa.json",
                     extra) for name, m in models.items()]
    p = mcnemar(*({e["uid"]: bool(e["em"]) for e in ev["episodes"]} for ev in hop))
    return [f"| EM, {p.n} two-hop (hotpotqa) | {p.before:.3f} | {p.after:.3f} | "
            f"{100 * p.delta:+.1f} | {p.gained} / {p.lost} | {p.p_value:.3g} |",
            *_tool_rows(*hop, ", two-hop")]


def _answer_seen_rows(sft_eval: dict, rl_eval: dict, n: int) -> list[str]:
    """Search: how often a search result held a gold answer, and EM on those questions."""
    if not all("answer_seen" in e for ev in (sft_eval, rl_eval) for e in ev["episodes"]):
        return []
    seen = [sum(e["answer_seen"] for e in ev["episodes"]) / n for ev in (sft_eval, rl_eval)]
    cond = [sum(e["em"] for e in ev["episodes"] if e["answer_seen"]) /
            max(1, sum(e["answer_seen"] for e in ev["episodes"]))
            for ev in (sft_eval, rl_eval)]
    return [f"| a search result held the answer | {seen[0]:.3f} | {seen[1]:.3f} | "
            f"{100 * (seen[1] - seen[0]):+.1f} | | |",
            f"| EM where it did | {cond[0]:.3f} | {cond[1]:.3f} | "
            f"{100 * (cond[1] - cond[0]):+.1f} | | |"]


def _signal_rows(metrics: list[dict]) -> list[str]:
    """The training signals' means over each quarter of the GRPO steps."""
    rows = ["", "Training signals over the GRPO steps (means over each quarter of the run):", "",
            "| steps | " + " | ".join(c for _, c in SIGNALS) + " |",
            "|---|" + "---|" * len(SIGNALS)]
    for span, means in _over_steps(metrics):
        rows.append(f"| {span} | " + " | ".join(
            "–" if means[k] is None else f"{means[k]:.3g}" for k, _ in SIGNALS) + " |")
    return rows


def main() -> None:
    a = _args()
    run = Path(a.work) / a.env
    t0 = time.perf_counter()
    stopped = _train([f"env={a.env}", f"trainer.total_steps={a.steps}", f"run_dir={run}",
                      "trainer.eval_limit=0", *a.overrides], a.minutes)
    train_s = time.perf_counter() - t0
    record = json.loads((run / "cold_start" / "cold_start.json").read_text())
    sft_model = record.get("model")
    if not sft_model:
        raise SystemExit(f"the run did not cold-start ({record.get('decision')}): nothing to "
                         f"compare GRPO against")
    rl_steps, rl_model = last_checkpoint(run)
    # the eval uses the run's engine and budgets, never its model, data or trainer settings
    extra = [o for o in a.overrides if o.startswith(("engine.", "rollout.", "search.", "code."))]
    sft_eval = _evaluate(a.env, sft_model, a.eval_data, a.eval_limit, run / "eval_sft.json", extra)
    rl_eval = _evaluate(a.env, str(rl_model), a.eval_data, a.eval_limit, run / "eval_rl.json",
                        extra)
    paired = {k: mcnemar({e["uid"]: bool(e[k]) for e in sft_eval["episodes"]},
                         {e["uid"]: bool(e[k]) for e in rl_eval["episodes"]})
              for k in ("em", "format_valid")}
    metrics = [m for m in (json.loads(line) for line in
                           (run / "metrics.jsonl").read_text().splitlines())
               if m.get("step", 0) <= rl_steps]
    cs = record.get("sft", {})
    n = paired["em"].n
    body = [
        f"Machine: {machine()}. Command: `python bench/rl_gain.py {' '.join(sys.argv[1:])}` "
        f"({train_s / 60:.0f} min of training in this invocation; a resumed run counts only "
        f"its own part). The cold start: {record.get('demos')} demonstrations, SFT "
        f"{cs.get('steps')} steps (loss {cs.get('loss_first', float('nan')):.3f} → "
        f"{cs.get('loss_last', float('nan')):.3f}); then {rl_steps} GRPO steps from it"
        f"{f' (stopped by the {a.minutes:g}-minute budget)' if stopped else ''}. Both "
        f"checkpoints played greedily on the same first {n} questions of "
        f"`{a.eval_data}`; intervals Wilson 95%, p-values exact McNemar (two-sided) on the "
        f"questions where the two disagree.\n",
        "| metric | SFT [95% CI] | SFT+GRPO [95% CI] | Δ points | gained / lost | p |",
        "|---|---|---|---|---|---|"]
    body += _paired_rows(paired, sft_eval, rl_eval)
    body += _tool_rows(sft_eval, rl_eval, "")
    if a.two_hop:
        body += _two_hop_rows(a, run, {"sft": sft_model, "rl": str(rl_model)}, extra)
    body += _answer_seen_rows(sft_eval, rl_eval, n)
    body += _signal_rows(metrics)
    text = "\n".join(body)
    print(text)
    write_section(f"RL over the cold start: {a.env}, {a.eval_data}", text)


if __name__ == "__main__":
    main()
