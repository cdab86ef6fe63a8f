"""Asynchronous vs synchronous training: wall-clock per step and per trained sample.

Same model (``tiny``), data, seeds and learning rate in every run; the env has a
long-tailed tool latency (log-normal per step) and long-tailed episode lengths (the
number of turns per prompt is drawn from a heavy-tailed distribution), the regime where
a synchronous step waits for its slowest episode. The reward is the fraction of ``e``
in the replies, which a random-init model learns within a few steps, so the reward
curves show whether stale samples hurt learning.

    python bench/async_vs_sync.py                     # writes docs/BENCHMARKS.md, docs/async_reward.png
    python bench/async_vs_sync.py --steps 10 --no-write

Runs: ``trainer.mode=sync`` and ``trainer.mode=async`` at ``max_staleness`` 0, 1, 2, 4.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import envs  # noqa: E402
from agentgym.config import build_config  # noqa: E402
from agentgym.data import write_jsonl  # noqa: E402
from envs.base import AgentEnv  # noqa: E402

from bench.report import write_section  # noqa: E402

ENV_ID = "agentgym-bench/SlowLetter-v0"


class SlowLetterEnv(AgentEnv):
    """``extra_info.turns`` turns; each step sleeps a log-normal tool latency (median
    ``extra_info.latency`` s, sigma 1); the last step pays the fraction of 'e' in all
    replies."""

    observation_format = "inline"
    stop_strings = ("\n\n",)

    def __init__(self, max_turns: int = 8) -> None:
        super().__init__(max_turns=max_turns)

    def _reset(self, row):
        extra = (row or {}).get("extra_info") or {}
        self.turns, self.latency = int(extra.get("turns", 1)), float(extra.get("latency", 0.0))
        self.text = ""
        prompt = row["prompt"] if row else [{"role": "user", "content": "Write."}]
        return [dict(m) for m in prompt], {}

    def _step(self, action, last_turn):
        if self.latency:
            time.sleep(self.latency * math.exp(float(self.np_random.standard_normal())))
        self.text += action.replace("<|im_end|>", "")
        if self._turn >= self.turns or last_turn:
            reward = self.text.count("e") / max(1, len(self.text))
            return [], reward, True, {"em": float(reward > 0.5)}
        return [{"role": "user", "content": "\nMore.\n"}], 0.0, False, {}


def rows(n: int, latency: float, seed: int = 0) -> list[dict]:
    import random
    rng = random.Random(seed)
    return [{"data_source": "bench", "env": ENV_ID, "ability": "toy",
             "prompt": [{"role": "user", "content": f"Write text #{i}."}],
             "reward_model": {"style": "rule", "ground_truth": "e"},
             "extra_info": {"index": i, "latency": latency,
                            "turns": min(6, 1 + int(rng.paretovariate(1.5)) - 1)}}
            for i in range(n)]


def run(name: str, overrides: dict, out: Path) -> dict:
    cfg = build_config({**overrides, "run_dir": str(out / name), "trainer.resume": "never"})
    from trainers import train
    t0 = time.perf_counter()
    run_dir = train(cfg)
    wall = time.perf_counter() - t0
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "rollout/reward" in m]
    samples = sum(cfg.trainer.prompts_per_step * cfg.rollout.n for _ in steps)
    step_s = [m["time/step_s"] for m in steps]
    return {"name": name, "wall": wall, "steps": steps, "step_s": statistics.median(step_s),
            "per_sample": wall / samples,
            "reward_last": statistics.mean(m["rollout/reward"] for m in steps[-5:]),
            "dropped": sum(m.get("async/dropped_groups", 0.0) for m in steps),
            "staleness": statistics.mean(m.get("async/staleness_mean", 0.0) for m in steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--latency", type=float, default=0.05, help="median tool latency, s")
    ap.add_argument("--staleness", default="0,1,2,4")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    if ENV_ID not in envs.env_ids():
        envs.register_env(ENV_ID, "bench.async_vs_sync:SlowLetterEnv")
    out = Path(tempfile.mkdtemp(prefix="agentgym-async-bench-"))
    data = out / "data.jsonl"
    write_jsonl(data, rows(args.steps * args.prompts * 2, args.latency))
    base = {"env": ENV_ID, "model": "tiny", "data": str(data),
            "trainer.total_steps": args.steps, "trainer.prompts_per_step": args.prompts,
            "rollout.n": args.n, "rollout.max_turns": 6, "rollout.max_tokens_per_turn": 16,
            "rollout.max_response_tokens": 512, "trainer.lr": 1e-2, "trainer.eval_limit": 0,
            "trainer.save_every": 10 ** 6}
    run("warm-up", {**base, "trainer.total_steps": 1}, out)  # imports, model cache
    results = [run("sync", base, out)]
    for s in [int(x) for x in args.staleness.split(",")]:
        results.append(run(f"async, staleness {s}", {**base, "trainer.mode": "async",
                                                    "trainer.max_staleness": s}, out))
    for r in results:
        print(f"{r['name']:22s} wall {r['wall']:6.1f}s  step {r['step_s']:.3f}s  "
              f"per sample {r['per_sample'] * 1e3:.1f} ms  reward(last 5) {r['reward_last']:.3f}  "
              f"dropped {r['dropped']:.0f}  staleness {r['staleness']:.2f}", flush=True)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        t = 0.0
        xs = []
        for m in r["steps"]:
            t += m["time/step_s"]
            xs.append(t)
        ys = [m["rollout/reward"] for m in r["steps"]]
        a1.plot([m["step"] for m in r["steps"]], ys, label=r["name"])
        a2.plot(xs, ys, label=r["name"])
    a1.set(xlabel="step", ylabel="rollout reward", title="reward per step")
    a2.set(xlabel="wall-clock seconds", ylabel="rollout reward", title="reward over time")
    a1.legend(fontsize=8)
    fig.tight_layout()
    png = ROOT / "docs" / "async_reward.png"
    if not args.no_write:
        fig.savefig(png, dpi=90)

    sync = results[0]
    cmd = "python bench/async_vs_sync.py " + " ".join(sys.argv[1:])
    lines = [
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs. Command: `{cmd.strip()}`.",
        f"Model `tiny`, lr 1e-2, {args.steps} steps of {args.prompts} prompts x n={args.n}. "
        f"Env: 1-6 turns per prompt (Pareto-tailed), each step a log-normal tool latency "
        f"(median {args.latency}s, sigma 1), up to 16 tokens per turn; reward = fraction of "
        f"'e' in the replies. Same data and seeds in every run. Per trained sample: the run's "
        f"whole wall-clock time (start-up included, after a warm-up run) / samples trained; "
        f"s/step: the median of `time/step_s`.", "",
        "| run | s/step | ms/trained sample | vs sync | reward, last 5 steps | groups dropped | mean staleness |",
        "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['name']} | {r['step_s']:.3f} | {r['per_sample'] * 1e3:.1f} | "
                     f"{sync['per_sample'] / r['per_sample']:.2f}x | {r['reward_last']:.3f} | "
                     f"{r['dropped']:.0f} | {r['staleness']:.2f} |")
    lines += ["", "Reward curves: `docs/async_reward.png` (per step, and over wall-clock time)."]
    print("\n".join(lines))
    if not args.no_write:
        write_section("Asynchronous vs synchronous training (tiny, CPU)", "\n".join(lines))


if __name__ == "__main__":
    main()
