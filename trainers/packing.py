"""The update's forward pass without repeated or wasted work (``trainer.packing``).

A micro-batch arrives as right-padded rows (:class:`~agentgym.trainers.batch.Batch`).
:func:`build_pack` turns it into one packed row that the model runs once:

* **No padding.** Each row's tokens go in one after the other, with its own positions
  (restarted at 0), and attention stays inside each row (:func:`packed_attention`).
* **A group's shared prefix once.** Rows of one group (the same ``uid``: GRPO's n samples
  of a prompt, and in multi-turn the first turn's prompt) share their longest common
  prefix of tokens. It is packed once; each row's continuation attends to its K/V as it
  would to its own copy, so the outputs are the padded pass's and the gradient flows back
  into the prefix once, summed over the rows (Prefix Grouper, arXiv 2506.05433).
* **Nothing after the last sampled token.** A row is packed up to the input that predicts
  its last sampled token; what follows is read by no loss term (the model is causal).
* **Hidden states only where the loss reads them.** ``hidden_at`` names, for each sampled
  token, the packed position whose hidden state predicts it; only those go through the
  vocabulary head (:func:`agentgym.trainers.fused_head.head_logprobs`).

The pack's attention is :mod:`agentgym.trainers.attention`; how a batch's rows are split into
micro-batches (whole groups, balanced) is :mod:`agentgym.trainers.balancing`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


#: the model-forward keyword that carries the segments to every attention layer
PACK_KWARG = "agentgym_pack"


#: a bucket of stacked segments may hold at most this many times their real area
BUCKET_WASTE = 1.5


@dataclass
class Segments:
    """Attention layout of a pack of ``N`` tokens in ``S`` segments.

    Dense (SDPA) layout, one entry per bucket of segments: ``index`` ``(s, K)``, the
    packed positions of each segment's keys (its prefix, then itself; right-padded with
    position 0); every key position is also a query, so causal attention over a row of
    ``index`` is the ordinary top-left one (``is_causal``: the masked half is skipped, and
    right padding is never seen by a real query); ``out_index`` ``(N,)``: where each
    packed position's output lies in the buckets' outputs stacked and flattened (a
    continuation's copies of its prefix's queries are computed and never read). Varlen
    layout: ``cu_q``/``cu_k`` ``(S+1,)`` int32 cumulative lengths of each segment's own
    queries and of its keys, ``k_flat`` the packed positions of every segment's keys in
    order, ``max_q``/``max_k``.
    """

    index: list[torch.Tensor]
    out_index: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    k_flat: torch.Tensor
    max_q: int
    max_k: int

    def to(self, device) -> "Segments":
        def move(v):
            if isinstance(v, torch.Tensor):
                return v.to(device, non_blocking=True)
            if isinstance(v, list):
                return [t.to(device, non_blocking=True) for t in v]
            return v
        return Segments(**{f.name: move(getattr(self, f.name)) for f in fields(self)})


@dataclass
class Pack:
    """One packed row for a micro-batch of ``B`` rows of width ``T``.

    ``input_ids``/``position_ids`` ``(1, N)``; ``segments``: its attention layout;
    ``hidden_at`` ``(M,)``: the packed position predicting each of the ``M`` needed tokens,
    ``targets`` ``(M,)`` those tokens, ``rows``/``cols`` ``(M,)`` where they sit in the
    batch; ``shared`` prefix tokens packed once instead of once per row (a statistic).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segments: Segments
    hidden_at: torch.Tensor
    targets: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    shape: tuple[int, int]
    shared: int = 0
    #: ``(B,)`` the packed position of each row's last packed token (-1: none packed)
    last_at: torch.Tensor | None = None

    @property
    def placeholder(self) -> bool:
        """Nothing is read: the one position it holds stands in for a dummy pass."""
        return len(self.rows) == 1 and int(self.cols[0]) == 0

    def model_kwargs(self, device) -> dict:
        """What a transformers forward of the pack takes (its segments ride along to every
        attention layer under :data:`PACK_KWARG`)."""
        return {"input_ids": self.input_ids.to(device),
                "position_ids": self.position_ids.to(device), "use_cache": False,
                PACK_KWARG: self.segments.to(device)}


def common_prefix(ids: torch.Tensor, rows: list[int], lengths: list[int]) -> int:
    """Longest common prefix of ``ids[r, :lengths[r]]`` over ``rows``."""
    n = min(lengths[r] for r in rows)
    if n == 0:
        return 0
    block = ids[rows, :n]
    same = (block == block[:1]).all(0)
    diff = (~same).nonzero()
    return int(diff[0]) if len(diff) else n


def shared_tokens(input_ids: torch.Tensor, lengths: list[int], groups: list) -> int:
    """Tokens a pack of these rows does not encode again: each group's common prefix,
    once per row after its first (a statistic; the pack reads up to the last needed
    token, so it may share a little less)."""
    members: dict = {}
    for r, key in enumerate(groups):
        members.setdefault(key, []).append(r)
    return sum(common_prefix(input_ids, rows, lengths) * (len(rows) - 1)
               for rows in members.values() if len(rows) > 1)


def needed(loss_mask: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` bool: the tokens whose log-probability is read (``loss_mask > 0``, never
    a row's first token, which has none)."""
    need = loss_mask > 0
    need[:, 0] = False
    return need


def build_pack(input_ids: torch.Tensor, lengths: list[int], loss_mask: torch.Tensor,
               groups: list | None = None, share: bool = True,
               keep_whole: bool = False) -> Pack:
    """Pack a micro-batch (module docstring).

    Args:
        input_ids: ``(B, T)`` right-padded rows; ``lengths``: each row's real tokens.
        loss_mask: ``(B, T)``: the tokens whose log-probability is needed (``> 0``).
        groups: per row, a key; rows with the same key share their common prefix (None:
            no sharing).
        share: False packs every row whole (no shared prefix).
        keep_whole: pack each row to its full length (a value head reads every state),
            instead of up to the last needed token.
    """
    B, T = input_ids.shape
    need = needed(loss_mask)
    rows_m, cols_m = need.nonzero(as_tuple=True)
    if keep_whole:
        used = [int(n) for n in lengths]
    else:  # inputs 0 .. last needed - 1 predict every needed token of the row
        last = torch.where(need, torch.arange(T).expand(B, T), -1).max(-1).values
        used = [max(0, int(x)) for x in last.tolist()]
    if not len(rows_m) and not keep_whole:  # nothing to learn (a rank's dummy pass): one
        used = [0] * B                      # token still runs so every rank joins in
        used[0] = min(1, int(lengths[0]))
    keys = groups if (groups is not None and share) else list(range(B))
    order: dict = {}
    for r in range(B):
        if used[r] > 0:
            order.setdefault(keys[r], []).append(r)
    slot_of = torch.zeros((B, T), dtype=torch.long)
    src_r: list[torch.Tensor] = []
    src_c: list[torch.Tensor] = []
    segs: list[tuple[int, int, torch.Tensor]] = []  # (q start, q length, key slots)
    n = shared = 0
    for members in order.values():
        p = common_prefix(input_ids, members, used) if len(members) > 1 else 0
        prefix = torch.arange(n, n + p)
        if p:
            src_r.append(torch.full((p,), members[0]))
            src_c.append(torch.arange(p))
            slot_of[members, :p] = prefix
            segs.append((n, p, prefix))
            n += p
            shared += p * (len(members) - 1)
        for r in members:
            m = used[r] - p
            if m <= 0:
                continue
            own = torch.arange(n, n + m)
            src_r.append(torch.full((m,), r))
            src_c.append(torch.arange(p, used[r]))
            slot_of[r, p:used[r]] = own
            segs.append((n, m, torch.cat([prefix, own])))
            n += m
    src_r_t, src_c_t = torch.cat(src_r), torch.cat(src_c)
    ids = input_ids[src_r_t, src_c_t][None]
    positions = src_c_t[None]
    if len(rows_m):
        hidden_at = slot_of[rows_m, cols_m - 1]
        targets = input_ids[rows_m, cols_m]
    else:  # one placeholder read (its logprob is multiplied by 0: :func:`scatter`)
        hidden_at = torch.zeros(1, dtype=torch.long)
        targets, rows_m, cols_m = ids[0, :1].clone(), torch.zeros(1, dtype=torch.long), \
            torch.zeros(1, dtype=torch.long)
    last_at = torch.tensor([int(slot_of[r, used[r] - 1]) if used[r] else -1 for r in range(B)])
    return Pack(ids, positions, _segments(segs, n), hidden_at, targets, rows_m, cols_m,
                (B, T), shared, last_at)


def _segments(segs: list[tuple[int, int, torch.Tensor]], n: int) -> Segments:
    """Dense buckets (segments sorted by key length; a new bucket whenever stacking would
    pad past :data:`BUCKET_WASTE` times the real causal area) and the varlen layout."""
    q_len = torch.tensor([s[1] for s in segs])
    k_len = torch.tensor([len(s[2]) for s in segs])
    cu_q = torch.zeros(len(segs) + 1, dtype=torch.int32)
    cu_q[1:] = torch.cumsum(q_len, 0)
    cu_k = torch.zeros(len(segs) + 1, dtype=torch.int32)
    cu_k[1:] = torch.cumsum(k_len, 0)
    kl = k_len.tolist()
    by_size = sorted(range(len(segs)), key=lambda i: -kl[i])
    buckets: list[list[int]] = []
    area = km = 0
    for i in by_size:  # longest first: a bucket's first segment is its longest
        a = kl[i] * kl[i]
        if buckets and (len(buckets[-1]) + 1) * km * km <= BUCKET_WASTE * (area + a):
            buckets[-1].append(i)
            area += a
            continue
        buckets.append([i])
        area, km = a, kl[i]
    index = []
    out_index = torch.empty(n, dtype=torch.long)
    base = 0
    for bucket in buckets:
        b = torch.tensor(bucket)
        K = kl[bucket[0]]
        index.append(torch.nn.utils.rnn.pad_sequence([segs[i][2] for i in bucket],
                                                     batch_first=True))
        # a segment's own queries are the last q_len of its keys
        for j, i in enumerate(bucket):
            start, lq, _ = segs[i]
            first = base + j * K + kl[i] - lq
            out_index[start:start + lq] = torch.arange(first, first + lq)
        base += len(b) * K
    k_flat = torch.cat([s[2] for s in segs])
    return Segments(index, out_index, cu_q, cu_k, k_flat, int(q_len.max()), int(k_len.max()))


def scatter_at(values: torch.Tensor, shape: tuple[int, int], rows: torch.Tensor,
               cols: torch.Tensor, placeholder: bool = False) -> torch.Tensor:
    """``(M,)`` values read at ``(rows, cols)`` into a ``shape`` fp32 tensor (0 elsewhere),
    differentiably; a ``placeholder`` read (nothing sampled) contributes ``0 * value``, so
    a dummy pass keeps its graph and every rank's backward runs."""
    out = torch.zeros(shape, dtype=torch.float32, device=values.device)
    if placeholder:
        return out + 0.0 * values.float().sum()
    return out.index_put((rows.to(values.device), cols.to(values.device)), values.float())


def scatter(values: torch.Tensor, pack: Pack) -> torch.Tensor:
    """The pack's ``(M,)`` values into its batch's ``(B, T)`` (:func:`scatter_at`)."""
    return scatter_at(values, pack.shape, pack.rows, pack.cols, pack.placeholder)
