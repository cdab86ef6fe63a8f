"""Attention over a pack (:mod:`agentgym.trainers.packing`) and its registration in
transformers.

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

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from agentgym.core.device import is_accelerator
from agentgym.trainers.packing import PACK_KWARG, Segments

logger = logging.getLogger(__name__)


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
    make = ALL_MASK_ATTENTION_FUNCTIONS[impl]

    def mask(*args, **kwargs):
        return None if _PACKED.get() else make(*args, **kwargs)
    return mask


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
            if fallback == "eager":
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
    name = f"agentgym_packed_{impl}"
    AttentionInterface.register(name, packed_attention(impl))
    AttentionMaskInterface.register(name, _mask_interface(impl))
    base.set_attn_implementation(name)
    return True
