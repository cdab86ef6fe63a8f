"""The smallest cold start that teaches the protocol: SFT on N demonstrations, then the
format validity and EM of greedy episodes on held-out questions, for several N.

    python bench/cold_start_size.py --demos 8,16,32,64 --eval-limit 50
    python bench/cold_start_size.py --demos 16,32 sft.epochs=3 trainer.mixed_precision=bf16

Each size runs the cold start exactly as ``agentgym train`` does
(:func:`agentgym.trainers.cold_start.prepare` with ``trainer.cold_start_demos=N``; the probe
threshold is set to 1.0 so it always runs), then ``agentgym eval env=search data=nq`` on
its model. Results are cached by content like any cold start, so a re-run only evaluates.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentgym.cli import main as cli  # noqa: E402
from agentgym.reporting.stats import wilson_ci95  # noqa: E402
from agentgym.config import build_config  # noqa: E402
from agentgym.core.overrides import parse_overrides  # noqa: E402
from bench.report import machine, write_section  # noqa: E402
from agentgym.trainers.hooks import Hooks  # noqa: E402


class _Print(Hooks):
    def announce(self, text: str) -> None:
        print(text, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default="search", choices=["search"])
    ap.add_argument("--demos", default="8,16,32,64", help="sizes, comma-separated")
    ap.add_argument("--eval-limit", type=int, default=50)
    ap.add_argument("--work", default="runs/cold_size")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides (cold start and eval)")
    a = ap.parse_args()
    from agentgym.trainers.cold_start import prepare
    rows = []
    sizes = [int(x) for x in a.demos.split(",")]
    for n in sizes:
        run = Path(a.work) / f"demos_{n}"
        over = {"env": a.env, "trainer.cold_start_demos": n, "trainer.cold_start_threshold": 1.0,
                "run_dir": str(run), **parse_overrides(a.overrides)}
        t0 = time.perf_counter()
        cfg = prepare(build_config(over), _Print())
        stage = time.perf_counter() - t0
        record = json.loads((run / "cold_start" / "cold_start.json").read_text())
        out = run / f"eval_nq_{record['key']}.json"  # this cold start's model, no other
        # the eval shares the run's engine and budgets, never its model, data or output
        evals = [o for o in a.overrides if not o.startswith(
            ("trainer.", "sft.", "model", "data", "limit", "env", "run_dir", "out"))]
        argv = ["eval", f"env={a.env}", f"model={cfg.model.path}", "data=nq",
                f"limit={a.eval_limit}", f"out={out}", *evals]
        if not out.exists() and cli(argv) != 0:
            raise SystemExit(f"eval of {cfg.model.path} failed")
        r = json.loads(out.read_text())
        rows.append((n, record, r, stage))
        print(f"{n} demos: format-valid {r['format_valid']:.3f} EM {r['em']:.3f}", flush=True)
    body = [f"Machine: {machine()}. Command: `python bench/cold_start_size.py "
            f"{' '.join(sys.argv[1:])}`. Each size: the cold start of `agentgym train "
            f"env={a.env}` (demonstrations from the answerable training questions, SFT with "
            f"lr `trainer.cold_start_lr` cosine), then `agentgym eval env={a.env} data=nq "
            f"limit={a.eval_limit}` (greedy) of its model. Intervals: Wilson 95%.\n",
            "| demonstrations | lr | epochs | rows looked at | SFT steps | SFT loss first → last | "
            "demos (s) | SFT (s) | probe format-valid (train q.) | held-out format-valid "
            "[95% CI] | held-out EM [95% CI] | eval (s) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, rec, r, _ in rows:
        fv = wilson_ci95(r["format_valid"], r["n"])
        em = wilson_ci95(r["em"], r["n"])
        sec = rec.get("seconds", {})
        body.append(
            f"| {n} | {rec['sft']['lr']:g} | {rec['sft']['epochs']} | "
            f"{rec.get('rows_looked_at', '')} | {rec['sft']['steps']} | "
            f"{rec['sft']['loss_first']:.3f} → {rec['sft']['loss_last']:.3f} | "
            f"{sec.get('demos', float('nan')):.0f} | {sec.get('sft', float('nan')):.0f} | "
            f"{rec['probe_after']['format_valid']:.2f} | {r['format_valid']:.3f} "
            f"[{fv[0]:.3f}, {fv[1]:.3f}] | {r['em']:.3f} [{em[0]:.3f}, {em[1]:.3f}] | "
            f"{r['seconds']:.0f} |")
    ok = [n for n, _, r, _ in rows if r["format_valid"] >= 0.9]
    body.append("")
    body.append(f"Smallest size with held-out format-valid >= 0.9: "
                f"{min(ok) if ok else 'none of these'}.")
    # one section per SFT setting: the default one, or the overrides that change the SFT
    sft_over = [o for o in a.overrides if o.startswith(("trainer.cold_start_lr", "sft."))]
    write_section(f"Cold start size: {cfg.model.name} on {a.env}"
                  + (f" ({', '.join(sft_over)})" if sft_over else ""), "\n".join(body))


if __name__ == "__main__":
    main()
