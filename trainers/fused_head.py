"""Per-token log-probabilities (and entropies) of chosen tokens from hidden states, through
the vocabulary head in chunks, with their gradients from one pass.

``head_logprobs(head, hidden, targets, temperature, with_entropy)`` is what the update
calls on the hidden states at the positions the loss reads (:mod:`agentgym.trainers.
packing`). For a plain ``nn.Linear`` head it runs :class:`HeadLogprobs`: the forward goes
over ``chunk`` rows at a time, computing each chunk's fp32 logits once, its
log-normaliser, the targets' log-probabilities and (when asked) the entropies; it keeps
each chunk's log-softmax for the backward while they fit in ``keep_bytes`` (else the
backward recomputes that chunk's logits). The backward turns the upstream gradients of
log-prob and entropy into the logits' gradient in closed form::

    d logp_i / d z = onehot(target_i) - p_i
    d H_i    / d z = -p_i * (log p_i + H_i)

and from it the hidden states' and the head weight's gradients, chunk by chunk: no
``(M, V)`` tensor is kept beyond the saved log-softmax, no autograd graph over the
vocabulary is built, the head's forward is not run twice, and at temperature 1 the logits
are not copied to be divided. Under autocast the matmuls run in the autocast dtype and
everything past them in fp32, as the unfused path does.

Anything else (a sharded head, a LoRA-wrapped head, a head with a bias, vision token
suppression) takes :func:`plain_logprobs` on the gathered rows: the same values, with
autograd. liger-kernel's fused linear losses are GPU (Triton) kernels and fuse a fixed
loss into the head; this one fuses only the log-prob and entropy, so every policy loss of
:mod:`agentgym.trainers.algos` keeps working unchanged (docs/DECISIONS.md).
"""

from __future__ import annotations

import torch

from agentgym.models.plan import HEAD_KEEP_BYTES

#: rows of hidden states projected to the vocabulary at once
CHUNK = 1024
#: the most bytes of fp32 log-softmax the forward keeps for the backward (past it, the
#: backward recomputes the chunks that did not fit); the memory planner counts it
KEEP_BYTES = HEAD_KEEP_BYTES


def _compute_dtype(device_type: str, weight: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


def _logits(h: torch.Tensor, w: torch.Tensor, cd: torch.dtype, temperature: float):
    z = h.to(cd) @ w.to(cd).t()
    z = z.float() if z.dtype != torch.float32 else z
    return z.div_(temperature) if temperature != 1.0 else z


def _log_softmax_(z: torch.Tensor) -> torch.Tensor:
    """``z`` turned into its log-softmax in place (no ``(rows, V)`` copy)."""
    return z.sub_(torch.logsumexp(z, -1, keepdim=True))


class HeadLogprobs(torch.autograd.Function):
    """``(logp (M,), entropy (M,) or empty)`` of ``targets`` under ``hidden @ weight.T``."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, with_entropy: bool,
                chunk: int, keep_bytes: int):
        cd = _compute_dtype(hidden.device.type, weight)
        M = hidden.shape[0]
        logp = torch.empty(M, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(M if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        kept: list[torch.Tensor | None] = []
        budget = keep_bytes
        for a in range(0, M, chunk):
            logq = _log_softmax_(_logits(hidden[a:a + chunk], weight, cd, temperature))
            logp[a:a + chunk] = logq.gather(-1, targets[a:a + chunk, None])[:, 0]
            if with_entropy:
                ent[a:a + chunk] = -torch.exp(logq).mul_(logq).sum(-1)
            size = logq.numel() * 4
            if keep_bytes >= 0:  # -1: no backward will run (a no-grad pass)
                if size <= budget:
                    kept.append(logq)
                    budget -= size
                else:
                    kept.append(None)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.kept, ctx.cd, ctx.temperature, ctx.chunk = kept, cd, temperature, chunk
        ctx.ent = ent if with_entropy else None
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(targets)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets = ctx.saved_tensors
        cd, temperature, chunk = ctx.cd, ctx.temperature, ctx.chunk
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if ctx.ent is None:
            g_ent = None
        if (g_logp is None and g_ent is None) or not (want_h or want_w):
            return None, None, None, None, None, None, None
        d_hidden = torch.empty_like(hidden) if want_h else None
        d_weight = None
        w = weight.to(cd)
        for k, a in enumerate(range(0, hidden.shape[0], chunk)):
            h = hidden[a:a + chunk]
            logq = ctx.kept[k] if k < len(ctx.kept) else None
            ctx.kept[k:k + 1] = [None] * (k < len(ctx.kept))  # freed as it is used
            if logq is None:
                logq = _log_softmax_(_logits(h, weight, cd, temperature))
            # dz = g_lp * (onehot - p) + g_ent * (-p * (log p + H)), in place over logq
            p = torch.exp(logq)
            if g_ent is not None:
                dz = logq.add_(ctx.ent[a:a + chunk, None]).mul_(g_ent[a:a + chunk, None].float())
                if g_logp is not None:
                    dz.add_(g_logp[a:a + chunk, None].float())
                dz.mul_(p).neg_()
            else:
                dz = p.mul_(g_logp[a:a + chunk, None].float().neg())
            del p, logq
            if g_logp is not None:
                dz.scatter_add_(-1, targets[a:a + chunk, None],
                                g_logp[a:a + chunk, None].float())
            if temperature != 1.0:
                dz.div_(temperature)
            dzc = dz.to(cd)
            if want_h:
                d_hidden[a:a + chunk] = (dzc @ w).to(hidden.dtype)
            if want_w:
                part = dzc.t() @ h.to(cd)
                if d_weight is None:
                    d_weight = part.float() if part.dtype != torch.float32 else part
                else:
                    d_weight.add_(part)
        ctx.kept = None
        if d_weight is not None:
            d_weight = d_weight.to(weight.dtype)
        return d_hidden, d_weight, None, None, None, None, None


def plain_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                   with_entropy: bool, entropy_grad: bool = True):
    """Log-probabilities and entropies (detached unless ``entropy_grad``) from
    ``(M, V)`` logits, with autograd."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    logq = torch.log_softmax(z, -1)
    logp = logq.gather(-1, targets[:, None])[:, 0]
    if not with_entropy:
        return logp, None
    ent = -(logq.exp() * logq).sum(-1)
    return logp, (ent if entropy_grad else ent.detach())


def fusable(head) -> bool:
    """A plain ``nn.Linear`` without bias whose weight is an ordinary tensor."""
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return True
    return not isinstance(head.weight, DTensor) and not hasattr(head.weight, "ds_id")


def head_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                  with_entropy: bool = False, entropy_grad: bool = False,
                  chunk: int = CHUNK, keep_bytes: int = KEEP_BYTES):
    """``(logp (M,), entropy (M,) or None)`` of ``targets`` from ``hidden`` ``(M, H)``.

    The entropy is differentiable only with ``entropy_grad``."""
    temperature = float(temperature or 1.0)
    if fusable(head):
        logp, ent = HeadLogprobs.apply(hidden, head.weight, targets, temperature,
                                       with_entropy, chunk or CHUNK,
                                       keep_bytes if torch.is_grad_enabled() else -1)
        if not with_entropy:
            return logp, None
        return logp, (ent if entropy_grad else ent.detach())
    step = chunk or max(1, hidden.shape[0])
    parts = [plain_logprobs(head(hidden[a:a + step]), targets[a:a + step], temperature,
                            with_entropy, entropy_grad)
             for a in range(0, hidden.shape[0], step)]
    if not parts:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    logp = torch.cat([lp for lp, _ in parts])
    return logp, (torch.cat([e for _, e in parts]) if with_entropy else None)
