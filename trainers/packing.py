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

Attention over the pack is a list of *segments*: a query range (a row, a prefix or a
continuation) and the keys it sees (its prefix, then itself), causal from the bottom
right. With flash-attn installed on a GPU the segments are one ``flash_attn_varlen_func``
call (keys gathered per segment); otherwise SDPA runs over the segments stacked in a few
padded buckets (padding inside attention only: the linear layers, which are the work,
see none). The attention function is registered with transformers'
``AttentionInterface`` under ``agentgym_packed_<kernel>``; a forward without a pack
(generation, an unpacked pass) goes to ``<kernel>`` unchanged (:func:`enable`).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from dataclasses import dataclass, fields

import torch

from agentgym.core.device import is_accelerator

logger = logging.getLogger(__name__)

#: the model-forward keyword that carries the segments to every attention layer
PACK_KWARG = "agentgym_pack"
#: True while a packed forward runs (:func:`packed_forward`)
_PACKED = contextvars.ContextVar("agentgym_packed_forward", default=False)


@contextlib.contextmanager
def packed_forward():
    """Around a model forward of a pack: transformers makes no attention mask for it. Its
    attention reads the segments, and the mask transformers would build from the
    restarted positions (a ``(T, T)`` block-causal one, through Python mask functions) was
    thrown away: 26 ms a forward on a 4k-token pack, a fifth of the tiny model's update."""
    token = _PACKED.set(True)
    try:
        yield
    finally:
        _PACKED.reset(token)


def _mask_interface(impl: str):
    """``impl``'s mask function, skipped (None) inside :func:`packed_forward`."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    make = ALL_MASK_ATTENTION_FUNCTIONS[impl]

    def mask(*args, **kwargs):
        return None if _PACKED.get() else make(*args, **kwargs)
    return mask
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


def _lcp(ids: torch.Tensor, rows: list[int], lengths: list[int]) -> int:
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
    return sum(_lcp(input_ids, rows, lengths) * (len(rows) - 1)
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
        p = _lcp(input_ids, members, used) if len(members) > 1 else 0
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


# --- attention ---------------------------------------------------------------------------
#: a bf16 bucket of at most this many keys runs its attention in fp32 on the CPU when a
#: backward follows: torch's CPU flash-attention backward has a large fixed cost per
#: (segment, head) in bf16 (8 segments of 178 tokens, smollm2's 9 heads: 29-36 ms against
#: 17 ms in fp32; bench/packed_attention.py); from about 300 keys bf16 is as fast or faster
UPCAST_KEYS = 256


def _upcast(q, keys: int) -> bool:
    # requires_grad: outside no_grad, and something upstream is trained
    return (q.dtype == torch.bfloat16 and keys <= UPCAST_KEYS and q.requires_grad
            and not is_accelerator(q.device))


def dense_attention(query, key, value, seg: Segments, scaling, dropout: float = 0.0):
    """SDPA over the stacked segment buckets; ``query`` ``(1, H, N, d)``, ``key``/``value``
    ``(1, Hkv, N, d)``; returns ``(1, N, H, d)``. Every segment is causal from the top
    left (:class:`Segments`), so SDPA runs with ``is_causal`` and no mask: its kernels
    skip the masked half (1.8x faster than a boolean mask at 1k tokens on the CPU).
    Gathers are ``index_select`` (their backward an ``index_add``, several times cheaper
    on the CPU than advanced indexing's accumulating ``index_put``); grouped-query heads
    go to SDPA as they are. Short bf16 buckets that will be differentiated run in fp32 on
    the CPU (:data:`UPCAST_KEYS`)."""
    q, k, v = query[0], key[0], value[0]
    H, d = q.shape[0], q.shape[-1]
    outs = []
    for index in seg.index:
        s, K = index.shape
        flat = index.reshape(-1)
        qb = q.index_select(1, flat).view(H, s, K, d).transpose(0, 1)
        kb = k.index_select(1, flat).view(-1, s, K, d).transpose(0, 1)
        vb = v.index_select(1, flat).view(-1, s, K, d).transpose(0, 1)
        if _upcast(qb, K):  # autocast off, or it would run SDPA in bf16 again
            with torch.autocast(q.device.type, enabled=False):
                o = torch.nn.functional.scaled_dot_product_attention(
                    qb.float(), kb.float(), vb.float(), dropout_p=dropout, scale=scaling,
                    is_causal=True, enable_gqa=kb.shape[1] != H).to(q.dtype)
        else:
            o = torch.nn.functional.scaled_dot_product_attention(
                qb, kb, vb, dropout_p=dropout, scale=scaling, is_causal=True,
                enable_gqa=kb.shape[1] != H)
        outs.append(o.transpose(1, 2).reshape(-1, H, d))  # (s * K, H, d)
    flat_out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return flat_out.index_select(0, seg.out_index)[None]


def varlen_attention(varlen, query, key, value, seg: Segments, scaling, dropout: float = 0.0):
    """The segments as one ``flash_attn_varlen_func``-style call: queries in pack order
    (each segment's queries are consecutive), keys gathered per segment."""
    q = query[0].transpose(0, 1)  # (N, H, d)
    k = key[0].transpose(0, 1).index_select(0, seg.k_flat)
    v = value[0].transpose(0, 1).index_select(0, seg.k_flat)
    o = varlen(q, k, v, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, dropout_p=dropout,
               softmax_scale=scaling, causal=True)
    return o[None]


def varlen_standin(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   dropout_p: float = 0.0, softmax_scale=None, causal: bool = True):
    """A CPU stand-in with ``flash_attn_varlen_func``'s contract (causal aligned at the
    bottom right, as flash-attn >= 2.1): what the tier runs the varlen layout through."""
    outs = []
    for s in range(len(cu_seqlens_q) - 1):
        a, b = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        c, d = int(cu_seqlens_k[s]), int(cu_seqlens_k[s + 1])
        qs, ks, vs = q[a:b].transpose(0, 1), k[c:d].transpose(0, 1), v[c:d].transpose(0, 1)
        if ks.shape[0] != qs.shape[0]:
            ks = ks.repeat_interleave(qs.shape[0] // ks.shape[0], dim=0)
            vs = vs.repeat_interleave(qs.shape[0] // vs.shape[0], dim=0)
        lq, lk = b - a, d - c
        mask = torch.arange(lk)[None, :] <= (lk - lq) + torch.arange(lq)[:, None]
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask.to(q.device) if causal else None, dropout_p=dropout_p,
            scale=softmax_scale).transpose(0, 1))
    return torch.cat(outs)


def _flash_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


#: the varlen kernel: flash-attn's on CUDA when installed (:func:`use_varlen` sets another)
_VARLEN: dict[str, object] = {}


def use_varlen(fn) -> None:
    """Route packed attention through ``fn`` (``flash_attn_varlen_func``'s signature), or
    back to the automatic choice with None. The tier passes :func:`varlen_standin`."""
    if fn is None:
        _VARLEN.pop("fn", None)
    else:
        _VARLEN["fn"] = fn


def packed_attention(fallback: str):
    """The attention function registered as ``agentgym_packed_<fallback>``."""

    def attend(module, query, key, value, attention_mask, dropout: float = 0.0,
               scaling=None, **kwargs):
        seg = kwargs.pop(PACK_KWARG, None)
        if seg is None:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
            if fallback == "eager":
                from transformers.models.llama.modeling_llama import eager_attention_forward
                fn = eager_attention_forward
            else:
                fn = ALL_ATTENTION_FUNCTIONS[fallback]
            return fn(module, query, key, value, attention_mask, dropout=dropout,
                      scaling=scaling, **kwargs)
        if kwargs.get("sliding_window") is not None:
            raise ValueError("packed attention has no sliding window; trainer.packing=false "
                             "for this model")
        varlen = _VARLEN.get("fn")
        if varlen is None and is_accelerator(query.device):
            varlen = _flash_varlen()
        if varlen is not None:
            return varlen_attention(varlen, query, key, value, seg, scaling, dropout), None
        return dense_attention(query, key, value, seg, scaling, dropout), None
    return attend


def _hf_model(model):
    """The transformers model under a LoRA wrapper or a DeepSpeed engine."""
    base = model
    for _ in range(3):
        if hasattr(base, "get_base_model"):
            base = base.get_base_model()
        elif hasattr(base, "module") and not hasattr(base, "config"):
            base = base.module
    return base


def why_not_packable(model) -> str | None:
    """None when :func:`enable` can pack ``model``; else the reason (the padded path runs)."""
    from transformers import PreTrainedModel
    base = _hf_model(model)
    if not isinstance(base, PreTrainedModel):
        return f"{type(base).__name__} is not a transformers model"
    cfg = base.config
    if getattr(cfg, "vision_config", None) is not None:
        return ("a vision-language model: its 3-D rotary positions and image tokens are "
                "laid out per padded row (agentgym.models.vision)")
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if any(t != "full_attention" for t in (getattr(text, "layer_types", None) or [])) or \
            getattr(text, "use_sliding_window", False):
        return "sliding-window layers (packed attention is full causal)"
    impl = cfg._attn_implementation or "eager"
    if impl.startswith("agentgym_packed_"):
        return None
    if impl not in ("sdpa", "eager", "flash_attention_2", "flash_attention_3"):
        return f"attention implementation {impl!r}"
    return None


def enable(model) -> bool:
    """Register and select ``agentgym_packed_<kernel>`` on ``model`` (idempotent); False,
    with the reason logged once, for a model that cannot be packed."""
    base = _hf_model(model)
    reason = why_not_packable(model)
    if reason is not None:
        if not getattr(base, "_agentgym_pack_warned", False):
            logger.info("trainer.packing: %s takes the padded path: %s",
                        type(base).__name__, reason)
            try:
                base._agentgym_pack_warned = True
            except AttributeError:  # pragma: no cover - a frozen module
                pass
        return False
    impl = base.config._attn_implementation or "eager"
    if impl.startswith("agentgym_packed_"):
        return True
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    name = f"agentgym_packed_{impl}"
    AttentionInterface.register(name, packed_attention(impl))
    AttentionMaskInterface.register(name, _mask_interface(impl))
    base.set_attn_implementation(name)
    return True


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


# --- micro-batches -------------------------------------------------------------------------
def karmarkar_karp(costs: list[int], k: int) -> list[list[int]]:
    """Indices of ``costs`` in ``k`` parts of near-equal sums: Karmarkar-Karp's largest
    differencing method (as verl's ``use_dynamic_bsz`` balances its ranks): repeatedly
    merge the two partial partitions that differ most, pairing the heavier parts of one
    with the lighter of the other. Deterministic; parts may be empty when there are fewer
    items than ``k``."""
    import heapq
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
        p = _lcp(input_ids, rows, lengths) if len(rows) > 1 else 0
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
