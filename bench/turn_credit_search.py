"""Turn-level credit on search with smollm2: is a second search learned?

    python bench/turn_credit_search.py --steps 16 --two-hop 200 --nq 200 \\
        engine.dtype=bfloat16 trainer.mixed_precision=bf16

Two GRPO runs from the same cold start (demonstrations + SFT, cached), the same seed,
steps, data and curriculum (issue 34's recipe: the solve-rate curriculum, F1 reward, lr
2e-5): ``outcome`` (GRPO over the episode's reward) and ``turn`` (``algo.advantage=mt_grpo``
with ``search.retrieval_reward``: the first search whose results hold a gold answer earns
it on its turn). Each run's last checkpoint, and the SFT model, play greedily on the same
first N two-hop HotpotQA and NQ questions; reported: EM, searches per episode and the share
of episodes with two or more, how often a search result held the answer, and the paired
exact McNemar test of ``turn`` against ``outcome``; the training signals over the steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentgym.reporting.stats import mcnemar  # noqa: E402
from bench.report import machine, write_section  # noqa: E402
from bench.rl_gain import _evaluate, _train  # noqa: E402
from bench.stages import last_checkpoint  # noqa: E402

RECIPE = ["data.curriculum=solve_rate", "trainer.lr=2e-5", "search.reward=f1",
          "rollout.max_tokens_per_turn=128", "trainer.eval_limit=0"]


def _stats(ev: dict) -> dict:
    eps = ev["episodes"]
    return {"em": ev["em"], "calls": sum(e["tool_calls"] for e in eps) / len(eps),
            "two": sum(e["tool_calls"] >= 2 for e in eps) / len(eps),
            "seen": sum(e.get("answer_seen", False) for e in eps) / len(eps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--retrieval-reward", type=float, default=0.25)
    ap.add_argument("--two-hop", type=int, default=200)
    ap.add_argument("--nq", type=int, default=200)
    ap.add_argument("--work", default="runs/turn_credit_search")
    ap.add_argument("--sft", default="", help="an SFT model folder both runs start from "
                    "(trainer.cold_start=PATH); default: each run's own cold start")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for both runs")
    a = ap.parse_args()
    arms = {"outcome": ["algo.advantage=grpo"],
            "turn": ["algo.advantage=mt_grpo", f"search.retrieval_reward={a.retrieval_reward}"]}
    runs, minutes = {}, {}
    for name, keys in arms.items():
        run = Path(a.work) / name
        t0 = time.perf_counter()
        if not (run / "checkpoints" / f"step_{a.steps}" / "state.json").exists():
            _train(["env=search", f"trainer.total_steps={a.steps}", f"run_dir={run}",
                    f"trainer.save_every={max(1, a.steps // 2)}",
                    f"trainer.prompts_per_step={a.prompts}", f"rollout.n={a.n}", *RECIPE,
                    *keys, *([f"trainer.cold_start={a.sft}"] if a.sft else []),
                    *a.overrides], None)
        minutes[name] = (time.perf_counter() - t0) / 60
        runs[name] = run
    record = {"model": a.sft, "demos": "its"} if a.sft else \
        json.loads((runs["outcome"] / "cold_start" / "cold_start.json").read_text())
    models = {"sft": record["model"],
              **{name: str(last_checkpoint(run)[1]) for name, run in runs.items()}}
    extra = [o for o in a.overrides if o.startswith(("engine.", "rollout."))] + \
        ["rollout.max_tokens_per_turn=128"]
    evals = {data: {name: _evaluate("search", m, data, limit,
                                    Path(a.work) / f"eval_{name}_{data}.json", extra)
                    for name, m in models.items()}
             for data, limit in (("hotpotqa", a.two_hop), ("nq", a.nq)) if limit}
    body = [f"Machine: {machine()}. Command: `python bench/turn_credit_search.py "
            f"{' '.join(sys.argv[1:])}` (training: outcome {minutes['outcome']:.0f} min, turn "
            f"{minutes['turn']:.0f} min in this invocation). smollm2-135m, "
            f"{'the SFT model ' + a.sft if a.sft else 'the cold start'} "
            f"({record.get('demos')} demonstrations, SFT), then {a.steps} GRPO steps of "
            f"{a.prompts} prompts x {a.n} samples each, issue 34's recipe (`{' '.join(RECIPE)}`); "
            f"`turn` adds `algo.advantage=mt_grpo search.retrieval_reward="
            f"{a.retrieval_reward}`. Greedy evals on the same first questions; p: exact "
            f"McNemar, turn against outcome.", "",
            "| questions | model | EM | searches per episode | episodes with 2+ searches | "
            "a result held the answer |", "|---|---|---|---|---|---|"]
    for data, by_model in evals.items():
        for name, ev in by_model.items():
            s = _stats(ev)
            body.append(f"| {data} ({ev['n']}) | {name} | {s['em']:.3f} | {s['calls']:.2f} | "
                        f"{s['two']:.3f} | {s['seen']:.3f} |")
    body += ["", "| questions | metric | outcome | turn | gained / lost | p |",
             "|---|---|---|---|---|---|"]
    for data, by_model in evals.items():
        for key, label in (("em", "EM"), ("two", "2+ searches")):
            pick = (lambda e: bool(e["em"])) if key == "em" else (lambda e: e["tool_calls"] >= 2)
            p = mcnemar(*({e["uid"]: pick(e) for e in by_model[arm]["episodes"]}
                          for arm in ("outcome", "turn")))
            body.append(f"| {data} | {label} | {p.before:.3f} | {p.after:.3f} | "
                        f"{p.gained} / {p.lost} | {p.p_value:.3g} |")
    body += ["", "Training signals, mean over the steps (first half → second half):", "",
             "| run | reward | searches per episode | answer in results | groups with signal |",
             "|---|---|---|---|---|"]
    for name, run in runs.items():
        steps = [m for m in (json.loads(x) for x in (run / "metrics.jsonl").read_text()
                             .splitlines()) if "rollout/reward" in m]
        half = len(steps) // 2

        def span(key: str) -> str:
            parts = [[m[key] for m in chunk if key in m] for chunk in (steps[:half], steps[half:])]
            return " → ".join(f"{sum(p) / len(p):.3f}" if p else "–" for p in parts)
        body.append(f"| {name} | {span('rollout/reward')} | {span('rollout/tool_calls')} | "
                    f"{span('rollout/answer_seen')} | {span('rollout/signal_groups')} |")
    text = "\n".join(body)
    print(text)
    write_section("Turn-level credit on search (smollm2-135m)", text)


if __name__ == "__main__":
    main()
