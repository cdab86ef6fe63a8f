"""A batch's rows in micro-batches: the one splitter of the update (:func:`split`). Packed
(``trainer.packing``): whole groups (a group's shared prompt is packed once), within a
budget of real tokens, their count a multiple of the ranks and their sizes balanced by
Karmarkar-Karp (as verl's ``use_dynamic_bsz``). Padded: rows in order, within a budget of
padded tokens."""

from __future__ import annotations

import heapq

import torch

from agentgym.trainers.batch import Batch
from agentgym.trainers.packing import common_prefix


def split(batch: Batch, micro_batch_tokens: int, packing: bool, multiple: int = 1
          ) -> list[list[int]]:
    """Row indices of ``batch``'s micro-batches: with ``packing``, whole groups by packed
    tokens, balanced, a multiple of ``multiple`` of them (:func:`split_rows`); else rows in
    order by padded tokens (:func:`micro_batches`)."""
    lengths = batch.attention_mask.sum(-1).tolist()
    if not packing:
        return micro_batches(lengths, micro_batch_tokens)
    return split_rows(batch.input_ids, lengths, batch.uids, micro_batch_tokens, multiple)


def micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Split row indices, in order, so each group's padded size ``rows * longest`` stays
    within ``max_tokens`` (a single longer row gets a group of its own)."""
    groups: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if cur and (len(cur) + 1) * max(longest, n) > max_tokens:
            groups.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        groups.append(cur)
    return groups


def karmarkar_karp(costs: list[int], k: int) -> list[list[int]]:
    """Indices of ``costs`` in ``k`` parts of near-equal sums: Karmarkar-Karp's largest
    differencing method (as verl's ``use_dynamic_bsz`` balances its ranks): repeatedly
    merge the two partial partitions that differ most, pairing the heavier parts of one
    with the lighter of the other. Deterministic; parts may be empty when there are fewer
    items than ``k``."""
    heap: list = []
    for i, c in enumerate(costs):
        sums = [c] + [0] * (k - 1)
        heapq.heappush(heap, (-c, i, sums, [[i]] + [[] for _ in range(k - 1)]))
    tick = len(costs)
    while len(heap) > 1:
        _, _, s1, p1 = heapq.heappop(heap)
        _, _, s2, p2 = heapq.heappop(heap)
        a = sorted(range(k), key=lambda j: -s1[j])
        b = sorted(range(k), key=lambda j: s2[j])
        sums = [s1[x] + s2[y] for x, y in zip(a, b)]
        parts = [p1[x] + p2[y] for x, y in zip(a, b)]
        heapq.heappush(heap, (-(max(sums) - min(sums)), tick, sums, parts))
        tick += 1
    if not heap:
        return [[] for _ in range(k)]
    return [sorted(p) for p in heap[0][3]]


def group_units(input_ids: torch.Tensor, lengths: list[int], groups: list | None,
                max_tokens: int) -> list[tuple[list[int], int]]:
    """The batch's rows as indivisible units with their packed cost: each group's rows
    (prefix counted once) in chunks of at most ``max_tokens`` packed tokens (a row longer
    than that is a unit of its own)."""
    keys = groups if groups is not None else list(range(len(lengths)))
    members: dict = {}
    for r, key in enumerate(keys):
        members.setdefault(key, []).append(r)
    units: list[tuple[list[int], int]] = []
    for rows in members.values():
        p = common_prefix(input_ids, rows, lengths) if len(rows) > 1 else 0
        cur: list[int] = []
        cost = 0
        for r in sorted(rows, key=lambda r: -lengths[r]):
            extra = lengths[r] - p + (p if not cur else 0)
            if cur and cost + extra > max_tokens:
                units.append((cur, cost))
                cur, cost, extra = [], 0, lengths[r]
            cur.append(r)
            cost += extra
        if cur:
            units.append((cur, cost))
    return units


def split_rows(input_ids: torch.Tensor, lengths: list[int], groups: list | None,
               max_tokens: int, multiple: int = 1) -> list[list[int]]:
    """Row indices of the micro-batches of a packed update: whole groups (a group's
    prompt is encoded once), each micro-batch within ``max_tokens`` real (packed) tokens,
    their count a multiple of ``multiple`` (the ranks) and their token counts balanced by
    :func:`karmarkar_karp`; largest first. Padding never counts: there is none."""
    units = group_units(input_ids, lengths, groups, max_tokens)
    total = sum(c for _, c in units)
    k = max(1, -(-total // max_tokens))
    k = -(-k // multiple) * multiple
    while True:
        parts = karmarkar_karp([c for _, c in units], k)
        sums = [sum(units[i][1] for i in p) for p in parts]
        over = [s for p, s in zip(parts, sums) if s > max_tokens and len(p) > 1]
        if not over or k >= len(units):
            break
        k += multiple
    out = [(s, sorted(r for i in p for r in units[i][0])) for p, s in zip(parts, sums) if p]
    out.sort(key=lambda x: (-x[0], x[1]))
    return [rows for _, rows in out]
