"""Asynchronous vs synchronous training: wall-clock per step and per trained sample.

Same model (``tiny``), data, seeds and learning rate in every run; the env has a
long-tailed tool latency (log-normal per step) and long-tailed episode lengths (the
number of turns per prompt is drawn from a heavy-tailed distribution), the regime where
a synchronous step waits for its slowest episode. The reward is the fraction of ``e``
in the replies, which a random-init model learns within a few steps, so the reward
curves show whether stale samples hurt learning.

    python bench/async_vs_sync.py                     # writes docs/BENCHMARKS.md, docs/async_reward.png
    python bench/async_vs_sync.py --steps 10 --no-write

Runs: ``trainer.mode=sync`` and ``trainer.mode=async`` at ``max_staleness`` 0, 1, 2, 4
(off-policy correction ``recompute``, the default), plus staleness 2 with
``algo.off_policy=tis`` and ``decoupled``; each over ``--seeds`` (``trainer.seed``).
Speed-ups are taken against the synchronous run of the same seed.
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

from agentgym import envs  # noqa: E402
from agentgym.config import build_config  # noqa: E402
from agentgym.data.rows import write_jsonl  # noqa: E402
from agentgym.envs.base import AgentEnv  # noqa: E402

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
    from agentgym.trainers.loop import train
    t0 = time.perf_counter()
    run_dir = train(cfg)
    wall = time.perf_counter() - t0
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "rollout/reward" in m]
    samples = sum(cfg.trainer.prompts_per_step * cfg.rollout.n for _ in steps)
    step_s = [m["time/step_s"] for m in steps]
    late = step_s[len(step_s) // 2:]  # the second half: after any early transient
    per_step = cfg.trainer.prompts_per_step * cfg.rollout.n
    return {"name": name, "wall": wall, "steps": steps, "step_s": statistics.median(step_s),
            "per_sample": wall / samples, "late_per_sample": sum(late) / (len(late) * per_step),
            "reward_last": statistics.mean(m["rollout/reward"] for m in steps[-5:]),
            "dropped": sum(m.get("async/dropped_groups", 0.0) for m in steps),
            "staleness": statistics.mean(m.get("async/staleness_mean", 0.0) for m in steps)}


def _mean(xs):
    return sum(xs) / len(xs)


def _span(xs, fmt="{:.2f}") -> str:
    """Mean and range over seeds."""
    if len(xs) == 1:
        return fmt.format(xs[0])
    return f"{fmt.format(_mean(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def configs(staleness: list[int]) -> list[tuple[str, dict]]:
    out = [("sync", {})]
    out += [(f"async, staleness {s}", {"trainer.mode": "async", "trainer.max_staleness": s})
            for s in staleness]
    for mode in ("tis", "decoupled"):
        out.append((f"async, staleness 2, {mode}", {"trainer.mode": "async",
                                                    "trainer.max_staleness": 2,
                                                    "algo.off_policy": mode}))
    return out


def plot(results: dict[str, list[dict]], png: Path) -> None:
    """Mean reward over seeds, per step and over (mean cumulative) wall-clock time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, runs in results.items():
        n_steps = min(len(r["steps"]) for r in runs)
        ys = [_mean([r["steps"][i]["rollout/reward"] for r in runs]) for i in range(n_steps)]
        step_s = [_mean([r["steps"][i]["time/step_s"] for r in runs]) for i in range(n_steps)]
        xs = [sum(step_s[:i + 1]) for i in range(n_steps)]
        style = "--" if "," in name.split("staleness")[-1] else "-"
        a1.plot(range(1, n_steps + 1), ys, style, label=name)
        a2.plot(xs, ys, style, label=name)
    a1.set(xlabel="step", ylabel="rollout reward (mean over seeds)", title="reward per step")
    a2.set(xlabel="wall-clock seconds", ylabel="rollout reward (mean over seeds)",
           title="reward over time")
    a1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--latency", type=float, default=0.05, help="median tool latency, s")
    ap.add_argument("--staleness", default="0,1,2,4")
    ap.add_argument("--seeds", default="0,1,2")
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
    seeds = [int(x) for x in args.seeds.split(",")]
    results: dict[str, list[dict]] = {}
    for seed in seeds:  # seed-major: every config sees the same machine conditions
        for name, over in configs([int(x) for x in args.staleness.split(",")]):
            r = run(f"{name} seed {seed}", {**base, **over, "trainer.seed": seed}, out)
            results.setdefault(name, []).append(r)
            print(f"{r['name']:36s} wall {r['wall']:6.1f}s  step {r['step_s']:.3f}s  "
                  f"per sample {r['per_sample'] * 1e3:.1f} ms  "
                  f"reward(last 5) {r['reward_last']:.3f}  dropped {r['dropped']:.0f}  "
                  f"staleness {r['staleness']:.2f}", flush=True)
    if not args.no_write:
        plot(results, ROOT / "docs" / "async_reward.png")

    sync = results["sync"]
    cmd = "python bench/async_vs_sync.py " + " ".join(sys.argv[1:])
    lines = [
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs. Command: `{cmd.strip()}`.",
        f"Model `tiny`, lr 1e-2, {args.steps} steps of {args.prompts} prompts x n={args.n}, "
        f"seeds {args.seeds} (`trainer.seed`). Env: 1-6 turns per prompt (Pareto-tailed, so "
        f"response lengths are long-tailed too), each step a log-normal tool latency "
        f"(median {args.latency}s, sigma 1), up to 16 tokens per turn; reward = fraction of "
        f"'e' in the replies. Per trained sample: the run's whole wall-clock time (start-up "
        f"included, after a warm-up run) / samples trained; second half: the summed "
        f"`time/step_s` of the last {args.steps - args.steps // 2} steps / their samples "
        f"(whether the gain holds as the run goes on); s/step: the median of `time/step_s`. "
        f"Each cell: mean over seeds (min-max); speed-ups against the sync run of the same "
        f"seed.", "",
        "| run | s/step | ms/trained sample | vs sync | second half: vs sync "
        "| reward, last 5 steps | groups dropped | mean staleness |",
        "|---|---|---|---|---|---|---|---|"]
    for name, runs in results.items():
        speed = [s["per_sample"] / r["per_sample"] for s, r in zip(sync, runs)]
        late = [s["late_per_sample"] / r["late_per_sample"] for s, r in zip(sync, runs)]
        lines.append(
            f"| {name} | {_span([r['step_s'] for r in runs], '{:.3f}')} | "
            f"{_span([r['per_sample'] * 1e3 for r in runs], '{:.1f}')} | "
            f"{_span(speed, '{:.2f}x')} | {_span(late, '{:.2f}x')} | "
            f"{_span([r['reward_last'] for r in runs], '{:.3f}')} | "
            f"{_span([r['dropped'] for r in runs], '{:.0f}')} | "
            f"{_span([r['staleness'] for r in runs])} |")
    lines += ["", "Reward curves (mean over seeds): `docs/async_reward.png`, per step and over "
              "wall-clock time."]
    print("\n".join(lines))
    if not args.no_write:
        write_section("Asynchronous vs synchronous training (tiny, CPU)", "\n".join(lines))


if __name__ == "__main__":
    main()
