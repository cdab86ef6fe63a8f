"""Masked and grouped statistics the advantage estimators share (:mod:`agentgym.trainers.algos`,
:mod:`agentgym.trainers.turn_credit`): a group's mean/std/size, masked means and whitening."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Sequence

import torch


def group_indices(group_ids: Sequence) -> list[list[int]]:
    """Row indices of each group, groups in order of first appearance."""
    groups: dict = defaultdict(list)
    for i, g in enumerate(group_ids):
        groups[g].append(i)
    return list(groups.values())


def _group_stats(scores: torch.Tensor, group_ids: Sequence,
                 episode_ids: Sequence | None = None):
    """Per row: its group's mean, unbiased std, size and whether all its scores are equal.

    With ``episode_ids``, the rows of one episode (an agent whose history was rewritten
    yields several trajectories, all with the episode's score) count as one sample: each
    weighs 1 / its episode's rows, so the stats are the episodes' and the size counts
    episodes. Vectorized with scatter-adds; ``(B,)`` each.
    """
    keys: dict = {}
    inv = torch.tensor([keys.setdefault(g, len(keys)) for g in group_ids], dtype=torch.long)
    if len(inv) != len(scores):
        raise ValueError(f"{len(group_ids)} group ids for {len(scores)} rows")
    G = len(keys)
    w = torch.ones_like(scores, dtype=torch.float32)
    if episode_ids is not None:
        rows = Counter(episode_ids)
        w = torch.tensor([1.0 / rows[e] for e in episode_ids])
    count = torch.zeros(G).index_add_(0, inv, w)
    mean = torch.zeros(G).index_add_(0, inv, w * scores) / count
    sq = torch.zeros(G).index_add_(0, inv, w * (scores - mean[inv]) ** 2)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    lo = torch.full((G,), float("inf")).scatter_reduce_(0, inv, scores, "amin")
    hi = torch.full((G,), -float("inf")).scatter_reduce_(0, inv, scores, "amax")
    return mean[inv], std[inv], count[inv], (hi == lo)[inv]


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return torch.where(mask > 0, values, 0.0).sum() / mask.sum().clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(values - mean) / std`` over the mask-1 entries of the whole batch (unbiased
    variance, as verl's ``masked_whiten``); 0 where ``mask`` is 0."""
    m = mask > 0
    n = m.sum()
    if n < 2:
        return torch.zeros_like(values)
    x = torch.where(m, values, 0.0)
    mean = x.sum() / n
    var = (torch.where(m, values - mean, 0.0) ** 2).sum() / (n - 1)
    return torch.where(m, (values - mean) * torch.rsqrt(var + eps), 0.0)
