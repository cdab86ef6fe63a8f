"""``agentgym eval``'s result: EM and its interval, and with ``k=N`` pass@k and maj@k.

With ``k=1`` (the default) every question is played once, greedily, and the result is the
EM with its Wilson interval, as before. With ``k=N`` every question is sampled N times
(at ``rollout.temperature``, 1.0 unless set) and the result adds, per question and overall:

- pass@j for j = 1, 2, 4, … and N: the unbiased estimator of Chen et al. (2021) from the
  question's N samples (:func:`agentgym.reporting.stats.pass_at_k`); pass@1 is the mean EM of the
  samples, which is also what ``em`` is then;
- maj@N: the answer given by most of the N samples (normalised: lower case, no articles or
  punctuation; ties go to the answer seen first; samples without an answer do not vote)
  is graded by the EM of a sample that gave it.

Intervals are 95%: Wilson for the proportion of questions (EM at k=1, maj@N), a
percentile bootstrap over questions (fixed seed) for the pass@j means. Every question's
samples are written under ``questions`` for paired comparisons.
"""

from __future__ import annotations

from typing import Any

from agentgym.rollout.manager import summarize
from agentgym.reporting.stats import bootstrap_ci95, pass_at_k, wilson_ci95


def ks_reported(n: int) -> list[int]:
    """The j of pass@j reported for ``n`` samples: powers of two below ``n``, then ``n``."""
    out, j = [], 1
    while j < n:
        out.append(j)
        j *= 2
    return out + [n]


def majority_correct(samples: list) -> bool:
    """maj@k of one question's samples (see the module docstring)."""
    from envs.rewards import normalize_answer
    votes: dict[str, list] = {}
    for t in samples:
        if "answer" in t.info and t.terminated:
            votes.setdefault(normalize_answer(str(t.info["answer"])), []).append(t)
    if not votes:
        return False
    best = max(votes.values(), key=len)  # max keeps the first of equals: the first seen
    return bool(float(best[0].info.get("em", 0.0)) >= 1.0)


def _episode(t) -> dict[str, Any]:
    return {"uid": t.uid, "sample_index": t.sample_index, "em": float(t.info.get("em", 0.0)),
            "f1": float(t.info.get("f1", 0.0)), "reward": t.reward,
            "answer": str(t.info.get("answer", "")),
            "format_valid": bool(t.terminated and t.metrics["malformed_actions"] == 0),
            **({"answer_seen": bool(t.info["answer_seen"])} if "answer_seen" in t.info else {})}


def eval_result(cfg, trajs: list, elapsed: float, k: int = 1) -> dict[str, Any]:
    """The result dict ``agentgym eval`` prints and writes (``out=``)."""
    s = summarize(trajs)
    n = len(trajs)
    result: dict[str, Any] = {
        "env": cfg.env, "model": cfg.model.path or cfg.model.name, "data": cfg.data.name,
        "n": n, "k": k, "em": s["em"], "em_ci95": wilson_ci95(s["em"], n), "f1": s["f1"],
        "format_valid": s["format_valid"], "answered": s["answered"],
        "mean_turns": s["turns"], "mean_tool_calls": s["tool_calls"],
        "tool_failures": s["tool_failures"], "response_length": s["response_length"],
        "seconds": elapsed, "temperature": cfg.rollout.temperature,
        # per episode (k=1: per question), for paired comparisons (agentgym.reporting.stats.mcnemar)
        "episodes": [_episode(t) for t in trajs]}
    if "answer_seen" in s:
        result["answer_seen"] = s["answer_seen"]
    if k > 1:
        groups: dict[str, list] = {}
        for t in trajs:
            groups.setdefault(t.uid, []).append(t)
        questions = []
        for uid, samples in groups.items():
            c = sum(float(t.info.get("em", 0.0)) >= 1.0 for t in samples)
            questions.append({"uid": uid, "samples": len(samples), "correct": c,
                              **{f"pass@{j}": pass_at_k(len(samples), c, j)
                                 for j in ks_reported(k) if j <= len(samples)},
                              f"maj@{k}": majority_correct(samples)})
        q = len(questions)
        result["questions"] = questions
        result["n_questions"] = q
        # em at k > 1 is the mean over samples: pass@1's estimate over every sample
        result["em_ci95"] = bootstrap_ci95([x["pass@1"] for x in questions])
        for j in ks_reported(k):
            vals = [x[f"pass@{j}"] for x in questions if f"pass@{j}" in x]
            result[f"pass@{j}"] = sum(vals) / len(vals) if vals else float("nan")
            result[f"pass@{j}_ci95"] = bootstrap_ci95(vals)
        maj = sum(x[f"maj@{k}"] for x in questions) / max(q, 1)
        result[f"maj@{k}"] = maj
        result[f"maj@{k}_ci95"] = wilson_ci95(maj, q)
    return result


def summary_lines(result: dict[str, Any]) -> list[str]:
    """What the CLI prints for ``result``."""
    k = result.get("k", 1)
    what = (f"{result['n']} questions" if k == 1 else
            f"{result['n_questions']} questions x {k} samples "
            f"(temperature {result['temperature']:g})")
    lines = [f"{result['env']} / {result['model']} / {result['data']}: {what} in "
             f"{result['seconds']:.0f}s"]
    lo, hi = result["em_ci95"]
    lines.append(f"  EM {result['em']:.3f} [{lo:.3f}, {hi:.3f}] (95% CI)   F1 {result['f1']:.3f}"
                 f"   format-valid {result['format_valid']:.3f}   answered "
                 f"{result['answered']:.3f}   turns {result['mean_turns']:.2f}   tool calls "
                 f"{result['mean_tool_calls']:.2f}" + (
                     f"   answer in results {result['answer_seen']:.3f}"
                     if "answer_seen" in result else ""))
    if k > 1:
        parts = [f"pass@{j} {result[f'pass@{j}']:.3f} [{result[f'pass@{j}_ci95'][0]:.3f}, "
                 f"{result[f'pass@{j}_ci95'][1]:.3f}]" for j in ks_reported(k)]
        lo, hi = result[f"maj@{k}_ci95"]
        parts.append(f"maj@{k} {result[f'maj@{k}']:.3f} [{lo:.3f}, {hi:.3f}]")
        lines.append("  " + "   ".join(parts) + " (95% CI)")
    return lines
