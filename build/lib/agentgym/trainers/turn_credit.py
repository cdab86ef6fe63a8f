"""Turn-level credit assignment: advantage estimators that see each turn's reward.

An episode of ``K`` turns gets a reward per turn (``Trajectory.step_rewards``: an env's
turn reward, e.g. ``search.retrieval_reward``, and the outcome on the last turn), which
:func:`agentgym.trainers.batch.collate` puts on the last token sampled in that turn. The estimators
of :mod:`agentgym.trainers.algos` sum them into one episode return; the ones here keep them apart,
so a turn is credited with what came after it, not before, and its baseline is the other
samples' same turn. Each turn's advantage is put on every token sampled in that turn.
They are registered in :data:`agentgym.trainers.algos.ADVANTAGES` under the names below.

``turn_ids`` ``(B, T)`` (:attr:`agentgym.trainers.batch.Batch.turn_ids`) names the turn of each
sampled token (the env's step index; -1 off the mask). ``r_k`` is the sum of the token
rewards of turn ``k`` (a per-token KL penalty in the reward counts to its turn), and the
last turn's is the outcome.

* ``mt_grpo`` (turn-level GRPO, Zeng et al. 2025, "Reinforcing multi-turn reasoning in LLM
  agents via turn-level credit assignment"): the outcome is normalised over the group
  (``A^O``, as GRPO), each earlier turn's reward over the group's samples that reached the
  same turn (``A^T_k``: a group baseline per turn), and turn ``k`` gets the discounted sum of
  what follows it, ``sum_{j >= k} gamma^(j-k) Â_j`` with ``Â_last = A^O``. For two turns and
  ``gamma = 1`` that is the paper's ``A^T + A^O`` on the first turn and ``A^O`` on the second.
* ``gigpo`` (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training"):
  ``A^E + step_weight * A^S``: ``A^E`` is GRPO's over the episode return, ``A^S`` normalises
  a turn's discounted return-to-go ``G_k = sum_{j >= k} gamma^(j-k) r_j`` over the turns of
  the group that acted from the same anchor state: here the tokens the env showed just
  before the turn (the prompt for the first turn, the observation for a later one), so
  two samples that ran the same search and read the same results compare their next moves.
* ``gae_turn`` (PPO with a critic, GAE over turns instead of tokens): ``V_k`` is the critic's
  value at the first token of turn ``k``, ``delta_k = r_k + gamma V_{k+1} - V_k`` (``V_K`` is 0
  for a terminated episode, the value after the last token for a truncated one), ``A_k =
  delta_k + gamma lam A_{k+1}``; every token of turn ``k`` gets ``A_k`` and the return target
  ``A_k + V_k``.

``gamma`` here discounts per turn (``algo.gamma``; it is per token for ``gae``). A group of
one, or a turn group whose rewards are all equal, contributes 0, as in GRPO. With
``episode_ids`` (an agent episode split into several rows) the episode-level terms count
an episode once; a turn belongs to one row of its episode, so turn groups need no weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from agentgym.trainers.group_stats import _group_stats, masked_whiten


@dataclass
class Turn:
    """One turn of one row: the env's turn number, its summed reward, and where its
    sampled tokens begin and end (inclusive)."""

    number: int
    reward: float
    first: int
    last: int


def row_turns(rewards: torch.Tensor, mask: torch.Tensor, turn_ids: torch.Tensor
              ) -> list[list[Turn]]:
    """Per row, its turns in the order they were sampled."""
    if turn_ids.shape != mask.shape:
        raise ValueError(f"turn_ids has shape {tuple(turn_ids.shape)}, the mask "
                         f"{tuple(mask.shape)}")
    out: list[list[Turn]] = []
    for b in range(mask.shape[0]):
        m = mask[b] > 0
        pos = m.nonzero().flatten()
        ids = turn_ids[b, pos]
        if bool((ids < 0).any()):
            raise ValueError(f"row {b}: a sampled token has no turn (turn_ids -1 under the mask)")
        turns: list[Turn] = []
        index: dict[int, Turn] = {}
        r = rewards[b].float()
        for p, k in zip(pos.tolist(), ids.tolist()):
            t = index.get(k)
            if t is None:
                t = index[k] = Turn(k, 0.0, p, p)
                turns.append(t)
            t.reward += float(r[p])
            t.last = p
        out.append(turns)
    return out


def _spread(turns: list[list[Turn]], per_turn: list[list[float]], mask: torch.Tensor,
            turn_ids: torch.Tensor) -> torch.Tensor:
    """Each turn's value on every token sampled in it; 0 off the mask."""
    out = torch.zeros(mask.shape, dtype=torch.float32)
    for b, (row, vals) in enumerate(zip(turns, per_turn)):
        for t, v in zip(row, vals):
            out[b] = torch.where((turn_ids[b] == t.number) & (mask[b] > 0), float(v), out[b])
    return out


def _normalise(scores: list[float], keys: list, norm_by_std: bool, eps: float,
               weights_by: Sequence | None = None) -> list[float]:
    """``(x - mean_key) [/ (std_key + eps)]`` per entry; 0 where the key's group has one
    member or equal scores (GRPO's rule)."""
    if not scores:
        return []
    x = torch.tensor(scores, dtype=torch.float32)
    mean, std, count, flat = _group_stats(x, keys, weights_by)
    adv = x - mean
    if norm_by_std:
        adv = adv / (std + eps)
    return torch.where((count > 1) & ~flat, adv, 0.0).tolist()


def _to_go(values: list[float], gamma: float) -> list[float]:
    """``sum_{j >= k} gamma^(j-k) values[j]`` for every ``k``."""
    out, acc = [0.0] * len(values), 0.0
    for k in range(len(values) - 1, -1, -1):
        acc = values[k] + gamma * acc
        out[k] = acc
    return out


def mt_grpo_advantages(rewards: torch.Tensor, mask: torch.Tensor, *, group_ids: Sequence,
                       turn_ids: torch.Tensor, gamma: float = 1.0, norm_by_std: bool = True,
                       eps: float = 1e-6, episode_ids: Sequence | None = None):
    """Turn-level GRPO (MT-GRPO; module docstring): turn ``k`` gets ``sum_{j >= k}
    gamma^(j-k) Â_j``, ``Â_j`` the group-normalised reward of turn ``j`` among the group's
    samples that reached turn ``j``, and ``Â_last`` the group-normalised outcome.

    Returns:
        ``(B, T)`` advantages and the discounted raw return-to-go of each token's turn.
    """
    turns = row_turns(rewards, mask, turn_ids)
    if any(not row for row in turns):
        raise ValueError("mt_grpo: a row has no sampled token")
    outcome = _normalise([row[-1].reward for row in turns], list(group_ids), norm_by_std,
                         eps, episode_ids)
    entries = [(b, i) for b, row in enumerate(turns) for i in range(len(row) - 1)]
    mid = _normalise([turns[b][i].reward for b, i in entries],
                     [(group_ids[b], turns[b][i].number) for b, i in entries], norm_by_std,
                     eps)
    normed = [[0.0] * len(row) for row in turns]
    for (b, i), a in zip(entries, mid):
        normed[b][i] = a
    for b, row in enumerate(turns):
        normed[b][-1] = outcome[b]
    adv = [_to_go(v, gamma) for v in normed]
    ret = [_to_go([t.reward for t in row], gamma) for row in turns]
    return _spread(turns, adv, mask, turn_ids), _spread(turns, ret, mask, turn_ids)


def anchor_key(input_ids: torch.Tensor, row: list[Turn], b: int, i: int) -> tuple:
    """The state turn ``i`` of row ``b`` acted from: the tokens between the previous turn's
    last sampled token and this turn's first (the prompt, for the first turn)."""
    start = row[i - 1].last + 1 if i else 0
    return tuple(input_ids[b, start:row[i].first].tolist())


def gigpo_advantages(rewards: torch.Tensor, mask: torch.Tensor, *, group_ids: Sequence,
                     turn_ids: torch.Tensor, input_ids: torch.Tensor, gamma: float = 1.0,
                     step_weight: float = 1.0, norm_by_std: bool = True, eps: float = 1e-6,
                     episode_ids: Sequence | None = None):
    """GiGPO (module docstring): ``A^E + step_weight * A^S``, the episode-level GRPO
    advantage plus the step-level one over anchor-state groups.

    Returns:
        ``(B, T)`` advantages and the discounted raw return-to-go of each token's turn.
    """
    turns = row_turns(rewards, mask, turn_ids)
    if any(not row for row in turns):
        raise ValueError("gigpo: a row has no sampled token")
    episode = _normalise([sum(t.reward for t in row) for row in turns], list(group_ids),
                         norm_by_std, eps, episode_ids)
    to_go = [_to_go([t.reward for t in row], gamma) for row in turns]
    entries = [(b, i) for b, row in enumerate(turns) for i in range(len(row))]
    keys = [(group_ids[b], anchor_key(input_ids, turns[b], b, i)) for b, i in entries]
    step = _normalise([to_go[b][i] for b, i in entries], keys, norm_by_std, eps)
    adv = [[episode[b]] * len(row) for b, row in enumerate(turns)]
    for (b, i), a in zip(entries, step):
        adv[b][i] += step_weight * a
    return _spread(turns, adv, mask, turn_ids), _spread(turns, to_go, mask, turn_ids)


def gae_turn_advantages(rewards: torch.Tensor, mask: torch.Tensor, *, values: torch.Tensor,
                        turn_ids: torch.Tensor, last_values: torch.Tensor | None = None,
                        truncated: torch.Tensor | None = None, gamma: float = 1.0,
                        lam: float = 1.0, norm_by_std: bool = True):
    """GAE over turns (module docstring): a turn is one time step; its value is the
    critic's at its first sampled token.

    Returns:
        ``(B, T)`` advantages (whitened over the batch's sampled tokens with
        ``norm_by_std``) and the return targets ``A_k + V_k``, 0 off the mask.
    """
    turns = row_turns(rewards, mask, turn_ids)
    if truncated is not None and bool(truncated.any()) and last_values is None:
        raise ValueError("gae_turn: truncated rows need last_values to bootstrap from")
    adv_rows, ret_rows = [], []
    for b, row in enumerate(turns):
        v = [float(values[b, t.first]) for t in row]
        nxt = float(last_values[b]) if truncated is not None and bool(truncated[b]) else 0.0
        a, running = [0.0] * len(row), 0.0
        for k in range(len(row) - 1, -1, -1):
            delta = row[k].reward + gamma * nxt - v[k]
            running = delta + gamma * lam * running
            a[k], nxt = running, v[k]
        adv_rows.append(a)
        ret_rows.append([x + y for x, y in zip(a, v)])
    adv = _spread(turns, adv_rows, mask, turn_ids)
    return (masked_whiten(adv, mask) if norm_by_std else adv), \
        _spread(turns, ret_rows, mask, turn_ids)
