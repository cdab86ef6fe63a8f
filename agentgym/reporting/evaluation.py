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

Tool use, beside EM (:func:`episode_stats`): tool calls per episode (the env's
``tool_calls_label``: searches for env=search) with a bootstrap interval, the share of
episodes with two or more (Wilson); on multi-hop rows (``extra_info.gold_paragraphs``) the
share whose second search brought the second gold paragraph (the env's ``second_hop``,
:mod:`agentgym.envs.search`), over those rows only; and, when the rows name a type
(``extra_info.type``: HotpotQA's bridge / comparison), the same figures type by type
(``by_type``). Each episode's values are under ``episodes`` (with its ``type``), so two
results pair question by question (``agentgym compare``, bench/multihop_rl.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentgym.rollout.manager import episode_metric_keys, last_parts, row_uid, summarize
from agentgym.reporting.stats import bootstrap_ci95, mcnemar, pass_at_k, wilson_ci95
from agentgym import envs
from agentgym.core.registry import env_names
from agentgym.envs.rewards import normalize_answer


def ks_reported(n: int) -> list[int]:
    """The j of pass@j reported for ``n`` samples: powers of two below ``n``, then ``n``."""
    out, j = [], 1
    while j < n:
        out.append(j)
        j *= 2
    return out + [n]


def majority_correct(samples: list) -> bool:
    """maj@k of one question's samples (see the module docstring)."""
    votes: dict[str, list] = {}
    for t in samples:
        if "answer" in t.info and t.terminated:
            votes.setdefault(normalize_answer(str(t.info["answer"])), []).append(t)
    if not votes:
        return False
    best = max(votes.values(), key=len)  # max keeps the first of equals: the first seen
    return bool(float(best[0].info.get("em", 0.0)) >= 1.0)


def episode_stats(episodes: list[dict]) -> dict[str, Any]:
    """EM, tool calls per episode and the share with two or more, and (over the episodes
    that report it: multi-hop rows) ``second_hop``, each with its 95% interval, from
    ``episodes`` as :func:`eval_result` writes them (any subset: a type, a model's)."""
    n = len(episodes)
    em = sum(float(e["em"]) for e in episodes) / n if n else float("nan")
    calls = [float(e["tool_calls"]) for e in episodes]
    two = sum(c >= 2 for c in calls) / n if n else float("nan")
    out: dict[str, Any] = {
        "n": n, "em": em, "em_ci95": wilson_ci95(em, n),
        "tool_calls": sum(calls) / n if n else float("nan"),
        "tool_calls_ci95": bootstrap_ci95(calls),
        "tool_calls_2plus": two, "tool_calls_2plus_ci95": wilson_ci95(two, n)}
    hop = [float(e["second_hop"]) for e in episodes if "second_hop" in e]
    if hop:
        out["second_hop"] = sum(hop) / len(hop)
        out["second_hop_ci95"] = wilson_ci95(out["second_hop"], len(hop))
        out["second_hop_n"] = len(hop)
    return out


def tool_calls_label(env: str) -> str:
    """What ``env``'s tool calls are called in reports (``EnvManifest.tool_calls_label``; a
    mixed run's when its envs agree, else "tool calls")."""
    labels = {envs.env_manifest(e).tool_calls_label for e in env_names(env)}
    return labels.pop() if len(labels) == 1 else "tool calls"


def _episode(t) -> dict[str, Any]:
    return {"uid": t.uid, "sample_index": t.sample_index, "em": float(t.info.get("em", 0.0)),
            "f1": float(t.info.get("f1", 0.0)), "reward": t.reward,
            "answer": str(t.info.get("answer", "")),
            # an env that defines its own (env=swe: a command, then a diff that applies)
            # reports it; else: ended on its own with no malformed action
            "format_valid": bool(t.info["format_valid"]) if "format_valid" in t.info else
            bool(t.terminated and t.metrics["malformed_actions"] == 0),
            "tool_calls": int(t.metrics.get("tool_calls", 0)),
            **{k: t.info[k] for k in t.info.get("episode_metrics", ()) if k in t.info}}


def eval_result(cfg, trajs: list, elapsed: float, k: int = 1,
                rows: list[dict] | None = None) -> dict[str, Any]:
    """The result dict ``agentgym eval`` prints and writes (``out=``): one entry per
    episode (its last trajectory, when it became several). ``rows``: the rows played (in
    order), whose ``extra_info.type`` marks each episode's type."""
    types = {row_uid(r, i): str((r.get("extra_info") or {}).get("type"))
             for i, r in enumerate(rows or ()) if (r.get("extra_info") or {}).get("type")}
    trajs = last_parts(trajs)
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
        "episodes": [{**_episode(t), **({"type": types[t.uid]} if t.uid in types else {})}
                     for t in trajs]}
    result["episode_metrics"] = episode_metric_keys(trajs)
    result.update({key: s[key] for key in result["episode_metrics"]})
    result["tool_calls_label"] = tool_calls_label(cfg.env)
    stats = episode_stats(result["episodes"])
    result.update({"mean_tool_calls_ci95": stats["tool_calls_ci95"],
                   **{key: stats[key] for key in stats if key.startswith(
                       ("tool_calls_2plus", "second_hop"))}})  # second_hop: multi-hop rows'
    if types:
        by_type: dict[str, list] = {}
        for e in result["episodes"]:
            by_type.setdefault(e.get("type", "untyped"), []).append(e)
        result["by_type"] = {name: episode_stats(eps) for name, eps in sorted(by_type.items())}
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
                 f"{result['answered']:.3f}   turns {result['mean_turns']:.2f}" + (
                     "".join(f"   {k} {result[k]:.3f}"
                             for k in result.get("episode_metrics", ()) if k != "second_hop")))
    if "mean_tool_calls_ci95" in result:  # results of earlier versions lack the intervals
        lines += tool_use_lines(result)
    if result.get("by_type"):
        lines += by_type_lines(result)
    if k > 1:
        parts = [f"pass@{j} {result[f'pass@{j}']:.3f} [{result[f'pass@{j}_ci95'][0]:.3f}, "
                 f"{result[f'pass@{j}_ci95'][1]:.3f}]" for j in ks_reported(k)]
        lo, hi = result[f"maj@{k}_ci95"]
        parts.append(f"maj@{k} {result[f'maj@{k}']:.3f} [{lo:.3f}, {hi:.3f}]")
        lines.append("  " + "   ".join(parts) + " (95% CI)")
    return lines


def _cell(value: float, ci: tuple[float, float], digits: int = 3) -> str:
    return f"{value:.{digits}f} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def tool_use_lines(result: dict[str, Any]) -> list[str]:
    """Tool calls per episode, the share with 2+ and (multi-hop rows) the second hop's
    share, each with its 95% interval."""
    label = result.get("tool_calls_label", "tool calls")
    calls = _cell(result["mean_tool_calls"], result["mean_tool_calls_ci95"], 2)
    lines = [f"  {label} per episode {calls}   2+ {label} "
             f"{_cell(result['tool_calls_2plus'], result['tool_calls_2plus_ci95'])} (95% CI)"]
    if "second_hop_n" in result:
        lines.append(f"  second search brought the second gold paragraph "
                     f"{_cell(result['second_hop'], result['second_hop_ci95'])} (95% CI; of "
                     f"{result['second_hop_n']} multi-hop episodes)")
    return lines


def by_type_lines(result: dict[str, Any]) -> list[str]:
    """The per-type table (``extra_info.type``) of a result with ``by_type``."""
    label = result.get("tool_calls_label", "tool calls")
    hop = any("second_hop" in s for s in result["by_type"].values())
    head = (f"  {'type':12s} {'n':>5s} {'EM':>21s} {label + ' per episode':>22s} "
            f"{'2+ ' + label:>21s}" + (f" {'second hop':>21s}" if hop else ""))
    lines = ["  by type (extra_info.type); 95% intervals", head]
    for name, s in result["by_type"].items():
        row = (f"  {name:12s} {s['n']:5d} {_cell(s['em'], s['em_ci95']):>21s} "
               f"{_cell(s['tool_calls'], s['tool_calls_ci95'], 2):>22s} "
               f"{_cell(s['tool_calls_2plus'], s['tool_calls_2plus_ci95']):>21s}")
        if hop:
            cell = _cell(s["second_hop"], s["second_hop_ci95"]) if "second_hop" in s else "–"
            row += f" {cell:>21s}"
        lines.append(row)
    return lines


def write_result(result: dict[str, Any], out: str) -> None:
    """``result`` as JSON at ``out`` (its folder made)."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")


def eval_outcomes(path: Path, metric: str = "em") -> dict[str, bool]:
    """Question uid -> did ``metric`` hold, from an ``agentgym eval ... out=`` result with
    one greedy answer per question (what ``agentgym compare`` pairs). A metric only some
    episodes report (``second_hop``: multi-hop rows) pairs those episodes."""
    result = json.loads(path.read_text())
    if result.get("k", 1) > 1:
        raise ValueError(f"{path} holds k={result['k']} samples per question; compare pairs "
                         f"one greedy answer per question (agentgym eval without k)")
    if "episodes" not in result:
        raise ValueError(f"{path} has no per-question episodes; write it with this version's "
                         f"`agentgym eval ... out={path}`")
    found = {e["uid"]: bool(e[metric]) for e in result["episodes"] if metric in e}
    if not found:
        raise ValueError(f"{path}: no episode reports {metric!r} (second_hop: multi-hop rows, "
                         f"data=multihop_test)")
    return found


def write_outcomes(path: Path, trajs: list) -> None:
    """Each question's greedy outcome (``{uid: {em, format_valid, env}}``), written whole
    (a temporary file renamed into place)."""
    out = {e["uid"]: {"em": e["em"] >= 1.0, "format_valid": e["format_valid"],
                      "env": str(t.info.get("env", ""))}
           for e, t in ((_episode(t), t) for t in trajs)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(out) + "\n")
    tmp.replace(path)


def paired_steps(run_dir: Path, first: int, last: int, key: str = "em",
                 env: str | None = None):
    """The exact McNemar test (:func:`agentgym.reporting.stats.mcnemar`) of ``key`` between
    two evaluated steps of a run, on their shared questions (one env's, with ``env``);
    None when either step's outcomes were not written."""
    files = [Path(run_dir) / "eval" / f"step_{s}.json" for s in (first, last)]
    if not all(f.exists() for f in files):
        return None
    a, b = (json.loads(f.read_text()) for f in files)
    pick = [u for u in a if env is None or a[u].get("env") == env]
    return mcnemar({u: bool(a[u][key]) for u in pick}, {u: bool(b[u][key]) for u in pick})


def comparison_lines(run_dir: Path, scopes: list[tuple[str | None, str, bool]],
                     run_env: str = "") -> list[str]:
    """Held-out format validity and EM (95% Wilson intervals) and tool calls per episode
    (searches, for env=search) of the model before the cold start, after it (RL's step 0)
    and after RL (the last step), when the run evaluated; beside the after-RL row, the
    exact McNemar p-value of its EM against step 0's on the same questions (from each
    question's outcome, ``eval/step_N.json``). ``scopes``: one table per ``(env, held-out
    set, answerable filter applied)``; env None for a single-env run (``run_env``, the
    run's env, names its tool calls), each env's name in a mixed one (its ``<env>/eval/*``
    metrics)."""
    metrics = Path(run_dir) / "metrics.jsonl"
    if not metrics.exists():
        return []
    evals = [r for r in map(json.loads, metrics.read_text().splitlines()) if "eval/count" in r]
    if not evals:
        return []
    record_file = Path(run_dir) / "cold_start" / "cold_start.json"
    record = json.loads(record_file.read_text()) if record_file.exists() else {}
    lines = []
    for env, data, answerable in scopes:
        before = record.get("eval_before") or {}
        before = before.get("envs", {}).get(env) if env else before
        label = tool_calls_label(env or run_env) if env or run_env else "tool calls"
        lines += _comparison_table(run_dir, evals, record, before, env, data, answerable,
                                   label)
    return lines


def _comparison_table(run_dir: Path, evals: list[dict], record: dict, before: dict | None,
                      env: str | None, data: str, answerable: bool,
                      label: str = "tool calls") -> list[str]:
    pre = f"{env}/" if env else ""
    evals = [r for r in evals if f"{pre}eval/count" in r]
    if not evals:
        return []
    start = "after SFT (RL step 0)" if record.get("model") else "start (RL step 0)"
    rows = []  # (model, format-valid, EM, questions, tool calls per episode or None, p)
    if before and record.get("model"):
        rows.append((f"before ({Path(record['base_model']).name})", before["format_valid"],
                     before["em"], before["count"], before.get("tool_calls"), ""))
    first, last = evals[0], evals[-1]
    if first["step"] == 0:
        rows.append((start, first[f"{pre}eval/format_valid"], first[f"{pre}eval/em"],
                     first[f"{pre}eval/count"], first.get(f"{pre}eval/tool_calls"), ""))
    if last["step"] > 0:
        paired = paired_steps(run_dir, 0, last["step"], env=env) if first["step"] == 0 else None
        rows.append((f"after RL (step {last['step']})", last[f"{pre}eval/format_valid"],
                     last[f"{pre}eval/em"], last[f"{pre}eval/count"],
                     last.get(f"{pre}eval/tool_calls"),
                     "" if paired is None else f"{paired.p_value:.3g} "
                     f"(+{paired.gained}/-{paired.lost})"))
    n = int(rows[0][3]) if rows else 0
    which = " whose answer is in the corpus (data.answerable_only)" if answerable else ""
    calls = f"{label}/episode"
    lines = [f"{env + ': ' if env else ''}held-out: {n} questions of {data}{which} (greedy); "
             f"95% intervals; p: exact McNemar of EM against step 0 (questions gained/lost)",
             f"  {'model':28s} {'format-valid':>24s} {'EM':>24s} {calls}   "
             f"{'p (EM vs step 0)'}"]
    for name, fv, em, count, tool_calls, p in rows:
        cells = []
        for x in (fv, em):
            lo, hi = wilson_ci95(x, int(count))
            cells.append(f"{x:.3f} [{lo:.3f}, {hi:.3f}]")
        used = "–" if tool_calls is None else f"{tool_calls:.2f}"
        lines.append(f"  {name:28s} {cells[0]:>24s} {cells[1]:>24s} {used:>{len(calls)}s}   "
                     f"{p}".rstrip())
    return lines
