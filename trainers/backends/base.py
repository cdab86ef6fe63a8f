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

from agentgym.trainers.batch import Batch

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
        from agentgym.models.zoo import load_model, load_value_model
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
            from agentgym.trainers.lora import wrap
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

    def train_step(self, batches: list[Batch], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over ``batches`` (gradients accumulated); its metrics."""

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
        from agentgym.models.vision import vl_forward_kwargs
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
        from agentgym.models.vision import suppress_vision_tokens, vision_token_ids
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


@torch.no_grad()
def batched_apply(model, batch: Batch, micro_batch_tokens: int, fn) -> list[torch.Tensor]:
    """``fn(model, micro_batch, device) -> tuple of tensors`` over token-budgeted
    micro-batches of ``batch`` in eval mode, without grad; ``(b, t)`` outputs are padded
    back to the batch width. Returns the outputs concatenated in ``batch``'s row order."""
    from agentgym.trainers.batch import micro_batches

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    width = batch.input_ids.shape[1]
    parts: list[list[torch.Tensor]] = []
    lengths = batch.attention_mask.sum(-1).tolist()
    try:
        for idx in micro_batches(lengths, micro_batch_tokens):
            outs = fn(model, batch.select(idx), device)
            parts.append([o.cpu() if o.dim() == 1 else
                          torch.nn.functional.pad(o.cpu(), (0, width - o.shape[1]))
                          for o in outs])
    finally:
        model.train(was_training)
    return [torch.cat(col) for col in zip(*parts)]


@dataclass(frozen=True)
class LogprobFn:
    """:func:`sequence_logprobs` as an :func:`batched_apply` function (picklable)."""

    temperature: float
    with_entropy: bool = False
    chunk: int = 0  # trainer.logprob_chunk

    def __call__(self, model, mb: Batch, device):
        lp, ent = sequence_logprobs(model, mb.input_ids.to(device), mb.attention_mask.to(device),
                                    self.temperature, self.with_entropy,
                                    start=first_needed_position(mb.loss_mask),
                                    images=mb.images, chunk=self.chunk)
        return (lp, ent) if self.with_entropy else (lp,)


def batched_logprobs(model, batch: Batch, temperature: float, micro_batch_tokens: int,
                     with_entropy: bool = False, chunk: int = 0):
    """:func:`sequence_logprobs` over a whole batch in token-budgeted micro-batches."""
    out = batched_apply(model, batch, micro_batch_tokens,
                        LogprobFn(temperature, with_entropy, chunk))
    return out[0], (out[1] if with_entropy else None)
