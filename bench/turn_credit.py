"""Turn-level credit on the toy env whose outcome is a coin: which estimators learn the
first turn, several seeds.

    python bench/turn_credit.py                  # 4 arms x seeds 0 1 2, writes docs/
    python bench/turn_credit.py --arms outcome mt_grpo --seeds 0

The task is tests/toy_envs.py TwoStepEnv: two turns; the first reply is scored by its
share of 'e' when the rows ask for a turn reward, the second by a coin (a checksum's
parity). The model is a random-init ``tiny``; the settings are those of the learning test
in tests/test_turn_credit.py (20 steps of 4 prompts x 8 samples, 8 tokens a turn, lr
1e-2). Arms: ``outcome`` (no turn reward, GRPO: the coin alone), ``summed`` (the turn
reward added into the episode return, GRPO), ``mt_grpo`` and ``gigpo`` (the turn reward
kept apart). Reported: the first turn's 'e' share, first and last 3 steps.
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

from agentgym.config import build_config  # noqa: E402
from bench.report import write_section  # noqa: E402

BASE = {"model": "tiny", "trainer.total_steps": 20, "trainer.prompts_per_step": 4,
        "rollout.n": 8, "rollout.max_tokens_per_turn": 8, "trainer.lr": 1e-2,
        "trainer.eval_limit": 0, "trainer.save_every": 1000}
ARMS = {"outcome": (False, "grpo"), "summed": (True, "grpo"), "mt_grpo": (True, "mt_grpo"),
        "gigpo": (True, "gigpo")}


def run(arm: str, seed: int, work: Path) -> list[float]:
    from agentgym.data.rows import write_jsonl
    from toy_envs import two_step_rows
    from agentgym.trainers.loop import train
    turn_reward, advantage = ARMS[arm]
    data = work / f"{arm}.jsonl"
    write_jsonl(data, two_step_rows(64, turn_reward))
    cfg = build_config({**BASE, "env": "agentgym-test/TwoStep-v0", "data": str(data),
                        "algo.advantage": advantage, "trainer.seed": seed,
                        "run_dir": str(work / f"{arm}-{seed}")})
    rows = [json.loads(x) for x in (train(cfg) / "metrics.jsonl").read_text().splitlines()]
    return [r["rollout/em"] for r in rows if "rollout/em" in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    from agentgym import envs
    if "agentgym-test/TwoStep-v0" not in envs.env_ids():
        envs.register_env("agentgym-test/TwoStep-v0", "toy_envs:TwoStepEnv")
    curves: dict[str, list[list[float]]] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for arm in a.arms:
            curves[arm] = [run(arm, s, Path(tmp)) for s in a.seeds]
            print(arm, " | ".join(" ".join(f"{r:.2f}" for r in c) for c in curves[arm]),
                  flush=True)
    lines = [f"Machine: {platform.machine()}, {os.cpu_count()} CPUs. Command: "
             f"`python bench/turn_credit.py --seeds {' '.join(map(str, a.seeds))}` "
             f"({time.perf_counter() - t0:.0f} s). TwoStep toy env (first turn: share of "
             "'e', paid as a turn reward when the arm has one; outcome: a coin), random-init "
             "`tiny`, 20 steps of 32 samples (4 prompts x 8), lr 1e-2.", "",
             "| arm | turn reward | estimator | first turn's 'e' share, first 3 steps | "
             "last 3 steps (mean) | last 3 steps (worst seed) |", "|---|---|---|---|---|---|"]
    for arm, runs in curves.items():
        first = sum(sum(c[:3]) / 3 for c in runs) / len(runs)
        lasts = [sum(c[-3:]) / 3 for c in runs]
        turn_reward, advantage = ARMS[arm]
        lines.append(f"| {arm} | {'yes' if turn_reward else 'no'} | {advantage} | "
                     f"{first:.3f} | {sum(lasts) / len(lasts):.3f} | {min(lasts):.3f} |")
    body = "\n".join(lines)
    print(body)
    if not a.no_write:
        write_section("Turn-level credit on a toy env (tiny, CPU)", body)


if __name__ == "__main__":
    main()
