"""Multi-hop RL (issue 47): does RL teach smollm2-135m a second search?

    mkdir -p runs && nohup python bench/multihop_rl.py --budget-minutes 115 \
        > runs/multihop_rl.out 2>&1 &
    tail -f runs/multihop_rl/progress.log                  # where it is, stage by stage

About 2 hours on a 2-core CPU (AMD EPYC, native bf16): the budget covers every stage, and
RL gets what the cold start and the three evals leave, half to each arm. A
killed or finished run, started again with the same command, skips every stage whose
output exists (the demonstrations, the SFT model, finished evals, finished arms; an arm
killed mid-way resumes from its last checkpoint) and rewrites the report.
``--smoke`` runs every stage with the tiny model, 1 GRPO step and 4 held-out questions in
about two minutes, writing its report under ``runs/multihop_rl_smoke`` (not docs/).

Stages, each an ``agentgym`` command in its own process (its output in ``WORK/logs/``):

1. ``agentgym demos`` on the first ``--demo-rows`` rows of ``--demo-data``
   (``multihop_curriculum``: NQ and multi-hop rows alternate, so the demonstrations search
   once and twice; :mod:`agentgym.envs.multihop_demos`), kept when they fit the budgets
   (``rollout.max_response_tokens=1536``: two observations of three passages).
2. ``agentgym sft`` of smollm2-135m on them: the SFT model every arm starts from.
3. ``agentgym eval`` of the SFT model, greedy, on the first ``--eval-limit`` (500) rows of
   ``multihop_test``: the "before" of every arm. Its wall time per question sets what the
   arms' evals are reserved (``--arm-minutes M`` gives each arm M minutes instead). A
   later invocation may evaluate the arms on fewer questions (a lower ``--eval-limit``):
   the report then compares every model on the questions all of them played.
4. Arm ``curriculum``: GRPO from the SFT model (``trainer.cold_start=PATH``) on ``--data``
   (``multihop_curriculum``: NQ levels 1-3, then the multi-hop level 4) with
   ``data.curriculum=solve_rate``, for half the time left (``trainer.save_every`` steps
   between checkpoints; stopped by SIGTERM when its time is spent; its last checkpoint is
   the result), then arm ``turn``: the same, with ``algo.advantage=mt_grpo
   search.hop_reward=0.25`` (turn-level credit: a search's turn earns 0.25 per gold
   paragraph it brings first), for as many steps as ``curriculum`` reached, so the
   arms compare step for step; then arm ``second``: as ``turn`` with
   ``search.hop_reward_from=2`` (only a paragraph a later search brings pays: the second
   hop). All: issue 34's recipe (F1 reward, lr 2e-5). ``--arms`` picks some of them.
5. ``agentgym eval`` of each arm's last checkpoint on the same questions.
6. The report (a docs/BENCHMARKS.md section, ``--doc``): EM, searches per episode, the
   share with 2+ searches and the share whose second search brought the second gold
   paragraph (:mod:`agentgym.reporting.evaluation`), each with its 95% interval, the
   paired exact McNemar test of each arm against the SFT model and of the arms against
   each other, the bridge / comparison table, and each arm's training signals (reward,
   searches, gold paragraphs found, the curriculum's level).

Caveat, measured by issue 34 and visible in the report's curriculum line: the solve-rate
curriculum leaves a level only when its recent solve rate is above the band's top (0.8),
and in 17 steps the SFT model never left NQ's first level; in this budget both arms may
train on one-hop rows only, where the hop reward never pays. ``--data multihop`` trains
both arms on the multi-hop rows alone (one level).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.multihop_report import on_common_questions, report  # noqa: E402
from bench.report import write_section  # noqa: E402
from bench.stages import last_checkpoint, stop  # noqa: E402

log = logging.getLogger("multihop_rl")
RECIPE = ["data.curriculum=solve_rate", "trainer.lr=2e-5", "search.reward=f1",
          "trainer.eval_limit=0", "trainer.log_samples=1"]
ARMS = {"curriculum": ["algo.advantage=grpo"],
        "turn": ["algo.advantage=mt_grpo", "search.hop_reward=0.25"],
        "second": ["algo.advantage=mt_grpo", "search.hop_reward=0.25",
                   "search.hop_reward_from=2"]}
#: the smoke's settings: every stage, the tiny model, seconds each
SMOKE = {"model": "tiny", "demo_rows": 8, "sft_epochs": 1, "sft_batch": 4, "steps": 1,
         "prompts": 2, "n": 2, "eval_limit": 4, "tokens_per_turn": 24,
         "demo_tokens_per_turn": 320, "max_response_tokens": 3072, "min_train_minutes": 0.0,
         "budget_minutes": 30.0, "work": "runs/multihop_rl_smoke"}
MAX_PROMPT_TOKENS = 1024  # rollout.max_prompt_tokens's default


class Budget:
    """The invocation's wall-clock budget (:meth:`left`: seconds left of it)."""

    def __init__(self, minutes: float) -> None:
        self.t0, self.seconds = time.monotonic(), minutes * 60

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.t0)


def train_share(left_s: float, eval_s: float, evals_left: int, arms_left: int,
                margin_s: float = 120.0) -> float:
    """Seconds the next arm may train: the time left, less ``evals_left`` evals of
    ``eval_s`` each (with a quarter more: a trained model may search more) and a margin,
    shared among the ``arms_left`` arms still to train."""
    if arms_left < 1:
        raise ValueError(f"arms_left must be >= 1, got {arms_left}")
    return (left_s - evals_left * eval_s * 1.25 - margin_s) / arms_left


def run_stage(name: str, argv: list[str], work: Path, seconds: float | None = None) -> bool:
    """``agentgym ARGV`` in its own process group, its output in ``WORK/logs/NAME.log``;
    with ``seconds``, stopped (SIGTERM to the group, so the retriever it started goes too)
    when they are spent. True if it was stopped; a failure raises SystemExit naming the
    log."""
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    out = logs / f"{name}.log"
    cmd = [sys.executable, "-m", "agentgym.cli", *argv]
    log.info("%s: agentgym %s%s (log: %s)", name, " ".join(argv),
             "" if seconds is None else f" [at most {seconds / 60:.1f} min]", out)
    t0 = time.monotonic()
    with open(out, "a") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)
        try:
            proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            log.info("%s: its %.1f minutes are spent; stopping it", name, seconds / 60)
            stop(proc)
            return True
        except BaseException:  # Ctrl-C, or SIGTERM to this script (main): the stage too
            stop(proc)
            raise
    if proc.returncode:
        raise SystemExit(f"{name} failed (exit code {proc.returncode}); see {out}")
    log.info("%s: done in %.1f min", name, (time.monotonic() - t0) / 60)
    return False


def budgets(a, per_turn: int = 0) -> list[str]:
    """The rollout and precision keys every stage shares (``per_turn``: another
    ``rollout.max_tokens_per_turn``)."""
    return [f"rollout.max_response_tokens={a.max_response_tokens}",
            f"rollout.max_tokens_per_turn={per_turn or a.tokens_per_turn}",
            "engine.dtype=bfloat16"]


def cold_start(a, work: Path) -> str:
    """Stages 1-2: the SFT model's folder (built, or found from an earlier invocation)."""
    record = work / "sft.json"
    if record.exists():
        model = json.loads(record.read_text())["model"]
        log.info("sft: done (%s)", model)
        return model
    demos = work / "demos.jsonl"
    if not demos.exists():
        tmp = work / "demos.tmp.jsonl"
        run_stage("demos", ["demos", "env=search", f"model={a.model}", f"data={a.demo_data}",
                            f"limit={a.demo_rows}", f"out={tmp}",
                            *budgets(a, a.demo_tokens_per_turn)], work)
        tmp.replace(demos)
    n = sum(1 for line in demos.read_text().splitlines() if line.strip())
    two = sum(json.loads(line).get("builder", "").startswith("search-multihop")
              for line in demos.read_text().splitlines() if line.strip())
    if not n:
        raise SystemExit(f"no demonstration fits the budgets ({demos}); raise --demo-rows "
                         f"or rollout.max_response_tokens")
    run_stage("sft", ["sft", "env=search", f"model={a.model}", f"data={demos}",
                      f"run_dir={work / 'sft'}", f"sft.epochs={a.sft_epochs}",
                      f"sft.batch_size={a.sft_batch}", f"trainer.lr={a.sft_lr}",
                      f"sft.max_length={MAX_PROMPT_TOKENS + a.max_response_tokens}",
                      "trainer.mixed_precision=bf16", "trainer.save_every=100000"], work)
    step, model = last_checkpoint(work / "sft")
    record.write_text(json.dumps({"model": str(model), "steps": step, "demos": n,
                                  "two_search_demos": two}) + "\n")
    return str(model)


def evaluate(a, work: Path, name: str, model: str) -> dict:
    """An eval on the held-out rows, kept in ``WORK/eval_NAME.json`` (reused when there)."""
    out = work / f"eval_{name}.json"
    if out.exists():
        log.info("eval %s: done (%s)", name, out)
    else:
        run_stage(f"eval_{name}", ["eval", "env=search", f"model={model}",
                                   f"data={a.eval_data}", f"limit={a.eval_limit}",
                                   f"out={out}", *budgets(a)], work)
    return json.loads(out.read_text())


def train_arm(a, work: Path, arm: str, sft: str, steps: int, seconds: float) -> dict:
    """Stage 4 for one arm: ``{"step", "stopped", "minutes"}`` (kept in
    ``WORK/ARM/done.json``; an arm killed before it was written resumes from its last
    checkpoint)."""
    run = work / arm
    done = run / "done.json"
    if done.exists():
        log.info("arm %s: done (%s)", arm, done.read_text().strip())
        return json.loads(done.read_text())
    if seconds < a.min_train_minutes * 60:
        raise SystemExit(f"arm {arm}: the budget leaves {seconds / 60:.1f} min to train "
                         f"(--min-train-minutes {a.min_train_minutes}); raise "
                         f"--budget-minutes (now {a.budget_minutes}) or lower --eval-limit "
                         f"(now {a.eval_limit})")
    t0 = time.monotonic()
    stopped = run_stage(f"train_{arm}", [
        "train", "env=search", f"model={a.model}", f"trainer.cold_start={sft}",
        f"run_dir={run}", f"data={a.data}", f"trainer.total_steps={steps}",
        f"trainer.save_every={a.save_every}", f"trainer.prompts_per_step={a.prompts}",
        f"rollout.n={a.n}", *RECIPE, *ARMS[arm], *budgets(a),
        "trainer.mixed_precision=bf16", *a.overrides], work, seconds)
    step, _ = last_checkpoint(run)
    record = {"step": step, "stopped": stopped, "minutes": (time.monotonic() - t0) / 60}
    done.write_text(json.dumps(record) + "\n")
    return record


def run(a) -> None:
    """Every stage not done yet, within ``--budget-minutes``; then the report."""
    work = Path(a.work)
    budget = Budget(a.budget_minutes)
    sft = cold_start(a, work)
    before = evaluate(a, work, "sft", sft)
    # an arm's eval: the SFT eval's rollouts per question times the arm's questions, and
    # the model's load (the SFT eval may cover more questions than --eval-limit)
    eval_s = before["seconds"] * min(1.0, a.eval_limit / max(before["n"], 1)) + 60
    arms_left = [arm for arm in a.arms if not (work / arm / "done.json").exists()]
    trained: dict[str, dict] = {}
    steps = a.steps
    for arm in a.arms:
        evals_left = sum(not (work / f"eval_{x}.json").exists() for x in a.arms)
        share = a.arm_minutes * 60 or train_share(budget.left(), eval_s, evals_left,
                                                  max(len(arms_left), 1))
        trained[arm] = train_arm(a, work, arm, sft, steps, share)
        if arm in arms_left:
            arms_left.remove(arm)
        steps = trained[arm]["step"]  # the next arm: as many steps as this one reached
    evals = {"sft": before}
    for arm in a.arms:
        evals[arm] = evaluate(a, work, arm, str(last_checkpoint(work / arm)[1]))
    log.info("all stages done; %.1f of %.0f minutes left", budget.left() / 60,
             a.budget_minutes)
    evals = on_common_questions(evals)
    text = report(a, work, evals, trained, ARMS)
    write_section(f"Multi-hop RL: a second search ({a.model})", text, Path(a.doc))
    log.info("wrote the section to %s", a.doc)


def _arms(text: str) -> list[str]:
    arms = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in arms if x not in ARMS]
    if bad or not arms or len(set(arms)) != len(arms):
        raise argparse.ArgumentTypeError(f"--arms {text!r}: name each arm once, from "
                                         f"{', '.join(ARMS)}")
    return arms


def parse(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-minutes", type=float, default=115.0,
                    help="wall clock for every stage of this invocation")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 1 step, 4 questions")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--demo-data", default="multihop_curriculum")
    ap.add_argument("--demo-rows", type=int, default=192,
                    help="rows the demonstrations are built from (about half give one)")
    ap.add_argument("--sft-epochs", type=int, default=2)
    ap.add_argument("--sft-batch", type=int, default=8)
    ap.add_argument("--sft-lr", default="1e-4")
    ap.add_argument("--data", default="multihop_curriculum", help="the arms' training data")
    ap.add_argument("--steps", type=int, default=200,
                    help="the first arm's steps at most (the budget usually stops it first)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--eval-data", default="multihop_test")
    ap.add_argument("--eval-limit", type=int, default=500)
    ap.add_argument("--max-response-tokens", type=int, default=1536)
    ap.add_argument("--tokens-per-turn", type=int, default=160,
                    help="rollout.max_tokens_per_turn (the longest demonstration action: 149)")
    ap.add_argument("--demo-tokens-per-turn", type=int, default=0,
                    help="the demonstrations' (default: --tokens-per-turn)")
    ap.add_argument("--min-train-minutes", type=float, default=5.0)
    ap.add_argument("--arm-minutes", type=float, default=0.0,
                    help="each arm's training minutes (default 0: what the budget leaves "
                    "after the evals, shared between the arms)")
    ap.add_argument("--arms", default=",".join(ARMS), type=_arms,
                    help=f"the arms, in order (the first sets the others' steps): some of "
                    f"{', '.join(ARMS)}")
    ap.add_argument("--work", default="runs/multihop_rl")
    ap.add_argument("--doc", default="", help="the page the section goes to (default: "
                    "docs/BENCHMARKS.md; --smoke: WORK/BENCHMARKS.md)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for both arms' training")
    a = ap.parse_args(argv)
    if a.smoke:  # the smoke's settings, where the command line kept the defaults
        for key, value in SMOKE.items():
            if getattr(a, key) == ap.get_default(key):
                setattr(a, key, value)
    a.doc = a.doc or str(Path(a.work) / "BENCHMARKS.md" if a.smoke else ROOT / "docs" /
                         "BENCHMARKS.md")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    os.chdir(ROOT)  # the stages' paths are relative to the repository root
    Path(a.work).mkdir(parents=True, exist_ok=True)
    # SIGTERM ends this script as Ctrl-C does: the running stage is stopped with it
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                        handlers=[logging.StreamHandler(sys.stdout),
                                  logging.FileHandler(Path(a.work) / "progress.log")])
    log.info("bench/multihop_rl.py %s (budget %.0f min, work %s)", " ".join(
        sys.argv[1:] if argv is None else argv), a.budget_minutes, a.work)
    run(a)


if __name__ == "__main__":
    main()
