"""Every algorithm preset on the toy env, several seeds: does the reward rise, how fast.

    python bench/algos_toy.py                 # all presets x seeds 0 1 2, writes docs/
    python bench/algos_toy.py --algos ppo rloo --seeds 0

The task is the test suite's toy env (tests/toy_envs.py LetterEnv: one turn, reward =
share of 'e' in the reply), the model a random-init ``tiny``; the settings are those of
the slow-tier learning tests (30 steps of 4 prompts x 8 samples, 8 tokens, lr 1e-2;
PPO: 32 prompts x 1 sample, critic lr 1e-2, lambda 0.95, the same 32 samples a step).
Reported per algorithm: mean reward of the first and last 3 steps (mean over seeds, and
the lowest seed's last-3 value) and the first step whose reward reaches 0.45. The
baseline is the random-init model's own reward at step 1 (about 0.11).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from agentgym.config import ALGO_PRESETS, build_config  # noqa: E402
from bench.report import write_section  # noqa: E402

BASE = {"model": "tiny", "trainer.total_steps": 30, "trainer.prompts_per_step": 4,
        "rollout.n": 8, "rollout.max_tokens_per_turn": 8, "trainer.lr": 1e-2,
        "trainer.eval_limit": 0, "trainer.save_every": 1000}
EXTRA = {"ppo": {"rollout.n": 1, "trainer.prompts_per_step": 32, "critic.lr": 1e-2,
                 "algo.lam": 0.95}}


def run(algo: str, seed: int, data: Path, work: Path) -> list[float]:
    from agentgym.trainers.loop import train
    cfg = build_config({**BASE, "env": "agentgym-test/Letter-v0", "data": str(data),
                        "algo": algo, "trainer.seed": seed, **EXTRA.get(algo, {}),
                        "run_dir": str(work / f"{algo}-{seed}")})
    rows = [json.loads(x) for x in (train(cfg) / "metrics.jsonl").read_text().splitlines()]
    return [r["rollout/reward"] for r in rows if "rollout/reward" in r]


def plot(curves: dict[str, list[list[float]]], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (algo, runs) in enumerate(curves.items()):
        mean = [sum(x) / len(x) for x in zip(*runs)]
        ax.plot(range(1, len(mean) + 1), mean, label=algo, linestyle=("-", "--", ":")[i % 3])
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward (over seeds)")
    ax.set_title("toy env ('e' share), random-init tiny model")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--algos", nargs="+", default=sorted(ALGO_PRESETS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    from agentgym import envs
    from agentgym.data.rows import write_jsonl
    from toy_envs import letter_rows
    if "agentgym-test/Letter-v0" not in envs.env_ids():
        envs.register_env("agentgym-test/Letter-v0", "toy_envs:LetterEnv")
    curves: dict[str, list[list[float]]] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "toy.jsonl"
        write_jsonl(data, letter_rows(64))
        for algo in a.algos:
            curves[algo] = [run(algo, s, data, Path(tmp)) for s in a.seeds]
            print(algo, " | ".join(" ".join(f"{r:.2f}" for r in c) for c in curves[algo]),
                  flush=True)
    lines = [f"Machine: {platform.machine()}, {os.cpu_count()} CPUs. Command: "
             f"`python bench/algos_toy.py --seeds {' '.join(map(str, a.seeds))}` "
             f"({time.perf_counter() - t0:.0f} s). Toy env (reward = share of 'e'), "
             "random-init `tiny`, 30 steps of 32 samples (4 prompts x 8; PPO 32 x 1), "
             "lr 1e-2, the slow-tier learning tests' settings.", "",
             "| algo | first 3 steps | last 3 steps (mean) | last 3 steps (worst seed) | "
             "first step >= 0.45 (per seed) |", "|---|---|---|---|---|"]
    for algo, runs in curves.items():
        first = sum(sum(c[:3]) / 3 for c in runs) / len(runs)
        lasts = [sum(c[-3:]) / 3 for c in runs]
        reach = [next((i + 1 for i, r in enumerate(c) if r >= 0.45), None) for c in runs]
        lines.append(f"| {algo} | {first:.3f} | {sum(lasts) / len(lasts):.3f} | "
                     f"{min(lasts):.3f} | {', '.join(str(x) if x else 'never' for x in reach)} |")
    lines += ["", "Curves: `docs/algos_toy_reward.png`."]
    body = "\n".join(lines)
    print(body)
    if not a.no_write:
        plot(curves, ROOT / "docs" / "algos_toy_reward.png")
        write_section("Algorithms on the toy env (tiny, CPU)", body)


if __name__ == "__main__":
    main()
