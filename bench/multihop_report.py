"""The report of bench/multihop_rl.py, from its work folder: the SFT model and the two RL
arms on the same held-out multi-hop questions (each eval's ``episodes``, written by
``agentgym eval``), paired question by question, and the arms' training signals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from agentgym.reporting.evaluation import episode_stats
from agentgym.reporting.stats import mcnemar

#: per-question outcomes the paired tests compare: (label, outcome of an episode)
PAIRED = [("EM", lambda e: float(e["em"]) >= 1.0),
          ("2+ searches", lambda e: e["tool_calls"] >= 2),
          ("second hop", lambda e: bool(e.get("second_hop", 0)))]
#: training signals per arm: (metrics.jsonl key, column)
SIGNALS = [("rollout/reward", "reward"), ("rollout/em", "EM"),
           ("rollout/tool_calls", "searches per episode"),
           ("rollout/gold_retrieved", "gold paragraphs found"),
           ("rollout/second_hop", "second hop"), ("rollout/signal_groups", "groups with signal")]


def on_common_questions(evals: dict[str, dict]) -> dict[str, dict]:
    """Every eval restricted to the questions all of them played (an earlier SFT eval may
    cover more rows than the arms' ``--eval-limit``): the paired tests and the tables then
    compare the same questions. ``n`` is the count kept."""
    uids = set.intersection(*({e["uid"] for e in ev["episodes"]} for ev in evals.values()))
    kept = {}
    for name, ev in evals.items():
        episodes = [e for e in ev["episodes"] if e["uid"] in uids]
        kept[name] = {**ev, "episodes": episodes, "n": len(episodes)}
    return kept


def _cell(value: float, ci, digits: int = 3) -> str:
    return f"{value:.{digits}f} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def paired(before: dict, after: dict, pick):
    """The exact McNemar test of ``pick(episode)`` between two evals, question by question."""
    return mcnemar({e["uid"]: bool(pick(e)) for e in before["episodes"]},
                   {e["uid"]: bool(pick(e)) for e in after["episodes"]})


def _test(p) -> str:
    return f"{p.gained} / {p.lost}, p = {p.p_value:.3g}"


def models_table(evals: dict[str, dict], trained: dict[str, dict]) -> list[str]:
    """One row per model: EM, searches per episode, 2+ searches, the second hop (95%
    intervals), and each arm's paired tests against the SFT model."""
    lines = ["| model | GRPO steps | EM | searches per episode | 2+ searches | second search "
             "brought the second gold paragraph | EM vs SFT | 2+ searches vs SFT | second "
             "hop vs SFT |", "|---|---|---|---|---|---|---|---|---|"]
    for name, ev in evals.items():
        s = episode_stats(ev["episodes"])
        hop = _cell(s["second_hop"], s["second_hop_ci95"]) if "second_hop" in s else "–"
        tests = ["", "", ""] if name == "sft" else \
            [_test(paired(evals["sft"], ev, pick)) for _, pick in PAIRED]
        steps = "0" if name == "sft" else str(trained[name]["step"])
        lines.append(f"| {name} | {steps} | {_cell(s['em'], s['em_ci95'])} | "
                     f"{_cell(s['tool_calls'], s['tool_calls_ci95'], 2)} | "
                     f"{_cell(s['tool_calls_2plus'], s['tool_calls_2plus_ci95'])} | {hop} | "
                     + " | ".join(tests) + " |")
    return lines


def arms_table(evals: dict[str, dict]) -> list[str]:
    """The arms side by side, with the paired test of each later arm against the first."""
    arms = [name for name in evals if name != "sft"]
    first, later = arms[0], arms[1:]
    lines = [f"| metric | {' | '.join(arms)} | " +
             " | ".join(f"{x} vs {first}: gained / lost, p" for x in later) + " |",
             "|---|" + "---|" * (len(arms) + len(later))]
    for label, pick in PAIRED:
        tests = [paired(evals[first], evals[x], pick) for x in later]
        shares = [sum(bool(pick(e)) for e in evals[x]["episodes"]) /
                  max(len(evals[x]["episodes"]), 1) for x in arms]
        lines.append(f"| {label} | " + " | ".join(f"{v:.3f}" for v in shares) + " | " +
                     " | ".join(_test(p) for p in tests) + " |")
    stats = [episode_stats(evals[x]["episodes"]) for x in arms]
    lines.append("| searches per episode | " + " | ".join(
        _cell(s["tool_calls"], s["tool_calls_ci95"], 2) for s in stats) + " |" +
        " |" * len(later))
    return lines


def type_table(evals: dict[str, dict]) -> list[str]:
    """Bridge and comparison questions apart (``extra_info.type``), every model."""
    lines = ["| type | model | questions | EM | searches per episode | 2+ searches | "
             "second hop |", "|---|---|---|---|---|---|---|"]
    kinds = sorted({e.get("type", "untyped") for ev in evals.values() for e in ev["episodes"]})
    for kind in kinds:
        for name, ev in evals.items():
            s = episode_stats([e for e in ev["episodes"] if e.get("type", "untyped") == kind])
            hop = _cell(s["second_hop"], s["second_hop_ci95"]) if "second_hop" in s else "–"
            lines.append(f"| {kind} | {name} | {s['n']} | {_cell(s['em'], s['em_ci95'])} | "
                         f"{_cell(s['tool_calls'], s['tool_calls_ci95'], 2)} | "
                         f"{_cell(s['tool_calls_2plus'], s['tool_calls_2plus_ci95'])} | {hop} |")
    return lines


def _halves(steps: list[dict], key: str) -> str:
    half = max(1, len(steps) // 2)
    parts = [[m[key] for m in chunk if key in m] for chunk in (steps[:half], steps[half:])]
    return " → ".join(f"{sum(p) / len(p):.3f}" if p else "–" for p in parts)


def signals_table(work: Path, trained: dict[str, dict]) -> list[str]:
    """Each arm's training signals (first half of its steps → second half), its minutes and
    where the curriculum was."""
    lines = ["| arm | steps | minutes | " + " | ".join(c for _, c in SIGNALS) +
             " | curriculum level (last; first step at the multi-hop level) |",
             "|---|---|---|" + "---|" * len(SIGNALS) + "---|"]
    for arm, record in trained.items():
        path = work / arm / "metrics.jsonl"
        metrics = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] \
            if path.exists() else []
        steps = [m for m in metrics if "rollout/reward" in m and m["step"] <= record["step"]]
        levels = [(m["step"], m["curriculum/level"]) for m in steps if "curriculum/level" in m]
        multi = next((s for s, lv in levels if lv >= 4), None)
        where = (f"{levels[-1][1]:g}; {'never' if multi is None else f'step {multi}'}"
                 if levels else "–")
        stopped = " (budget)" if record.get("stopped") else ""
        lines.append(f"| {arm} | {record['step']}{stopped} | {record['minutes']:.0f} | " +
                     " | ".join(_halves(steps, k) for k, _ in SIGNALS) + f" | {where} |")
    return lines


def report(a, work: Path, evals: dict[str, dict], trained: dict[str, dict],
           arms: dict[str, list[str]]) -> str:
    """The section's text (:mod:`bench.multihop_rl`'s stages and their figures); ``arms``:
    each arm's overrides."""
    from bench.report import machine
    sft = json.loads((work / "sft.json").read_text())
    n = evals["sft"]["n"]
    command = " ".join(["python bench/multihop_rl.py", *sys.argv[1:]])
    body = [
        f"Machine: {machine()}. Command: `{command}`. {a.model}: SFT ({sft['steps']} step"
        f"{'s' if sft['steps'] != 1 else ''}, "
        f"lr {a.sft_lr}) on {sft['demos']} demonstrations from the first {a.demo_rows} rows "
        f"of `{a.demo_data}` ({sft['two_search_demos']} of them search twice), then "
        f"{len(trained)} GRPO arm{'s' if len(trained) != 1 else ''} from it on `{a.data}` "
        f"with `data.curriculum=solve_rate` ({a.prompts} prompts x {a.n} samples a step, "
        f"F1 reward, lr 2e-5): " + ", ".join(f"`{arm}` (`{' '.join(arms[arm])}`)"
                                             for arm in trained) +
        ", each after the first for as many steps as the first reached. Every model "
        f"played greedily on the same first {n} questions of `{a.eval_data}` "
        f"(`rollout.max_response_tokens={a.max_response_tokens}`); intervals 95% (Wilson; "
        f"bootstrap for searches per episode); p: exact McNemar on the questions where the "
        f"two models differ. Second hop: the episode's second search brought the gold "
        f"paragraph the first had not (so both were retrieved).", "",
        *models_table(evals, trained), "", "The arms:", "", *arms_table(evals), "",
        "By question type (HotpotQA's bridge and comparison):", "", *type_table(evals), "",
        "Training (means over the first half of each arm's steps → the second half):", "",
        *signals_table(work, trained)]
    return "\n".join(body)
