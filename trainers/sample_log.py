"""Samples per step: a few of each step's trajectories, written whole for a person to read.

``trainer.log_samples=N`` picks N trajectories of the step spread evenly over its rewards
(N=3: the worst, the median and the best; ties go to the earlier trajectory) and writes
them to ``run_dir/samples/step_<step>.jsonl``, one JSON object a line, with everything a
debugging session needs token by token: ids, each token's decoded text, the loss mask, the
engine's and the trainer's logprobs of the sampled tokens, the advantages, the rewards and
the segments (prompt / generated / observation, with their turn). ``agentgym inspect``
turns these files into one HTML page (:mod:`agentgym.reporting.inspector`).

The trainer's logprobs are the ones the update starts from (``old_logp``); where the update
computes them itself (:func:`agentgym.trainers.phases.reuses_update_logprobs`) they are
computed here, for the chosen rows only, before the update changes the weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from agentgym.core.types import Trajectory
from agentgym.trainers.batch import Batch, collate


def pick(rewards: list[float], n: int) -> list[tuple[int, str]]:
    """``n`` indices spread evenly over the rewards' order, each with its rank's name
    (``worst``, ``median``, ``best``, else ``q<percent>``); fewer when there are fewer rows."""
    if n <= 0 or not rewards:
        return []
    order = sorted(range(len(rewards)), key=lambda i: (rewards[i], i))
    if n == 1:
        return [(order[(len(order) - 1) // 2], "median")]
    out: list[tuple[int, str]] = []
    for j in range(n):
        pos = round(j * (len(order) - 1) / (n - 1))
        if any(order[pos] == i for i, _ in out):
            continue
        frac = pos / (len(order) - 1) if len(order) > 1 else 0.0
        name = ("worst" if j == 0 else "best" if j == n - 1
                else "median" if 2 * j == n - 1 else f"q{round(100 * frac)}")
        out.append((order[pos], name))
    return out


def _round(xs, digits: int = 4) -> list[float]:
    return [round(float(x), digits) for x in xs]


def _json_safe(d: dict) -> dict:
    return json.loads(json.dumps(d, default=str))


def record(step: int, traj: Trajectory, rank: str, tokenizer, trainer_logp: list[float],
           adv: list[float]) -> dict[str, Any]:
    """One sample's line: the trajectory, token by token, with the trainer's view of it."""
    n = len(traj.token_ids)
    tokens = [tokenizer.decode([i], skip_special_tokens=False) for i in traj.token_ids]
    mask = list(traj.loss_mask)
    segments = [{"kind": s.kind, "start": s.start, "end": s.end, "turn": s.turn,
                 "text": "".join(tokens[s.start:s.end])} for s in traj.segments]
    sampled_adv = [a for a, m in zip(adv, mask) if m]
    return {
        "step": step, "rank": rank, "env": str(traj.info.get("env", "")) or traj.data_source,
        "uid": traj.uid, "sample_index": traj.sample_index, "reward": traj.reward,
        "step_rewards": list(traj.step_rewards),
        "advantage": round(sum(sampled_adv) / len(sampled_adv), 4) if sampled_adv else 0.0,
        "em": float(traj.info.get("em", 0.0)), "terminated": traj.terminated,
        "truncated": traj.truncated, "policy_version": traj.policy_version,
        "metrics": dict(traj.metrics), "info": _json_safe(
            {k: v for k, v in traj.info.items() if k not in ("ground_truth",)}),
        "prompt_length": traj.prompt_length, "token_ids": list(traj.token_ids),
        "tokens": tokens, "loss_mask": mask, "engine_logprobs": _round(traj.logprobs),
        "trainer_logprobs": _round(trainer_logp[:n]), "advantages": _round(adv[:n]),
        "segments": segments,
        "token_versions": list(traj.token_versions),  # per sampled token (partial rollouts)
    }


def write_samples(run_dir: Path, step: int, n: int, trajs: list[Trajectory], batch: Batch,
                  backend, tokenizer, temperature: float) -> Path | None:
    """Write step ``step``'s chosen samples to ``run_dir/samples/step_<step>.jsonl``.

    ``batch`` is the step's collated batch after :func:`agentgym.trainers.phases.advantages`
    (it holds
    ``adv`` and, unless the update computes them, ``old_logp`` of the batch)."""
    chosen = pick([t.reward for t in trajs], n)
    if not chosen:
        return None
    rows = [i for i, _ in chosen]
    if batch.old_logp is not None:
        logp = batch.old_logp[rows]
    else:  # the update computes its own: the chosen rows' here, before it changes weights
        with torch.no_grad():
            logp, _ = backend.logprobs(collate([trajs[i] for i in rows],
                                               tokenizer.pad_token_id), temperature)
    trainer_logp, adv = [], []
    for j, i in enumerate(rows):  # each row as long as its trajectory, 0 where mask is 0
        n = len(trajs[i].token_ids)
        mask = batch.loss_mask[i, :n] > 0
        trainer_logp.append(torch.where(mask, logp[j, :n].float(), 0.0).tolist())
        adv.append(torch.where(mask, batch.adv[i, :n].float(), 0.0).tolist())
    out = run_dir / "samples" / f"step_{step}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for j, (i, rank) in enumerate(chosen):
            f.write(json.dumps(record(step, trajs[i], rank, tokenizer, trainer_logp[j],
                                      adv[j])) + "\n")
    tmp.replace(out)
    return out
