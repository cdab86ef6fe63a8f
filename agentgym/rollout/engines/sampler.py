"""One batched draw on the device for every row of a step: no per-request host work.

Each row carries its own settings as tensors (:class:`RowParams`): temperature (greedy rows
take the argmax), top-p, top-k, and a seed. The draw is counter-based: a row's uniform is a
hash of (seed, position in its output), computed on the device, so a seeded request gets
the same tokens whoever shares its batch, and nothing holds a ``torch.Generator`` per
request. Sampling is by inverse CDF: the first token whose cumulative probability passes
the uniform. A row that truncates (top-p < 1 or top-k) draws over its probabilities sorted
in descending order, the others over the vocabulary order; a row whose top-k is at most
:data:`PREFILTER` sorts only its :data:`PREFILTER` likeliest tokens (``topk``: the same
leading order as a sort of the whole vocabulary), a row with top-p alone sorts the whole
vocabulary (its nucleus may reach past any fixed prefix). Which one a row uses depends on
its own settings only, so a row's token never depends on its companions.

The steps are free of host reads and data-dependent shapes, so on a GPU a step's
sampling is captured as a graph too (:meth:`RowParams.mode_of` is what such a graph is
keyed by: the Python branches this function takes).

Logprobs are ``log_softmax(logits / temperature)`` of the chosen token (temperature 1 for
greedy rows), before truncation, in fp32: what a trainer recomputes with a forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF
# murmur3's 32-bit finaliser constants; products stay exact in int64 after masking
_M1, _M2 = 0x85EBCA6B, 0xC2B2AE35
_GOLDEN = 0x9E3779B9
#: a row with top-k up to this many draws among that many likeliest tokens, not a sort
PREFILTER = 1024


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser on int64 tensors holding 32-bit values (bijective, avalanching).
    Multiplications may wrap past 2**63; the low 32 bits are exact either way."""
    h = h ^ (h >> 16)
    h = (h * _M1) & _MASK32
    h = h ^ (h >> 13)
    h = (h * _M2) & _MASK32
    return h ^ (h >> 16)


def seed_mix(seeds: torch.Tensor) -> torch.Tensor:
    """The seeds' part of :func:`uniforms`' hash (both 32-bit halves mixed): a row's for
    all its draws."""
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    return _fmix32(lo ^ _fmix32(hi + _GOLDEN))


def uniforms(seeds: torch.Tensor, positions: torch.Tensor,
             mixed: torch.Tensor | None = None) -> torch.Tensor:
    """One uniform in (0, 1) per row from (seed, position): ``(B,)`` float32.

    Args:
        seeds: ``(B,)`` int64, any value (both 32-bit halves are mixed in).
        positions: ``(B,)`` int64, the index of the token being drawn in the row's output.
        mixed: ``seed_mix(seeds)`` when already known (it is the same every step).
    """
    h = seed_mix(seeds) if mixed is None else mixed
    h = _fmix32(h ^ ((positions * _GOLDEN) & _MASK32))
    # 24 random bits, centred in their bucket: never exactly 0 or 1
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


@dataclass
class RowParams:
    """Sampling settings of a step's rows, on the device. Rebuilt when rows join or
    leave; between two such changes only ``positions`` moves (one add per step)."""

    temperature: torch.Tensor  # (B,) float32, 1.0 for greedy rows
    greedy: torch.Tensor  # (B,) bool
    top_p: torch.Tensor  # (B,) float32
    top_k: torch.Tensor  # (B,) int64, vocabulary size where off
    seeds: torch.Tensor  # (B,) int64
    positions: torch.Tensor  # (B,) int64: tokens each row has sampled so far
    all_greedy: bool
    any_greedy: bool
    unit_temperature: bool  # every row at temperature 1 (or greedy): no division
    truncating: torch.Tensor | None  # (B,) bool, None when no row truncates
    top_logprobs: int  # the most alternatives any row asks for
    #: (B,) bool, rows whose truncation needs the whole vocabulary sorted (top-p alone, or
    #: a top-k above PREFILTER); None when none does
    full_sort: torch.Tensor | None = None
    #: whether some truncating row draws within the PREFILTER likeliest tokens
    prefiltered: bool = False
    #: ``seed_mix(seeds)``, made once where the rows' seeds stay put between rebuilds (a
    #: captured sampler's seeds change in place: None, mixed every step)
    mixed_seeds: torch.Tensor | None = None

    @staticmethod
    def mode_of(settings: list, vocab: int) -> tuple:
        """The branches :func:`sample` takes for rows with these settings (a captured
        sampler's key), without building their tensors."""
        greedy, trunc, full = _kinds(settings, vocab)
        return (all(greedy), any(greedy),
                all((s.temperature or 1.0) == 1.0 for s in settings), any(trunc), any(full),
                any(tr and not f for tr, f in zip(trunc, full)),
                max((s.top_logprobs for s in settings), default=0))

    @classmethod
    def over(cls, tensors: dict, mode: tuple) -> "RowParams":
        """Rows whose per-row tensors are ``tensors`` (the fields above, ``truncating``
        and ``full_sort`` included: a captured sampler's static buffers) taking the
        branches of ``mode``."""
        all_greedy, any_greedy, unit, truncating, full_sort, prefiltered, top = mode
        return cls(**{k: tensors[k] for k in ROW_TENSORS},
                   all_greedy=all_greedy, any_greedy=any_greedy, unit_temperature=unit,
                   truncating=tensors["truncating"] if truncating else None,
                   top_logprobs=top, full_sort=tensors["full_sort"] if full_sort else None,
                   prefiltered=prefiltered)

    @classmethod
    def tensors_of(cls, settings: list, seeds: list[int], positions: list[int], vocab: int,
                   device) -> dict[str, torch.Tensor]:
        """The per-row tensors of :meth:`build`, ``truncating`` and ``full_sort`` as
        ``(B,)`` bool."""
        greedy, trunc, full = _kinds(settings, vocab)

        def t(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)
        return {"temperature": t([s.temperature or 1.0 for s in settings], torch.float32),
                "greedy": t(greedy, torch.bool),
                "top_p": t([s.top_p for s in settings], torch.float32),
                "top_k": t([s.top_k if 0 < s.top_k < vocab else vocab for s in settings],
                           torch.long),
                "seeds": t(seeds, torch.long), "positions": t(positions, torch.long),
                "truncating": t(trunc, torch.bool), "full_sort": t(full, torch.bool)}

    @classmethod
    def build(cls, settings: list, seeds: list[int], positions: list[int], vocab: int,
              device) -> "RowParams":
        """``settings``: each row's :class:`~agentgym.core.types.SamplingParams`."""
        rows = cls.over(cls.tensors_of(settings, seeds, positions, vocab, device),
                        cls.mode_of(settings, vocab))
        rows.mixed_seeds = seed_mix(rows.seeds)
        return rows


#: RowParams' per-row tensors (besides ``truncating`` and ``full_sort``)
ROW_TENSORS = ("temperature", "greedy", "top_p", "top_k", "seeds", "positions")


def _kinds(settings: list, vocab: int) -> tuple[list[bool], list[bool], list[bool]]:
    """Per row: greedy; truncating (top-p < 1 or a top-k below the vocabulary); truncating
    over the whole sorted vocabulary (not within the PREFILTER likeliest)."""
    greedy = [s.temperature == 0 for s in settings]
    trunc = [not g and (s.top_p < 1.0 or 0 < s.top_k < vocab)
             for g, s in zip(greedy, settings)]
    full = [t and not 0 < s.top_k <= min(PREFILTER, vocab) for t, s in zip(trunc, settings)]
    return greedy, trunc, full


def sample(logits: torch.Tensor, rows: RowParams):
    """Draw one token per row.

    Args:
        logits: ``(B, V)`` raw logits of the next position (any float dtype).
        rows: the rows' settings (``B`` rows).

    Returns:
        ``(tokens (B,) int64, logprobs (B,) float32, top)``: ``top`` is ``(values, ids)``,
        each ``(B, rows.top_logprobs)``, or None when no row asks for alternatives.
    """
    scaled = logits.float()
    if not rows.unit_temperature:
        scaled = scaled / rows.temperature[:, None]
    tokens = scaled.argmax(-1) if rows.any_greedy else None
    if rows.all_greedy:
        lse = torch.logsumexp(scaled, dim=-1)
    else:
        # one exp over the vocabulary serves the draw and the log-normaliser (logsumexp
        # would take its own: the exp is most of a draw's time)
        peak = scaled.amax(-1, keepdim=True)
        weights = (scaled - peak).exp_()  # the probabilities times the row's total
        total = weights.sum(-1)
        lse = peak[:, 0] + total.log()
        u = uniforms(rows.seeds, rows.positions, rows.mixed_seeds)
        truncated = None
        if rows.truncating is not None:
            truncated = _truncated_draw(weights / total[:, None], rows, u)
        drawn = _inverse_cdf(weights.cumsum_(-1), u)  # the weights become their CDF
        if truncated is not None:
            drawn = torch.where(rows.truncating, truncated, drawn)
        tokens = drawn if tokens is None else torch.where(rows.greedy, tokens, drawn)
    top = None
    if rows.top_logprobs:
        values, ids = scaled.topk(rows.top_logprobs, dim=-1)
        top = (values - lse[:, None], ids)
    return tokens, scaled.gather(1, tokens[:, None])[:, 0] - lse, top


def _inverse_cdf(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index of the first entry of each row's running sum ``cdf`` that passes ``u`` of the
    row's total."""
    index = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return index.clamp(max=cdf.shape[-1] - 1)


def _truncated_draw(probs: torch.Tensor, rows: RowParams, u: torch.Tensor) -> torch.Tensor:
    """Draw within each row's top-k and top-p nucleus (the smallest prefix of the sorted
    probabilities whose mass reaches top_p), over the probabilities in descending order:
    the :data:`PREFILTER` likeliest for a row whose top-k is within it, all of them for
    the others (both computed only when some row needs each)."""
    drawn = None
    if rows.prefiltered:
        k = min(PREFILTER, probs.shape[-1])
        drawn = _draw_sorted(*probs.topk(k, dim=-1), rows, u)
    if rows.full_sort is not None:
        whole = _draw_sorted(*probs.sort(dim=-1, descending=True), rows, u)
        drawn = whole if drawn is None else torch.where(rows.full_sort, whole, drawn)
    return drawn


def _draw_sorted(sorted_p: torch.Tensor, order: torch.Tensor, rows: RowParams,
                 u: torch.Tensor) -> torch.Tensor:
    """The drawn token ids, from each row's leading probabilities in descending order
    (``sorted_p``) and their ids (``order``)."""
    rank = torch.arange(sorted_p.shape[-1], device=sorted_p.device)[None, :]
    keep = rank < rows.top_k[:, None]
    nucleus = (sorted_p.cumsum(-1) - sorted_p) <= rows.top_p[:, None]
    keep &= nucleus | (rows.top_p[:, None] >= 1.0)
    sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    return order.gather(1, _inverse_cdf(sorted_p.cumsum(-1), u)[:, None])[:, 0]
