"""GRPO training throughput: AgentGym's recipe against TRL's GRPOTrainer, in one run.

    make bench-trl        # builds .venv-bench (TRL lives there only), runs both lines below
    .venv-bench/bin/python bench/grpo_vs_trl.py --model tiny --steps 8 --repeats 2
    .venv-bench/bin/python bench/grpo_vs_trl.py --model smollm2-135m --steps 4 --completion-len 48 --repeats 2

Both sides train the same model from the same weights, one after the other in this
process, on the same single-turn task: the test suite's toy env (reward = share of 'e'
in the reply; TRL gets the same function as its reward). Same batch: ``--prompts`` x
``--group`` completions of at most ``--completion-len`` tokens, temperature 1, one
optimizer step per step (AdamW, ``--lr``, constant LR, grad clip 1.0, fp32), no KL (no
reference model), token-mean loss (TRL's ``loss_type="dapo"``), the whole step in one
forward/backward (no micro-batching on either side). The first step is a warm-up and
left out; figures are medians over the rest. ``--repeats R`` runs each side R times in
A-B-B-A order, so a drift in the machine's load hits both alike.

Measured per step: the whole step, its generation part, and its update part (everything
after generation: scoring, advantages, forward/backward, optimizer step), and the
update's throughput in prompt+completion tokens per second. Neither side recomputes the
old logprobs in a separate pass: with one optimizer step per generation both take the
update's own forward pass (AgentGym's ``phases.reuses_update_logprobs``). Known
difference, kept because it is what each recipe does: AgentGym's toy env ends a reply at
a blank line, TRL's runs to end-of-sequence or the length cap, so AgentGym's completions
are somewhat shorter; the tokens/s columns account for it, the step ratio does not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from agentgym.models.zoo import resolve_model  # noqa: E402
from bench.report import write_section  # noqa: E402


def prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Write text #{i}."}] for i in range(n)]


def e_share(text: str) -> float:
    """The toy env's reward (tests/toy_envs.py LetterEnv), for TRL's reward function."""
    return text.count("e") / max(1, len(text))


def run_agentgym(a, model_path: Path, work: Path) -> list[dict]:
    from agentgym import envs
    from agentgym.config import build_config
    from agentgym.data.rows import write_jsonl
    from toy_envs import letter_rows
    from agentgym.trainers.loop import train
    if "agentgym-test/Letter-v0" not in envs.env_ids():
        envs.register_env("agentgym-test/Letter-v0", "toy_envs:LetterEnv")
    data = work / "prompts.jsonl"
    write_jsonl(data, letter_rows(a.prompts * (a.steps + 1)))
    cfg = build_config({
        "env": "agentgym-test/Letter-v0", "model.path": str(model_path), "data": str(data),
        "algo": "grpo", "trainer.total_steps": a.steps, "trainer.prompts_per_step": a.prompts,
        "rollout.n": a.group, "rollout.max_tokens_per_turn": a.completion_len,
        "rollout.max_response_tokens": a.completion_len, "rollout.temperature": 1.0,
        "engine.max_batch_size": a.prompts * a.group, "trainer.lr": a.lr,
        "trainer.micro_batch_tokens": 1 << 20, "trainer.eval_limit": 0,
        "trainer.save_every": 10_000, "trainer.seed": a.seed, "run_dir": str(work / "agentgym")})
    run = train(cfg)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    out = []
    for r in rows:
        n = r["rollout/count"]
        out.append({"step_s": r["time/step_s"], "generate_s": r["time/rollout_s"],
                    "update_s": r["time/step_s"] - r["time/rollout_s"],
                    "fwd_bwd_s": r["time/update_s"], "sync_s": r["time/sync_s"],
                    "update_tokens": n * (r["rollout/prompt_length"] + r["rollout/response_length"]),
                    "completion_len": r["rollout/generated_tokens"], "n": n,
                    "reward": r["rollout/reward"]})
    return out


def run_trl(a, model_path: Path, work: Path) -> list[dict]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from agentgym.models.zoo import load_tokenizer

    steps: list[dict] = []

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            steps[-1]["generate_s"] = time.perf_counter() - t0
            steps[-1]["update_tokens"] = float(out["prompt_mask"].sum() + out["completion_mask"].sum())
            steps[-1]["completion_len"] = float(out["completion_mask"].sum(-1).float().mean())
            steps[-1]["n"] = float(out["completion_mask"].shape[0])
            return out

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            steps.append({"t0": time.perf_counter()})

        def on_step_end(self, args, state, control, **kw):
            s = steps[-1]
            s["step_s"] = time.perf_counter() - s.pop("t0")
            s["update_s"] = s["step_s"] - s["generate_s"]

    def reward(completions, **_):
        return [e_share(c[0]["content"] if isinstance(c, list) else c) for c in completions]

    batch = a.prompts * a.group
    config = GRPOConfig(
        output_dir=str(work / "trl"), max_steps=a.steps, per_device_train_batch_size=batch,
        gradient_accumulation_steps=1, steps_per_generation=1, num_generations=a.group,
        max_completion_length=a.completion_len, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, beta=0.0, num_iterations=1, epsilon=0.2, loss_type="dapo",
        scale_rewards="group", use_cpu=True, bf16=False, fp16=False, seed=a.seed,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0)
    data = Dataset.from_list([{"prompt": p} for p in prompts(a.prompts * (a.steps + 1))])
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    trainer = Timed(model=model, reward_funcs=reward, args=config, train_dataset=data,
                    processing_class=load_tokenizer(model_path), callbacks=[Clock()])
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    for s, r in zip(steps, rewards):
        s["reward"] = r
    return steps


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def summary(rows: list[dict]) -> dict:
    """Medians over the measured steps (each run's first step, a warm-up, left out)."""
    for r in rows:
        r["gen_tok_s"] = r["completion_len"] * r["n"] / r["generate_s"]
        r["update_tok_s"] = r["update_tokens"] / r["update_s"]
    out = {k: median(rows, k) for k in ("step_s", "generate_s", "gen_tok_s", "update_s",
                                        "update_tok_s", "completion_len")}
    out.update({k: median(rows, k) for k in ("fwd_bwd_s", "sync_s") if k in rows[0]})
    out["reward"] = statistics.mean(r.get("reward", float("nan")) for r in rows)
    out["steps"] = len(rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--completion-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each, in A-B-B-A order so a drift in machine load cancels")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    a = ap.parse_args()
    try:
        import trl
    except ImportError:
        sys.exit("TRL is not installed here: run `make bench-trl` (it builds .venv-bench with "
                 "requirements/bench.txt) or pip install -c requirements/constraints.txt "
                 "-r requirements/bench.txt")
    model_path = resolve_model(a.model)
    threads = torch.get_num_threads()
    runners = {"AgentGym": run_agentgym, "TRL GRPOTrainer": run_trl}
    names = list(runners)
    order = [n for k in range(a.repeats) for n in (names if k % 2 == 0 else names[::-1])]
    measured: dict[str, list[dict]] = {name: [] for name in runners}
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(order):
            print(f"== {name}: {a.steps} steps", flush=True)
            t0 = time.perf_counter()
            rows = runners[name](a, model_path, Path(tmp) / str(i))
            measured[name] += rows[1:]  # the first step of each run is a warm-up
            print(f"   {time.perf_counter() - t0:.1f}s total; per step: "
                  + ", ".join(f"{r['step_s']:.2f}" for r in rows), flush=True)
    results = {name: summary(rows) for name, rows in measured.items()}
    ours, peer = results["AgentGym"], results["TRL GRPOTrainer"]
    lines = [f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch threads {threads}. "
             f"Command: `.venv-bench/bin/python bench/grpo_vs_trl.py --model {a.model} "
             f"--steps {a.steps} --prompts {a.prompts} --group {a.group} "
             f"--completion-len {a.completion_len} --repeats {a.repeats}` "
             f"(TRL {trl.__version__}).",
             f"Model `{a.model}`, {a.prompts} prompts x {a.group} samples = "
             f"{a.prompts * a.group} completions per step of at most {a.completion_len} "
             f"tokens; {a.repeats} run(s) of {a.steps} steps each, alternated A-B-B-A, the "
             f"first step of every run left out; medians over the {ours['steps']} measured "
             f"steps.", "",
             "| | step (s) | generation (s) | generated tokens/s | update (s) | "
             "update tokens/s | completion tokens | mean reward |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in results.items():
        lines.append(f"| {name} | {s['step_s']:.2f} | {s['generate_s']:.2f} | "
                     f"{s['gen_tok_s']:.0f} | {s['update_s']:.2f} | {s['update_tok_s']:.0f} | "
                     f"{s['completion_len']:.1f} | {s['reward']:.3f} |")
    lines += ["", f"AgentGym / TRL (above 1: AgentGym faster): whole step "
              f"{peer['step_s'] / ours['step_s']:.2f}x, generated tokens/s "
              f"{ours['gen_tok_s'] / peer['gen_tok_s']:.2f}x, update tokens/s "
              f"{ours['update_tok_s'] / peer['update_tok_s']:.2f}x.",
              f"AgentGym's update part, median: {ours['fwd_bwd_s']:.2f} s forward/backward/"
              f"optimizer step, {ours['sync_s']:.2f} s weight sync into its rollout engine "
              f"(TRL samples with the training model itself), the rest scoring and collation."]
    body = "\n".join(lines)
    print(body)
    if not a.no_write:
        write_section(f"GRPO training throughput vs TRL ({a.model})", body)


if __name__ == "__main__":
    main()
