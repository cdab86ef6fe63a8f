"""Signal per step: the share of GRPO groups whose rewards differ (the only groups a
group-relative advantage learns from), under the means a practitioner has to raise it.

    python bench/group_signal.py --model runs/demo/cold_start/model --prompts 24 \\
        engine.dtype=bfloat16

For each sampling setting (training questions all / answerable only; temperature), it
samples ``--n`` episodes for each of ``--prompts`` training questions with the model (the
SFT model of a cold start: the base model's groups are all 0), and scores the same groups
with the EM reward and with the F1 reward, with the first 4 samples and with all of them.
DAPO's dynamic sampling keeps only groups with signal and samples again until the batch is
full, so its cost is 1 / (share with signal) sampling rounds per step.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentgym.config import build_config  # noqa: E402
from agentgym.core.overrides import parse_overrides  # noqa: E402
from bench.report import machine, write_section  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model folder (an SFT model)")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--temperatures", default="1.0,1.2")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    from agentgym.data.rows import training_rows
    from agentgym.rollout.runtime import build_manager
    from agentgym.trainers.algos import signal_share
    settings = [(True, float(t)) for t in a.temperatures.split(",")] + [(False, 1.0)]
    results = []
    for answerable_only, temperature in settings:
        cfg = build_config({"env": "search", "model.path": a.model, "rollout.n": a.n,
                            "rollout.temperature": temperature,
                            "data.answerable_only": answerable_only,
                            **parse_overrides(a.overrides)})
        rows = training_rows(cfg).rows[:a.prompts]
        manager, engine, _ = build_manager(copy.deepcopy(cfg))
        t0 = time.perf_counter()
        try:
            trajs = asyncio.run(manager.run(rows))
        finally:
            manager.close()
            engine.close()
        seconds = time.perf_counter() - t0
        row = {"answerable": answerable_only, "temperature": temperature, "seconds": seconds,
               "episodes": len(trajs),
               "format_valid": sum(t.terminated and t.metrics["malformed_actions"] == 0
                                   for t in trajs) / len(trajs)}
        for metric in ("em", "f1"):
            row[f"mean_{metric}"] = sum(float(t.info.get(metric, 0.0)) for t in trajs) / len(trajs)
            for n in (4, a.n):
                first = [t for t in trajs if t.sample_index < n]
                row[f"{metric}_n{n}"] = signal_share(
                    [float(t.info.get(metric, 0.0)) for t in first], [t.uid for t in first])
        results.append(row)
        print(row, flush=True)
    body = [f"Machine: {machine()}. Command: `python bench/group_signal.py {' '.join(sys.argv[1:])}`. "
            f"{a.prompts} training questions × {a.n} samples per setting, the same episodes "
            f"scored with the EM and the F1 reward; \"n=4\" uses each group's first 4 "
            f"samples. A cell is the share of groups whose rewards are not all equal.\n",
            f"| training questions | temperature | format-valid | mean EM | mean F1 | "
            f"EM, n=4 | EM, n={a.n} | F1, n=4 | F1, n={a.n} | DAPO rounds/step (EM, n={a.n}) "
            f"| sampling (s) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        em_share = r[f"em_n{a.n}"]
        rounds = f"{1 / em_share:.1f}" if em_share else "∞"
        body.append(f"| {'answerable only' if r['answerable'] else 'all'} | "
                    f"{r['temperature']} | {r['format_valid']:.2f} | {r['mean_em']:.3f} | "
                    f"{r['mean_f1']:.3f} | {r['em_n4']:.2f} | {r[f'em_n{a.n}']:.2f} | "
                    f"{r['f1_n4']:.2f} | {r[f'f1_n{a.n}']:.2f} | {rounds} | "
                    f"{r['seconds']:.0f} |")
    text = "\n".join(body)
    print(text)
    write_section("Signal per step: smollm2-135m after the cold start, search", text)


if __name__ == "__main__":
    main()
