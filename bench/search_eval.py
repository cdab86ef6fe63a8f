"""Search EM of a model on the held-out NQ questions, written to docs/BENCHMARKS.md.

    python bench/search_eval.py                                # smollm2-135m, 200 questions
    python bench/search_eval.py --model runs/x/checkpoints/step_20 --label "after GRPO"

Runs exactly ``agentgym eval env=search model=MODEL data=nq limit=N`` (greedy, the local
BM25 retriever over the shipped corpus) and records EM with a 95% CI, F1 and
format-validity.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentgym.cli import main as cli  # noqa: E402
from agentgym.reporting.stats import wilson_ci95  # noqa: E402
from bench.report import write_section  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--label", default="step-0 baseline")
    ap.add_argument("--out", default="", help="also keep the result JSON here")
    ap.add_argument("--result", default="", help="write the section from this saved JSON "
                    "instead of running the eval again")
    ap.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    args = ap.parse_args()
    argv = ["eval", "env=search", f"model={args.model}", "data=nq", f"limit={args.limit}",
            *args.overrides]
    if args.result:
        r = json.loads(Path(args.result).read_text())
    else:
        out = Path(args.out or Path(tempfile.mkdtemp()) / "eval.json")
        if cli(argv + [f"out={out}"]) != 0:
            raise SystemExit("eval failed")
        r = json.loads(out.read_text())
    if not isinstance(r["em_ci95"], list):  # results saved before the Wilson interval
        r["em_ci95"] = list(wilson_ci95(r["em"], r["n"]))
    body = (f"Machine: {platform.machine()}, {__import__('os').cpu_count()} CPUs. "
            f"Command: `agentgym {' '.join(argv)}` (via `python bench/search_eval.py "
            f"{' '.join(sys.argv[1:])}`). Greedy decoding, local BM25 retriever (top-3) over "
            f"the shipped 21k-passage corpus, {r['n']} NQ questions "
            "(first of `data/search/nq_eval.jsonl`).\n\n"
            "| model | questions | EM | 95% CI (Wilson) | F1 | format-valid | answered | mean turns | "
            "mean searches | seconds |\n|---|---|---|---|---|---|---|---|---|---|\n"
            f"| `{r['model']}` | {r['n']} | {r['em']:.3f} | [{r['em_ci95'][0]:.3f}, "
            f"{r['em_ci95'][1]:.3f}] | {r['f1']:.3f} | "
            f"{r['format_valid']:.3f} | {r['answered']:.3f} | {r['mean_turns']:.2f} | "
            f"{r['mean_tool_calls']:.2f} | {r['seconds']:.0f} |")
    write_section(f"Search EM on NQ: {args.label}", body)


if __name__ == "__main__":
    main()
