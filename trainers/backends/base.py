"""The backend protocol every trainer recipe talks to (single, FSDP2, DeepSpeed).

A backend owns the policy's trainable weights and optimizer:

* ``logprobs(batch, temperature)`` → ``(B, T)`` per-token logprobs (no grad), plus the
  per-token entropy when asked; ``apply(fn, batch)`` → any no-grad per-row function of
  the model (``fn(model, micro_batch, device) -> tuple of tensors``, picklable);
* ``split(batch)`` → the token-budgeted micro-batches of a mini-batch;
* ``train_step(batches, loss_fn)`` → one optimizer step over the micro-batches
  (gradients accumulated; ``loss_fn(model, micro_batch)`` returns ``(loss, metrics)``
  with the loss already scaled so the micro-batch losses sum to the mini-batch loss;
  metrics are additive contributions, summed over micro-batches, except keys ending in
  ``_max``, whose maximum is kept);
* ``state_dict()`` → the full, unsharded weights on CPU (for weight sync and HF saves);
* ``save(dir)`` / ``load(dir)`` → HF weights plus optimizer and scheduler state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from agentgym.trainers.balancing import split
from agentgym.trainers.batch import Batch
from agentgym.core.device import has_fused_adamw
from agentgym.models.zoo import load_model, load_value_model
from agentgym.trainers import packing as pk
from agentgym.trainers.fused_head import head_logprobs, plain_logprobs
from agentgym.models.vision import suppress_vision_tokens, vision_token_ids, vl_forward_kwargs
from agentgym.trainers.lora import wrap

#: ``loss_fn(model, micro_batch) -> (loss, metrics)``; a picklable object (a small class,
#: not a closure) so that a distributed backend can send it to its rank processes.
LossFn = Callable[[Any, Batch], "tuple[torch.Tensor, dict[str, float]]"]


@dataclass(frozen=True)
class ModelSpec:
    """What a backend trains, loadable in this process or in a rank process.

    Attributes:
        path: a local HF folder (``agentgym.models.zoo.resolve_model``).
        dtype: ``float32`` or ``bfloat16`` weights.
        kind: ``causal_lm`` (the policy) or ``value`` (PPO's critic, one output per token).
    """

    path: str
    dtype: str = "float32"
    kind: str = "causal_lm"
    lora: Any = None  # trainers.lora.LoraSpec: train adapters only (causal_lm)
    device: str = "auto"  # trainer.device (agentgym.core.device.resolve_device)
    gradient_checkpointing: bool = False  # model.gradient_checkpointing

    def load(self, device=None):
        """The model on ``device`` (a rank's own), else on ``self.device`` resolved here."""
        if self.kind not in ("causal_lm", "value"):
            raise ValueError(f"model kind {self.kind!r}; valid: causal_lm, value")
        loader = load_model if self.kind == "causal_lm" else load_value_model
        model = loader(self.path, self.dtype, device=device or self.device)
        if self.gradient_checkpointing:
            # non-reentrant: exact gradients, and it works with frozen inputs (LoRA)
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
                model.activation_checkpointing_enable(
                    activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora is not None:
            model = wrap(model, self.lora)
        return model


@runtime_checkable
class Backend(Protocol):
    """What the step loop and its phases ask of a trainer backend. Both
    :class:`~agentgym.trainers.backends.single.SingleBackend` (one process) and
    :class:`~agentgym.trainers.backends.distributed.DistributedBackend` (FSDP2 / DeepSpeed
    ranks) satisfy it (``tests/test_backends.py`` checks the signatures)."""

    def logprobs(self, batch: Batch, temperature: float,
                 with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(B, T)`` logprobs of each token under the current weights (and entropies)."""

    def apply(self, fn, batch: Batch) -> list[torch.Tensor]:
        """``fn(model, micro_batch)`` over the batch's micro-batches, without gradients."""

    def split(self, batch: Batch) -> list[Batch]:
        """The batch as this backend's micro-batches (token-budgeted; per rank)."""

    def train_step(self, batches: list[Batch], loss_fn: LossFn,
                   lr_scale: float = 1.0) -> dict[str, float]:
        """One optimizer step over ``batches`` (gradients accumulated), at ``lr_scale``
        times the schedule's rate (:func:`scale_this_step`); its metrics."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights, gathered (what the rollout engines load)."""

    def save(self, path: str, tokenizer=None) -> None:
        """Weights (HF format), optimizer and scheduler state under ``path``."""

    def load(self, path: str) -> None:
        """What :meth:`save` wrote."""

    def close(self) -> None:
        """Release the model (and a sharded backend's rank processes)."""


def first_needed_position(loss_mask: torch.Tensor) -> int:
    """The first token position any row samples (0 when none does): logits before it are
    never read, so :func:`sequence_logprobs` can skip the prompt's vocabulary projection."""
    cols = loss_mask.any(0).nonzero()
    return int(cols[0]) if len(cols) else 0


_KEEPS_LOGITS: dict[type, bool] = {}


def _accepts_logits_to_keep(model) -> bool:
    """Whether ``model(…, logits_to_keep=N)`` works; a wrapper whose forward takes
    ``**kwargs`` (DeepSpeed's engine) answers for the module it wraps."""
    import inspect
    cls = type(model)
    if cls not in _KEEPS_LOGITS:
        params = inspect.signature(cls.forward).parameters
        if "logits_to_keep" in params:
            _KEEPS_LOGITS[cls] = True
        elif any(p.kind is p.VAR_KEYWORD for p in params.values()) and hasattr(model, "module"):
            _KEEPS_LOGITS[cls] = _accepts_logits_to_keep(model.module)
        elif any(p.kind is p.VAR_KEYWORD for p in params.values()) and \
                hasattr(model, "get_base_model"):  # peft passes its **kwargs on
            _KEEPS_LOGITS[cls] = _accepts_logits_to_keep(model.get_base_model())
        else:
            _KEEPS_LOGITS[cls] = False
    return _KEEPS_LOGITS[cls]


def _decoder_and_head(model):
    """``(decoder, lm_head)`` of a plain transformers causal LM (LoRA-wrapped or not) whose
    logits are exactly ``lm_head(decoder(...).last_hidden_state)``; None for anything else
    (FSDP2-sharded modules, whose root hooks gather the head's weights only inside the
    root's forward; DeepSpeed engines; soft-capped or scaled logits), which then take the
    plain path."""
    from transformers import PreTrainedModel
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not isinstance(base, PreTrainedModel) or _is_sharded(model):
        return None
    cfg = base.config
    if getattr(cfg, "final_logit_softcapping", None) or \
            getattr(cfg, "logit_scale", None) not in (None, 1, 1.0):
        return None
    decoder = getattr(base, base.base_model_prefix, None)
    head = base.get_output_embeddings()
    if decoder is None or decoder is base or head is None:
        return None
    return decoder, head


def _is_sharded(model) -> bool:
    """Whether any of the model's weights is sharded: FSDP2 DTensors (the wrapped root may
    be a LoRA wrapper around the transformers model) or ZeRO-3 partitions."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        DTensor = ()
    return any(isinstance(p, DTensor) or hasattr(p, "ds_id") for p in model.parameters())


def _chunk_logprobs(head, temperature: float, with_entropy: bool, entropy_grad: bool,
                    hidden: torch.Tensor, targets: torch.Tensor):
    """Log-probabilities (and entropies) of ``targets`` from ``hidden`` rows ``(N, H)``:
    one chunk's vocabulary logits, in fp32, freed when it returns."""
    logits = head(hidden).float() / (temperature or 1.0)
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None])[:, 0] - lse
    if not with_entropy:
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy


def _chunked(model, parts, input_ids, attention_mask, temperature, with_entropy, s,
             entropy_grad, chunk):
    """:func:`sequence_logprobs` through the decoder's hidden states, projecting ``chunk``
    positions at a time; under grad each chunk is checkpointed, so the backward recomputes
    its logits instead of keeping them (peak: one chunk's ``(chunk, vocab)`` fp32 logits,
    not the whole micro-batch's)."""
    import functools

    from torch.utils.checkpoint import checkpoint
    decoder, head = parts
    B, T = input_ids.shape
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    hidden = hidden[:, s - 1:-1]  # predicts tokens s .. T-1
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = input_ids[:, s:].reshape(-1)
    fn = functools.partial(_chunk_logprobs, head, temperature, with_entropy, entropy_grad)
    lps, ents = [], []
    for i in range(0, flat_h.shape[0], chunk):
        h, t = flat_h[i:i + chunk], flat_t[i:i + chunk]
        if torch.is_grad_enabled():
            lp, ent = checkpoint(fn, h, t, use_reentrant=False)
        else:
            lp, ent = fn(h, t)
        lps.append(lp)
        ents.append(ent)
    logp = torch.zeros((B, T), dtype=torch.float32, device=input_ids.device)
    entropy = torch.zeros_like(logp) if with_entropy else None
    if lps:
        logp[:, s:] = torch.cat(lps).view(B, T - s)
        if with_entropy:
            entropy[:, s:] = torch.cat(ents).view(B, T - s)
    return logp, entropy


def sequence_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      temperature: float = 1.0, with_entropy: bool = False,
                      start: int = 0, entropy_grad: bool = False, images: list | None = None,
                      chunk: int = 0):
    """Per-token logprobs aligned with ``input_ids`` (``[:, 0]`` is 0), shape ``(B, T)``.

    Right-padded input; logits are divided by ``temperature`` (as the rollout engine's
    logprobs are), in fp32. Only tokens from ``start`` on get a logprob (and entropy):
    the model projects hidden states to the vocabulary from position ``start - 1`` only
    (``logits_to_keep``), so a long prompt costs no logits; earlier positions hold 0.
    The entropy (when asked) is differentiable only with ``entropy_grad``. ``images``:
    per row, the prompt's processed images (VL models: pixel values and the 3-D positions
    the engine used, :func:`agentgym.models.vision.vl_forward_kwargs`). ``chunk`` > 0: at most
    that many positions' vocabulary logits exist at once (``trainer.logprob_chunk``;
    plain transformers text models; the same values and gradients, see
    :func:`_chunked`).
    """
    B, T = input_ids.shape
    s = max(start, 1)
    kw = {}
    if images is not None or getattr(getattr(model, "config", None), "vision_config", None):
        kw = vl_forward_kwargs(model, input_ids, attention_mask, images)
    if chunk > 0 and not kw and s < T and (parts := _decoder_and_head(model)) is not None:
        return _chunked(model, parts, input_ids, attention_mask, temperature, with_entropy, s,
                        entropy_grad, chunk)
    if _accepts_logits_to_keep(model):
        logits = model(input_ids=input_ids, attention_mask=attention_mask,
                       logits_to_keep=T - s + 1, **kw).logits
    else:
        logits = model(input_ids=input_ids, attention_mask=attention_mask,
                       **kw).logits[:, s - 1:]
    logits = logits[:, :-1].float() / (temperature or 1.0)  # predicts tokens s .. T-1
    if kw:  # a VL model: the vision special tokens are never sampled (agentgym.models.vision)
        logits = suppress_vision_tokens(logits, vision_token_ids(model))
    lse = torch.logsumexp(logits, dim=-1)  # avoids a second (B, T, V) log_softmax copy
    logp = torch.zeros((B, T), dtype=torch.float32, device=input_ids.device)
    logp[:, s:] = logits.gather(-1, input_ids[:, s:, None])[..., 0] - lse
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            probs = torch.softmax(logits, dim=-1)
            entropy = torch.zeros_like(logp)
            entropy[:, s:] = lse - (probs * logits).sum(-1)
    return logp, entropy


def _gathered(model, ids, attn, rows, cols, temperature, with_entropy, entropy_grad,
              images, chunk):
    """An unpackable model's padded pass (a vision-language model, sliding-window layers),
    projecting only the hidden states that predict ``(rows, cols)``."""
    kw = {}
    vision = images is not None or getattr(getattr(model, "config", None),
                                           "vision_config", None)
    if vision:
        kw = vl_forward_kwargs(model, ids, attn, images)
    targets = ids[rows, cols]
    parts = _decoder_and_head(model)
    if parts is not None:
        hidden = parts[0](input_ids=ids, attention_mask=attn, use_cache=False,
                          **kw).last_hidden_state[rows, cols - 1]
        if not vision:
            return head_logprobs(parts[1], hidden, targets, temperature, with_entropy,
                                 entropy_grad, chunk)
        logits = parts[1](hidden)
    elif _accepts_logits_to_keep(model):  # sharded: the head runs inside the root's
        need = torch.unique(cols - 1)         # forward, on the needed columns only
        logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=need, use_cache=False,
                       **kw).logits
        logits = logits[rows, torch.searchsorted(need, cols - 1)]
    else:  # a model without logits_to_keep: its logits, read at the needed positions
        logits = model(input_ids=ids, attention_mask=attn, **kw).logits[rows, cols - 1]
    if vision:  # the vision special tokens are never sampled (agentgym.models.vision)
        logits = suppress_vision_tokens(logits, vision_token_ids(model))
    return plain_logprobs(logits, targets, temperature, with_entropy, entropy_grad)


def token_logprobs(model, mb: Batch, device, temperature: float = 1.0,
                   with_entropy: bool = False, entropy_grad: bool = False, chunk: int = 0,
                   packing: bool = True):
    """``(B, T)`` logprobs (and entropies) of the micro-batch's sampled tokens
    (``loss_mask > 0``; 0 elsewhere), what every loss term and metric reads.

    ``packing`` (``trainer.packing``): one packed row, each group's shared prefix once,
    no padding, the vocabulary head only on the positions read, fused
    (:mod:`agentgym.trainers.packing`, :mod:`agentgym.trainers.attention`,
    :mod:`agentgym.trainers.fused_head`); a model that
    cannot be packed runs its padded rows but still projects only those positions.
    Without it: :func:`sequence_logprobs`, the padded pass from the first sampled column.
    """
    from agentgym.trainers import attention  # loads transformers: heavy
    ids, attn = mb.input_ids.to(device), mb.attention_mask.to(device)
    if not packing:
        return sequence_logprobs(model, ids, attn, temperature, with_entropy,
                                 start=first_needed_position(mb.loss_mask),
                                 entropy_grad=entropy_grad, images=mb.images, chunk=chunk)
    if mb.images is not None or not attention.enable(model):
        rows, cols = pk.needed(mb.loss_mask).nonzero(as_tuple=True)
        dummy = len(rows) == 0  # nothing sampled: read one position, counted as 0
        if dummy:
            rows, cols = torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long)
        lp, ent = _gathered(model, ids, attn, rows.to(device), cols.to(device), temperature,
                            with_entropy, entropy_grad, mb.images, chunk)
        shape = tuple(mb.input_ids.shape)
        return pk.scatter_at(lp, shape, rows, cols, dummy), \
            (pk.scatter_at(ent, shape, rows, cols, dummy) if with_entropy else None)
    lengths = mb.attention_mask.sum(-1).tolist()
    pack = pk.build_pack(mb.input_ids, lengths, mb.loss_mask, groups=mb.uids)
    kw = pack.model_kwargs(device)
    at, targets = pack.hidden_at.to(device), pack.targets.to(device)
    parts = _decoder_and_head(model)
    if parts is not None:
        with attention.packed_forward():
            hidden = parts[0](**kw).last_hidden_state[0, at]
        lp, ent = head_logprobs(parts[1], hidden, targets, temperature, with_entropy,
                                entropy_grad, chunk)
    else:  # sharded: the root's forward projects the gathered positions only
        with attention.packed_forward():
            logits = model(**kw, logits_to_keep=at).logits[0]
        lp, ent = plain_logprobs(logits, targets, temperature, with_entropy, entropy_grad)
    return pk.scatter(lp, pack), (pk.scatter(ent, pack) if with_entropy else None)


def make_adamw(params, **kw) -> torch.optim.AdamW:
    """AdamW, fused (one kernel over all tensors) where torch has it for the parameters'
    device: plain tensors on CUDA or the CPU; sharded ones (DTensors) keep foreach."""
    params = list(params)
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        DTensor = ()
    fused = bool(params) and all(
        not isinstance(p, DTensor) and has_fused_adamw(p.device) and p.is_floating_point()
        for p in params) and len({p.device for p in params}) == 1
    return torch.optim.AdamW(params, fused=fused or None, **kw)


def add_metrics(totals: dict, metrics: dict) -> None:
    """Add a micro-batch's metrics into ``totals`` (sums; keys ending in ``_max`` keep the
    maximum). Values may be floats or 0-dim tensors: nothing here waits on the device."""
    for k, v in metrics.items():
        if k not in totals:
            totals[k] = v
        elif k.endswith("_max"):
            a, b = totals[k], v
            if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
                dev = a.device if isinstance(a, torch.Tensor) else b.device
                totals[k] = torch.maximum(torch.as_tensor(a, device=dev).float(),
                                          torch.as_tensor(b, device=dev).float())
            else:
                totals[k] = max(a, b)
        else:
            totals[k] = totals[k] + v


def as_floats(values: dict) -> dict[str, float]:
    """``values`` as Python floats, with one host sync per device holding any of them."""
    out = {k: float(v) for k, v in values.items() if not isinstance(v, torch.Tensor)}
    by_device: dict = {}
    for k, v in values.items():
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(k)
    for keys in by_device.values():
        flat = torch.stack([values[k].detach().float().reshape(()) for k in keys]).tolist()
        out.update(zip(keys, flat))
    return {k: out[k] for k in values}


@torch.no_grad()
def batched_apply(model, batch: Batch, micro_batch_tokens: int, fn,
                  packing: bool = False) -> list[torch.Tensor]:
    """``fn(model, micro_batch, device) -> tuple of tensors`` over token-budgeted
    micro-batches of ``batch`` in eval mode, without grad; ``(b, t)`` outputs are padded
    back to the batch width. Returns the outputs in ``batch``'s row order. ``packing``:
    micro-batches of whole groups by packed tokens (:func:`split`)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    width = batch.input_ids.shape[1]
    parts: list[list[torch.Tensor]] = []
    index = split(batch, micro_batch_tokens, packing)
    try:
        for idx in index:
            outs = fn(model, batch.select(idx), device)
            parts.append([o.cpu() if o.dim() == 1 else
                          torch.nn.functional.pad(o.cpu(), (0, width - o.shape[1]))
                          for o in outs])
    finally:
        model.train(was_training)
    order = torch.tensor([i for idx in index for i in idx]).argsort()
    return [torch.cat(col)[order] for col in zip(*parts)]


@dataclass(frozen=True)
class LogprobFn:
    """:func:`sequence_logprobs` as an :func:`batched_apply` function (picklable)."""

    temperature: float
    with_entropy: bool = False
    chunk: int = 0  # trainer.logprob_chunk
    packing: bool = True  # trainer.packing

    def __call__(self, model, mb: Batch, device):
        lp, ent = token_logprobs(model, mb, device, self.temperature, self.with_entropy,
                                 chunk=self.chunk, packing=self.packing)
        return (lp, ent) if self.with_entropy else (lp,)


def batched_logprobs(model, batch: Batch, temperature: float, micro_batch_tokens: int,
                     with_entropy: bool = False, chunk: int = 0, packing: bool = True):
    """:func:`token_logprobs` over a whole batch in token-budgeted micro-batches."""
    out = batched_apply(model, batch, micro_batch_tokens,
                        LogprobFn(temperature, with_entropy, chunk, packing), packing)
    return out[0], (out[1] if with_entropy else None)


def scale_this_step(optimizer, scheduler, scale: float) -> None:
    """Multiply every parameter group's rate by ``scale`` for the optimizer step that
    follows (the SFT's per-env rate: :func:`agentgym.trainers.sft.sft`). Nothing to undo:
    the ``LambdaLR`` step after it sets each group's rate afresh from its base rate."""
    if scale == 1.0:
        return
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        raise TypeError(f"a per-step rate scale needs a LambdaLR schedule (it resets the "
                        f"rate after each step); got {type(scheduler).__name__}")
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * scale
